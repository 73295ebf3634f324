"""Device, dtype and, on Linux CPU, which BLAS MLX uses.

Knows nothing about models. The `mlx[cpu]` wheel links a reference BLAS (verifying k+1 tokens then
costs k+1 single steps, so speculation cannot pay); a real BLAS loaded with RTLD_GLOBAL *before*
`mlx.core` is first imported takes its place. `preload_blas()` is that one piece of import-time
global state, run by `tinydraft_mlx/__init__.py` first thing and switchable with
TINYDRAFT_BLAS=auto|mkl|openblas|off|/path/to/lib.so (auto: MKL from the `mkl` extra, else a
system OpenBLAS). It does nothing on macOS, where MLX uses Metal and Accelerate, and under "auto"
nothing where MLX's CUDA build is installed (`mlx[cuda]`: it computes on the GPU; an explicit
choice still loads, for CPU runs on such a machine).

MKL runs one thread unless MKL_NUM_THREADS (or OMP_NUM_THREADS) says otherwise: measured on the
2-core machines (bench/studies/threads.py, results/threads.json), a second MKL thread gains at
most ~1.9x on an idle machine (a 5-token forward of a Qwen2.5-0.5B shape) and loses on the demo
pair, but spins when another process holds a core: speculative demo decoding fell from 268 to 25
tok/s with both cores busy (one run: 6 tok/s).

What MLX really uses is read from the process, not assumed: `active_blas()` names the library that
provides `cblas_sgemm` in the global symbol scope (an LD_PRELOAD, or a library loaded with
RTLD_GLOBAL before `mlx.core`), which is where MLX's calls bind; with none there they bind to the
reference BLAS bundled in the `mlx[cpu]` wheel. So `import mlx_lm` before `tinydraft_mlx` (the
preload then comes too late) is reported as the reference BLAS, with a notice and the fix.

Also here: the default dtype for a device (float32 on the CPU, the checkpoint's own on a GPU) and
the dedicated stream generation runs on (as mlx-lm's `generation_stream`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings
from pathlib import Path

BLAS_ENV = "TINYDRAFT_BLAS"
MKL_THREADS = "1"  # MKL_NUM_THREADS when the user sets neither it nor OMP_NUM_THREADS
_blas: str | None = None  # what preload_blas() settled on
_late = False  # mlx.core was imported before preload_blas() could act
_skipped_for_gpu = False  # "auto" left the BLAS alone: MLX's CUDA build is installed
_warned = False


def mkl_candidates() -> list[str]:
    """Paths of the MKL runtime libraries (libmkl_rt.so*) in this environment's lib folders."""
    roots = {Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"}
    return [str(p) for root in sorted(roots) for p in sorted(root.glob("libmkl_rt.so*"))]


def _openblas_candidates() -> list[str]:
    found = ctypes.util.find_library("openblas")
    return ["libopenblas.so.0"] + ([found] if found else [])


def _load_first(kind: str, paths: list[str]) -> str | None:
    for path in paths:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return f"{kind} ({path})"
        except OSError:
            continue
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def mapped_blas() -> str:
    """The BLAS that `cblas_sgemm` resolves to in this process's global symbol scope, where MLX's
    calls bind first: "mkl (path)", "openblas (path)", "other (path)", or "reference" when no
    library there provides it (MLX then uses the reference BLAS bundled in its wheel). Linux only.
    """
    process = ctypes.CDLL(None)  # dlopen(NULL): the global scope
    try:
        address = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        return "reference"
    info = _DlInfo()
    if not process.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return "other (unknown library)"
    path = os.path.realpath(info.dli_fname.decode())
    name = os.path.basename(path).lower()
    kind = "mkl" if "mkl" in name else "openblas" if "openblas" in name else "other"
    return f"{kind} ({path})"


CUDA_DISTRIBUTIONS = ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")  # what `mlx[cuda]` installs


def mlx_cuda_installed() -> bool:
    """Whether MLX's CUDA build is installed (read from the installed distributions, without
    importing `mlx.core`, which the preload must come before)."""
    from importlib import metadata

    for name in CUDA_DISTRIBUTIONS:
        try:
            metadata.distribution(name)
            return True
        except metadata.PackageNotFoundError:
            continue
    return False


def preload_blas(choice: str | None = None) -> str:
    """Load the chosen BLAS before MLX is imported and return the BLAS MLX then uses
    (idempotent). Too late once `mlx.core` is imported: that is detected and reported. "auto"
    loads nothing where MLX's CUDA build is installed: the preload is for MLX's CPU backend."""
    global _blas, _late, _skipped_for_gpu
    if _blas is not None:
        return _blas
    if sys.platform != "linux":
        _blas = "platform default"
        return _blas
    choice = (choice or os.environ.get(BLAS_ENV) or "auto").strip()
    _late = "mlx.core" in sys.modules
    _skipped_for_gpu = choice == "auto" and mlx_cuda_installed()
    if not _late and choice != "off" and not _skipped_for_gpu:
        _load_choice(choice)
    _blas = mapped_blas()
    return _blas


def _load_choice(choice: str) -> None:
    tried = {
        "mkl": lambda: _load_first("mkl", mkl_candidates()),
        "openblas": lambda: _load_first("openblas", _openblas_candidates()),
    }
    if choice in ("auto", "mkl") and not ({"MKL_NUM_THREADS", "OMP_NUM_THREADS"} & set(os.environ)):
        os.environ["MKL_NUM_THREADS"] = MKL_THREADS  # read by MKL when it loads, just below
    if choice == "auto":
        tried["mkl"]() or tried["openblas"]()
    elif choice in tried:
        if tried[choice]() is None:
            warnings.warn(f"{BLAS_ENV}={choice}: library not found; using the reference BLAS. "
                          "For MKL: pip install 'tinydraft-mlx[mkl]'", stacklevel=3)
    elif _load_first("custom", [choice]) is None:
        warnings.warn(f"{BLAS_ENV}={choice}: cannot load that library; using the reference "
                      "BLAS", stacklevel=3)


def active_blas() -> str:
    """The BLAS MLX's CPU backend uses in this process, read from the process (see
    `mapped_blas`): "mkl (path)", "openblas (path)", "reference", or "platform default" off
    Linux."""
    return _blas if _blas is not None else preload_blas()


def warn_if_slow_blas() -> None:
    """Warn once when MLX computes on Linux CPU with the reference BLAS it was not told to use."""
    global _warned
    if _warned or device_name() != "cpu" or active_blas() != "reference":
        return
    if os.environ.get(BLAS_ENV, "auto").strip() == "off":
        return
    _warned = True
    if _skipped_for_gpu:
        fix = ("MLX's CUDA build is installed, so no BLAS was preloaded for the CPU. Fix: for "
               f"CPU runs on this machine set {BLAS_ENV}=mkl (or openblas) before starting.")
    elif _late:
        fix = ("mlx.core was imported before tinydraft_mlx, so its BLAS preload came too late. "
               "Fix: import tinydraft_mlx before mlx and mlx_lm (or start Python with "
               "LD_PRELOAD=/path/to/libmkl_rt.so), then restart.")
    else:
        fix = ("Fix: pip install 'tinydraft-mlx[mkl]' (or install libopenblas0), then restart; "
               f"{BLAS_ENV}=off silences this.")
    warnings.warn(
        "MLX is running on the CPU with the reference BLAS (about 6x slower decoding, 60x slower "
        f"prefill, and verification that costs k+1 single steps). {fix}",
        stacklevel=3,
    )


def device_name() -> str:
    """Return "gpu" or "cpu": where MLX runs by default in this process."""
    import mlx.core as mx

    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def default_dtype(device: str | None = None):
    """The weight dtype when none is asked for: float32 on the CPU backend (half-precision and
    quantized matmuls there skip BLAS and measured slower), None on a GPU: keep the checkpoint's
    own dtype, as mlx-lm does (bfloat16 for Qwen2.5; casting bf16-trained weights to float16
    risks overflow). `device`: "cpu" or "gpu", default `device_name()`."""
    import mlx.core as mx

    return None if (device or device_name()) == "gpu" else mx.float32


def resolve_dtype(dtype, device: str | None = None):
    """Turn None, a name ("float32", "float16", "bfloat16") or an mx.Dtype into the dtype to cast
    the weights to; None means keep the checkpoint's own (see `default_dtype`)."""
    import mlx.core as mx

    names = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, mx.Dtype):
        if dtype not in names.values():
            raise ValueError(f"dtype must be one of {sorted(names)} (got {dtype})")
        return dtype
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(names)} (got {dtype!r})")
    return names[dtype]


_streams: dict[str, object] = {}


def generation_stream():
    """The stream generation runs on: mlx-lm's own `generation_stream` when it is on the current
    default device (thread-local: each thread that generates gets its own), else one made the
    same way for that device on first use.

    One stream, not a second: a process that also runs mlx-lm's generation (`generate_step`)
    would otherwise have two generation streams, i.e. two threads calling the BLAS on the CPU
    backend, which measured ~3x slower for both (plain demo decoding 419 -> 136-142 tok/s)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream as mlx_lm_stream

    device = mx.default_device()
    if mlx_lm_stream.device == device:
        return mlx_lm_stream
    name = str(device)
    if name not in _streams:
        _streams[name] = mx.new_thread_local_stream(device)
    return _streams[name]


def kernel_cache() -> Path | None:
    """Where MLX's CPU backend keeps the kernels it compiled with the system compiler (Linux:
    the temp directory's mlx/<version>/cpu; None elsewhere): a machine's first runs compile
    them, which slows those runs down (several hundred kernels over the test suite)."""
    if not sys.platform.startswith("linux"):
        return None
    import tempfile

    import mlx.core as mx

    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"


def compiled_kernels() -> int:
    """How many kernels MLX's CPU kernel cache holds now (its shared libraries, one a kernel
    beside its source; 0 where there is none)."""
    where = kernel_cache()
    return sum(1 for _ in where.glob("*.so")) if where is not None and where.is_dir() else 0

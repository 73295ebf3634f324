"""Device, dtype and, on Linux CPU, which BLAS MLX uses.

Knows nothing about models. The `mlx[cpu]` wheel links a reference BLAS (verifying k+1 tokens then
costs k+1 single steps, so speculation cannot pay); a real BLAS loaded with RTLD_GLOBAL *before*
`mlx.core` is first imported takes its place. `preload_blas()` is that one piece of import-time
global state, run by `tinydraft_mlx/__init__.py` first thing and switchable with
TINYDRAFT_BLAS=auto|mkl|openblas|off|/path/to/lib.so (auto: MKL from the `mkl` extra, else a
system OpenBLAS). It does nothing on macOS, where MLX uses Metal and Accelerate.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings
from pathlib import Path

BLAS_ENV = "TINYDRAFT_BLAS"
_blas: str | None = None  # what preload_blas() settled on
_warned = False


def _mkl_candidates() -> list[str]:
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


def preload_blas(choice: str | None = None) -> str:
    """Load the chosen BLAS before MLX is imported and return its name (idempotent)."""
    global _blas
    if _blas is not None:
        return _blas
    if sys.platform != "linux":
        _blas = "platform default"
        return _blas
    choice = (choice or os.environ.get(BLAS_ENV) or "auto").strip()
    if "mlx.core" in sys.modules and choice != "off":
        _blas = "unknown (mlx.core was imported before tinydraft_mlx)"
        return _blas
    if choice == "off":
        _blas = "reference"
        return _blas
    tried = {
        "mkl": lambda: _load_first("mkl", _mkl_candidates()),
        "openblas": lambda: _load_first("openblas", _openblas_candidates()),
    }
    if choice == "auto":
        _blas = tried["mkl"]() or tried["openblas"]() or "reference"
    elif choice in tried:
        _blas = tried[choice]() or "reference"
        if _blas == "reference":
            warnings.warn(f"{BLAS_ENV}={choice}: library not found; using the reference BLAS. "
                          "For MKL: pip install 'tinydraft-mlx[mkl]'", stacklevel=2)
    else:
        _blas = _load_first("custom", [choice]) or "reference"
        if _blas == "reference":
            warnings.warn(f"{BLAS_ENV}={choice}: cannot load that library; using the reference "
                          "BLAS", stacklevel=2)
    return _blas


def active_blas() -> str:
    """The BLAS MLX's CPU backend uses in this process (after `preload_blas`)."""
    return _blas if _blas is not None else preload_blas()


def warn_if_slow_blas() -> None:
    """Warn once when MLX computes on Linux CPU with the reference BLAS it was not told to use."""
    global _warned
    if _warned or device_name() != "cpu" or active_blas() != "reference":
        return
    if os.environ.get(BLAS_ENV, "auto").strip() == "off":
        return
    _warned = True
    warnings.warn(
        "MLX is running on the CPU with the reference BLAS (about 6x slower decoding, 60x slower "
        "prefill, and verification that costs k+1 single steps). Fix: pip install "
        "'tinydraft-mlx[mkl]' (or install libopenblas0), then restart; "
        f"{BLAS_ENV}=off silences this.",
        stacklevel=3,
    )


def device_name() -> str:
    """Return "gpu" or "cpu": where MLX runs by default in this process."""
    import mlx.core as mx

    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def default_dtype():
    """float32 on the CPU backend (half-precision matmuls there skip BLAS and are slower),
    float16 on a GPU backend."""
    import mlx.core as mx

    return mx.float16 if device_name() == "gpu" else mx.float32


def resolve_dtype(dtype):
    """Turn None, a name ("float32", "float16", "bfloat16") or an mx.Dtype into an mx.Dtype."""
    import mlx.core as mx

    names = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
    if dtype is None:
        return default_dtype()
    if isinstance(dtype, mx.Dtype):
        if dtype not in names.values():
            raise ValueError(f"dtype must be one of {sorted(names)} (got {dtype})")
        return dtype
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(names)} (got {dtype!r})")
    return names[dtype]

"""The BLAS preload (Linux CPU): a real BLAS gives the reference BLAS's numbers, the choice is
reported from what the process really maps, and a slow setup is warned about once with the fix.
Each case runs in a fresh process, since the preload must happen before `mlx.core` is first
imported. CPU-only: on a GPU (and on macOS) MLX does not use this BLAS."""

import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = """
import json, sys, warnings
warnings.simplefilter("always")
if len(sys.argv) > 2:  # the mlx-lm user's natural order: mlx_lm first
    import mlx_lm
import tinydraft_mlx
from tinydraft_mlx import load_models
import mlx.core as mx
target, _, tok = load_models(sys.argv[1], "none")
logits = target(mx.array([[269, 70, 305, 83, 29, 342, 322, 12, 5, 77] * 8]))[0]
print(json.dumps({"blas": tinydraft_mlx.active_blas(), "logits": logits.tolist()}))
"""

on_linux_x86 = sys.platform == "linux" and platform.machine() == "x86_64"
pytestmark = pytest.mark.cpu_only


def _mkl_path() -> str:
    from tinydraft_mlx.engine.backend import mkl_candidates

    return mkl_candidates()[0]


def _run(blas: str, directory, *extra: str, preload: str | None = None,
         path: str | None = None) -> tuple[dict, str]:
    env = [f"TINYDRAFT_BLAS={blas}"] + ([f"LD_PRELOAD={preload}"] if preload else [])
    if path is not None:  # a directory put first on the child's sys.path
        env.append(f"PYTHONPATH={os.pathsep.join([path, os.environ.get('PYTHONPATH', '')])}")
    env_cmd = ["env", *env, sys.executable, "-c", SCRIPT, str(directory), *extra]
    result = subprocess.run(env_cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.mark.skipif(not on_linux_x86, reason="the BLAS preload only acts on Linux x86-64 here")
def test_mkl_agrees_with_reference_blas(checkpoints):
    ref, ref_err = _run("off", checkpoints["target"])
    fast, fast_err = _run("mkl", checkpoints["target"])
    assert ref["blas"] == "reference"
    assert fast["blas"].startswith("mkl ("), "the test extra installs MKL on Linux x86-64"
    np.testing.assert_allclose(np.array(fast["logits"]), np.array(ref["logits"]), atol=1e-4)
    assert "reference BLAS" not in ref_err  # chosen explicitly with off: no nagging
    assert "reference BLAS" not in fast_err


@pytest.mark.skipif(sys.platform != "linux", reason="the reference-BLAS warning is Linux-only")
def test_unloadable_choice_falls_back_and_warns_once_with_the_fix(checkpoints):
    out, err = _run("/no/such/libblas.so", checkpoints["target"])
    assert out["blas"] == "reference"
    assert "cannot load that library" in err
    assert err.count("pip install 'tinydraft-mlx[mkl]'") == 1


@pytest.mark.skipif(not on_linux_x86, reason="the BLAS preload only acts on Linux x86-64 here")
def test_mlx_lm_imported_first_is_detected_and_reported(checkpoints):
    """`import mlx_lm` before tinydraft_mlx makes the preload too late: active_blas() says
    "reference" (read from the process) and one notice names the fix."""
    out, err = _run("auto", checkpoints["target"], "mlx-first")
    assert out["blas"] == "reference"
    assert err.count("imported before tinydraft_mlx") == 1
    assert "import tinydraft_mlx before mlx and mlx_lm" in err


@pytest.mark.skipif(not on_linux_x86, reason="the BLAS preload only acts on Linux x86-64 here")
def test_blas_is_read_from_the_process_not_assumed(checkpoints):
    """Same import order, but MKL put in the global scope by LD_PRELOAD: MLX binds to it, and
    active_blas() says so (no notice); its logits equal the reference BLAS's."""
    out, err = _run("auto", checkpoints["target"], "mlx-first", preload=_mkl_path())
    assert out["blas"].startswith("mkl (") and "libmkl_rt" in out["blas"]
    assert "reference BLAS" not in err
    ref, _ = _run("off", checkpoints["target"])
    np.testing.assert_allclose(np.array(out["logits"]), np.array(ref["logits"]), atol=1e-4)


THREADS_SCRIPT = """
import ctypes, json, os, sys
import tinydraft_mlx
lib = ctypes.CDLL(tinydraft_mlx.active_blas().split(" (")[1].rstrip(")"))
print(json.dumps({"env": os.environ.get("MKL_NUM_THREADS"), "mkl": lib.MKL_Get_Max_Threads()}))
"""


@pytest.mark.skipif(not on_linux_x86, reason="the BLAS preload only acts on Linux x86-64 here")
@pytest.mark.parametrize("env, expected", [({}, 1), ({"MKL_NUM_THREADS": "2"}, 2),
                                           ({"OMP_NUM_THREADS": "2"}, 2)])
def test_mkl_runs_one_thread_unless_told_otherwise(env, expected):
    """A second MKL thread spins when another process holds a core (results/threads.json:
    speculative demo decoding 218 -> 25 tok/s with both cores busy), so one is the default; the
    user's MKL_NUM_THREADS or OMP_NUM_THREADS wins."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "TINYDRAFT_BLAS")}
    result = subprocess.run([sys.executable, "-c", THREADS_SCRIPT], capture_output=True,
                            text=True, timeout=120, env={**clean, **env})
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["mkl"] == expected


@pytest.mark.skipif(not on_linux_x86, reason="the BLAS preload only acts on Linux x86-64 here")
def test_no_preload_where_mlx_cuda_is_installed(checkpoints, tmp_path):
    """The preload is a CPU trick: where MLX's CUDA build is installed (here its distribution's
    metadata, faked: MLX itself stays the CPU build) "auto" loads no BLAS, and a run that then
    computes on the CPU is told how to load one; an explicit choice still loads."""
    info = tmp_path / "mlx_cuda_13-0.32.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mlx-cuda-13\nVersion: 0.32.4\n")
    auto, err = _run("auto", checkpoints["target"], path=str(tmp_path))
    assert auto["blas"] == "reference"
    assert err.count("MLX's CUDA build is installed") == 1 and "TINYDRAFT_BLAS=mkl" in err
    chosen, err = _run("mkl", checkpoints["target"], path=str(tmp_path))
    assert chosen["blas"].startswith("mkl (") and "reference BLAS" not in err
    plain, _ = _run("auto", checkpoints["target"])  # without the CUDA build: MKL, as ever
    assert plain["blas"].startswith("mkl (")

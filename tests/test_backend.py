"""The BLAS preload (Linux CPU): a real BLAS gives the reference BLAS's numbers, the choice is
reported, and a slow setup is warned about once with the fix. Each case runs in a fresh process,
since the preload must happen before `mlx.core` is first imported."""

import json
import platform
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = """
import json, sys, warnings
warnings.simplefilter("always")
import tinydraft_mlx
from tinydraft_mlx import load_models
import mlx.core as mx
target, _, tok = load_models(sys.argv[1], "none")
logits = target(mx.array([[269, 70, 305, 83, 29, 342, 322, 12, 5, 77] * 8]))[0]
print(json.dumps({"blas": tinydraft_mlx.active_blas(), "logits": logits.tolist()}))
"""

on_linux_x86 = sys.platform == "linux" and platform.machine() == "x86_64"


def _run(blas: str, directory) -> tuple[dict, str]:
    env_cmd = ["env", f"TINYDRAFT_BLAS={blas}", sys.executable, "-c", SCRIPT, str(directory)]
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

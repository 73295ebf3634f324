"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

import platform

import mlx.core as mx
import mlx_lm

import tinydraft_mlx


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.machine(),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "tinydraft_mlx": tinydraft_mlx.__version__,
        "blas": "the mlx wheel's own (reference BLAS on Linux CPU)",
    }

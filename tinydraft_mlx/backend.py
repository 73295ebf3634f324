"""Device and dtype choice.

Knows nothing about models: it answers "which device is MLX computing on" and "which dtype should
weights use there". On the CPU backend float16/bfloat16 matmuls do not use BLAS and are slower than
float32, so float32 is the default there; on a GPU (Metal, CUDA) float16 is.
"""

from __future__ import annotations

import mlx.core as mx

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def device_name() -> str:
    """Return "gpu" or "cpu": where MLX runs by default in this process."""
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def default_dtype() -> mx.Dtype:
    """float32 on the CPU backend, float16 on a GPU backend."""
    return mx.float16 if device_name() == "gpu" else mx.float32


def resolve_dtype(dtype: str | mx.Dtype | None) -> mx.Dtype:
    """Turn None, a name ("float32", "float16", "bfloat16") or an mx.Dtype into an mx.Dtype."""
    if dtype is None:
        return default_dtype()
    if isinstance(dtype, mx.Dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} (got {dtype})")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} (got {dtype!r})")
    return _DTYPES[dtype]

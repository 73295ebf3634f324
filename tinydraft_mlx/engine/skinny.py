"""A faster matmul for the CPU verify pass: `W @ x.T` instead of `x @ W.T` for a few rows.

`nn.Linear` computes `x @ W.T`. On MLX's CPU backend that is a BLAS sgemm with a transposed B, and
for a handful of rows (a verify pass scores k + 1 tokens) BLAS packs the whole weight on every
call: measured with MKL on this project's 2-core machine, a 8960 x 1536 projection takes 24 ms for
5 rows as `x @ W.T` and 11 ms as `(W @ x.T).T` (1 row: 5.8 vs 5.6 ms). So the verify pass, whose
cost decides whether speculation pays on a CPU, becomes 2x cheaper. Same products, so same
result up to float rounding (the oracle tests compare against transformers with a margin).

Only for CPU, large weights (the memory-bound ones: MLP and LM head) and 4..64 rows; everything
else (1-3 rows, prefill chunks, small projections, quantized layers, Metal) goes through mlx
unchanged. For 2-3 rows MKL's own kernel measured faster on this project's current machines: a
1.5B-shaped verify pass took 396 vs 239 ms (2 rows) and 395 vs 260 ms (3 rows) with the skinny
form, 413 vs 446 ms (4 rows), 421 vs 467 (5) and 456 vs 650 (9) ms.
`enable(model)` switches a loaded model's modules in place and `disable(model)` switches them
back; both are idempotent.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import forward

MIN_ROWS = 4  # measured: below this MKL's x @ W.T is faster (see above)
MAX_ROWS = 64  # measured: above this the plain form is as fast (prefill chunks of 512: 1.07x)
MIN_WEIGHT = 4_000_000  # elements; smaller projections gain nothing reliable (measured, noisy)


def _skinny(weight: mx.array, x: mx.array) -> mx.array | None:
    """`x @ weight.T` computed as `(weight @ x.T).T`, or None when the plain form is as good."""
    rows = x.size // x.shape[-1]
    if not MIN_ROWS <= rows <= MAX_ROWS or weight.size < MIN_WEIGHT:
        return None
    flat = x.reshape(rows, x.shape[-1])
    return (weight @ flat.T).T.reshape(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(nn.Linear):
    """`nn.Linear` with the skinny fast path (same parameters, same module tree)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _skinny(self["weight"], x)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class SkinnyEmbedding(nn.Embedding):
    """`nn.Embedding` whose `as_linear` (tied LM head) takes the skinny fast path."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = _skinny(self.weight, x)
        return super().as_linear(x) if y is None else y


_SWAPS = {nn.Linear: SkinnyLinear, nn.Embedding: SkinnyEmbedding}


def enable(model: nn.Module) -> int:
    """Switch `model`'s plain Linear/Embedding modules to the skinny path when running on the CPU.
    Returns how many modules use it (0 on a GPU, where Metal/CUDA kernels handle few rows well)."""
    if mx.default_device() != mx.cpu:
        return 0
    count = 0
    for _, module in model.named_modules():
        swap = _SWAPS.get(type(module))
        if swap is not None:
            module.__class__ = swap
        count += isinstance(module, (SkinnyLinear, SkinnyEmbedding))
    forward.set_kernels(model, "skinny" if count else "stock")  # compiled steps replay modules
    return count


def disable(model: nn.Module) -> None:
    """Undo `enable`: every skinny module becomes the plain mlx module again."""
    back = {v: k for k, v in _SWAPS.items()}
    for _, module in model.named_modules():
        if type(module) in back:
            module.__class__ = back[type(module)]
    forward.set_kernels(model, "stock")

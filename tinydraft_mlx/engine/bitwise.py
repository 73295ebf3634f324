"""Bit-for-bit mode: every target forward of a generation computes each position the same way,
however many positions it carries, so greedy speculative output is this engine's plain greedy
output bit for bit on any device, not only up to the rounding of differently shaped forwards.

Why it is needed. A verify scores k + 1 positions in one forward, a plain step one. Matrix
products of different row counts may take different kernels: MKL's float32 GEMM on this CPU
(logits differ by up to 7.6e-6 between a one-row and a k + 1-row pass, `results/README.md`),
TF32 for two rows or more on CUDA and M5-class Macs (`MLX_ENABLE_TF32`), half-precision
kernels that reduce in another order for one row than for several. Only a top-2 logit gap
below that difference can flip a greedy choice, but then the output is not plain decoding's.

What the mode does: every target forward after the prompt's prefill (plain step, verify,
bonus) carries exactly `ROWS` positions, the real ones first and copies of the last after them
(the causal mask hides them from the real ones; the commit rolls them back with the rejected
drafts), and attends over one key buffer whose length is fixed for the whole generation
(prompt + max_tokens + ROWS positions, `forward.buffer_size`), so no kernel choice and no
reduction length depends on how many tokens the round drafted. The prefill is the same for
plain and speculative decoding of one prompt, so their logits are equal at every position.
Measured (bench/bitwise.py, demo pair, float32, MKL): greedy speculative log-probabilities up to
1.3e-5 from plain decoding's in the default mode, 0 in this one.

Cost: a plain step computes ROWS positions. On Apple silicon a forward of a few positions costs
about one (weights are read once); on this CPU plain decoding of the demo target runs at 0.43x
the default mode's speed, speculative k = 3 at 0.72x (bench/bitwise.py).
Where it applies: targets whose decode step runs compiled (forward.SUPPORTED architectures, one
process, unbounded caches, compiled forwards on), one sequence per forward (a batch shares its
forwards, so its row count would depend on the other requests).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .forward import compiles
from .policy import AUTO_MAX_K

ROWS = AUTO_MAX_K + 1  # positions of every target forward: the longest round, k = AUTO_MAX_K
MAX_K = ROWS - 1


def refusal(target: nn.Module, max_kv_size: int | None = None) -> str | None:
    """None where the bit-for-bit mode can run on `target`; else what `bitwise` must be, and
    why, for ParameterError("bitwise", ...): "bitwise must be False with ... (got True)"."""
    if max_kv_size is not None:
        return f"False with max_kv_size {max_kv_size} (it needs unbounded caches)"
    if not compiles(target):
        return ("False for this target (it needs a decode step that runs compiled: qwen2, qwen3, "
                "llama or mistral, on one process, TINYDRAFT_COMPILE on)")
    return None


def pad(tokens: mx.array) -> mx.array:
    """(B, L) ids, L <= ROWS -> (B, ROWS): each row's last id repeated after it."""
    n = tokens.shape[1]
    if n > ROWS:
        raise ValueError(f"a bit-for-bit forward carries at most {ROWS} positions (got {n})")
    if n == ROWS:
        return tokens
    return mx.concatenate([tokens, mx.repeat(tokens[:, -1:], ROWS - n, axis=1)], axis=1)


def buffer_need(prompt_len: int, max_tokens: int) -> int:
    """Positions the key buffer is sized for, for the whole generation: every forward's
    writes, padding included, fit."""
    return prompt_len + max_tokens + ROWS


def trim(logits: mx.array, seen: list[tuple[Any, mx.array]], n: int) -> mx.array:
    """The first `n` positions of a padded forward's logits; its captured states cut alike
    (in place)."""
    seen[:] = [(tag, state[:, :n]) for tag, state in seen]
    return logits[:, :n]

"""Sampling parameters, logits processors (mlx-lm's protocol) and the one warp that turns logits
into a distribution.

The same `warp` produces the target distribution p and the draft distribution q, so top-k, top-p
and min-p stay exact on the speculative path: rejection sampling over warped p and q yields tokens
distributed exactly as warped p. Order: temperature -> top-k -> top-p -> min-p.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

# Temperatures outside [MIN, MAX] (but 0) overflow float32 on the way to a distribution: logits
# divided by 1e-38 become inf and every probability NaN (every token then came out as one id).
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e6

Processor = Callable[[mx.array, mx.array], mx.array]  # (tokens (L,), logits (1, V)) -> logits

class ParameterError(ValueError):
    """A parameter outside its allowed range. Keeps the parts so a CLI can name its own flag."""

    def __init__(self, name: str, allowed: str, value: object):
        self.name, self.allowed, self.value = name, allowed, value
        super().__init__(f"{name} must be {allowed} (got {value!r})")


def check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    """`value` if it is an int in [lo, hi] (hi None: unbounded), else raise ParameterError."""
    allowed = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParameterError(name, allowed, value)
    if value < lo or (hi is not None and value > hi):
        raise ParameterError(name, allowed, value)
    return value


def check_float(name: str, value: object, ok, allowed: str) -> float:
    """`value` as a float if it is a finite number with ok(value), else raise ParameterError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParameterError(name, allowed, value)
    if not math.isfinite(value) or not ok(value):
        raise ParameterError(name, allowed, value)
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a token. temperature 0 means greedy (argmax); the other knobs then
    have no effect. top_k 0 and top_p 1 disable those filters; min_p 0 disables min-p."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_float("temperature", self.temperature,
                    lambda v: v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE,
                    f"0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
        check_float("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        check_int("top_k", self.top_k, 0)
        check_float("min_p", self.min_p, lambda v: 0 <= v < 1, "in [0, 1)")
        if self.seed is not None:
            check_int("seed", self.seed, 0, 2**63 - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(
    logits: mx.array, history: mx.array, drafts: list[mx.array], processors: Sequence[Processor]
) -> mx.array:
    """(1, V) logits after `processors`, for the position that follows history + drafts."""
    if not processors:
        return logits
    tokens = mx.concatenate([history, *(d.reshape(1) for d in drafts)]) if drafts else history
    for processor in processors:
        logits = processor(tokens, logits)
    return logits


def _renormalize(probs: mx.array, keep: mx.array) -> mx.array:
    kept = mx.where(keep, probs, 0.0)
    return kept / kept.sum(axis=-1, keepdims=True)


def warp(logits: mx.array, params: SamplingParams) -> mx.array:
    """Warped probabilities over the last axis of `logits` (any leading shape), in float32:
    temperature, then top-k (exactly k tokens, as mlx-lm's sampler: ties at the k-th value are
    broken arbitrarily), top-p and min-p (these two keep ties at their boundary).

    Not for greedy decoding (temperature 0): greedy uses the argmax of the raw logits. One
    compiled graph per setting (and shape). With top-k set, everything after the partition works
    on the k candidates and their probabilities are scattered into a row of zeros: no
    exponential, sort or cumulative sum over the vocabulary (on the CPU, a softmax over Qwen's
    152k-token vocabulary costs about 3 ms a row, a sort 17 ms).
    """
    if params.greedy:
        raise ValueError("warp() needs temperature > 0; greedy decoding uses the argmax")
    return with_warp(_identity, params)(logits)


def with_warp(fn: Callable[..., Any], params: SamplingParams) -> Callable[..., Any]:
    """`lambda logits, *args: fn(warp(logits, params), *args)` as one compiled graph (per `fn`,
    setting and shapes): what a sampled round does with its warped distributions (draw from
    them, or run the acceptance rule) fused with the warp. On the CPU each separate op costs
    its dispatch: a draw took 0.20 ms on its own and 0.05 ms fused, the acceptance rule 0.42 vs
    0.25 (demo vocabulary, 4096)."""
    if params.greedy:
        raise ValueError("with_warp() needs temperature > 0; greedy decoding uses the argmax")
    run = _compiled_with_warp(fn, params.top_k, params.top_p < 1.0, params.min_p > 0.0)
    values = _values(params.temperature, params.top_p, params.min_p)
    return lambda logits, *args: run(logits, values, *args)


@functools.lru_cache(maxsize=256)
def _values(temperature: float, top_p: float, min_p: float) -> mx.array:
    """A setting's values as one float32 array: an input of the compiled warp, not a constant
    of its trace, so settings that differ only in value share one graph and MLX's CPU backend
    compiles their fused kernels once."""
    return mx.array([temperature, top_p, min_p], dtype=mx.float32)


def draw(logits: mx.array, params: SamplingParams, key: mx.array) -> tuple[mx.array, mx.array]:
    """(warped probabilities, one `sample_rows` draw per row), in one compiled graph."""
    return with_warp(_with_draw, params)(logits, key)


def draw_at(logits: mx.array, temperature: float, key: mx.array) -> mx.array:
    """One `sample_rows` draw per row of softmax(logits / temperature) (a temperature alone:
    no filter), in one compiled graph: a plain sampled step's host cost is then the greedy
    step's (as separate ops, ~0.2 ms a token more on a tiny model on the CPU)."""
    return _draw_at(logits, _values(temperature, 1.0, 0.0), key)


@mx.compile
def _draw_at(logits: mx.array, values: mx.array, key: mx.array) -> mx.array:
    return sample_rows(mx.softmax(logits.astype(mx.float32) / values[0], axis=-1), key)


def _with_draw(probs: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
    return probs, sample_rows(probs, key)


def _identity(probs: mx.array) -> mx.array:
    return probs


@functools.lru_cache(maxsize=64)
def _compiled_with_warp(fn: Callable[..., Any], top_k: int, nucleus: bool, floor: bool):
    """The compiled `fn(warp(logits), ...)` for a setting's structure (its top-k, whether top-p
    and min-p filter); the values come in as an array (`_values`)."""
    def run(logits: mx.array, values: mx.array, *args: mx.array) -> Any:
        temperature, top_p, min_p = values[0], values[1], values[2]
        return fn(_warp(logits, temperature, top_p if nucleus else None, top_k,
                        min_p if floor else None), *args)

    return mx.compile(run)


def _warp(logits: mx.array, temperature: mx.array, top_p: mx.array | None, top_k: int,
          min_p: mx.array | None) -> mx.array:
    logits = logits.astype(mx.float32) / temperature
    if 0 < top_k < logits.shape[-1]:
        index = mx.argpartition(-logits, top_k - 1, axis=-1)[..., :top_k]  # the k candidates
        values = mx.take_along_axis(logits, index, axis=-1)
        order = mx.argsort(-values, axis=-1)  # k values: most likely first
        index = mx.take_along_axis(index, order, axis=-1)
        probs = mx.softmax(mx.take_along_axis(values, order, axis=-1), axis=-1, precise=True)
        probs = _nucleus(probs, top_p, min_p, ranked=True)
        return mx.put_along_axis(mx.zeros_like(logits), index, probs, axis=-1)
    return _nucleus(mx.softmax(logits, axis=-1, precise=True), top_p, min_p, ranked=False)


def _nucleus(probs: mx.array, top_p: mx.array | None, min_p: mx.array | None,
             ranked: bool) -> mx.array:
    """Top-p then min-p over the last axis (None: that filter is off); `ranked`: probs are
    sorted, most likely first."""
    if top_p is not None:
        # keep a token when the mass ranked strictly before it is below top_p
        if ranked:
            before = mx.cumsum(probs, axis=-1) - probs
            probs = _renormalize(probs, before < top_p)
        else:
            order = mx.argsort(-probs, axis=-1)
            sorted_probs = mx.take_along_axis(probs, order, axis=-1)
            before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
            keep = mx.put_along_axis(mx.zeros_like(before < top_p), order, before < top_p,
                                     axis=-1)
            probs = _renormalize(probs, keep)
    if min_p is not None:
        keep = probs >= min_p * probs.max(axis=-1, keepdims=True)
        probs = _renormalize(probs, keep)
    return probs


def sampling_groups(rows: Sequence[Any],
                    where: Callable[[int, Any], bool]) -> dict[tuple, list[int]]:
    """Indices of the rows (anything with a `sampling: SamplingParams`) that `where(index, row)`
    selects, grouped by their warp settings (temperature, top-p, top-k, min-p): one warp each."""
    groups: dict[tuple, list[int]] = {}
    for j, row in enumerate(rows):
        if where(j, row):
            s = row.sampling
            groups.setdefault((s.temperature, s.top_p, s.top_k, s.min_p), []).append(j)
    return groups


def sample_rows(probs: mx.array, key: mx.array) -> mx.array:
    """One draw from each row of `probs` (..., V) (rows need not be normalized), by inverting
    the cumulative distribution at one uniform per row: exact, and on a CPU much cheaper than
    `mx.random.categorical`, which draws V Gumbel variates per row (and takes V logarithms).
    Every draw of the loop uses it: a seeded sequence's draws are its key's uniforms."""
    return invert_cdf(probs, mx.random.uniform(shape=(*probs.shape[:-1], 1), key=key))


def invert_cdf(probs: mx.array, u: mx.array) -> mx.array:
    """The token at uniform u (..., 1) in [0, 1) of each row of `probs` (..., V): the first
    index whose cumulative mass exceeds u x total, so token i is drawn when cdf[i-1] <= u x total
    < cdf[i], with probability p_i. A zero-mass token is never drawn, not even where u x total
    rounds up to the total (then the last token with mass is)."""
    cdf = mx.cumsum(probs.astype(mx.float32), axis=-1)
    total = cdf[..., -1:]
    index = (cdf <= u * total).astype(mx.int32).sum(axis=-1)
    last = (cdf < total).astype(mx.int32).sum(axis=-1)  # the last token with mass
    return mx.minimum(index, last).astype(mx.int32)

"""What a forward costs, as the check tool and the benchmarks measure it: one cached forward of
n tokens (the decode loop's own, compiled where it applies), the target's t_1 and t_v(n), a
drafter's step t_d, and the speedup Leviathan et al. predict from them."""

from __future__ import annotations

import statistics
import time
from typing import Any

import mlx.core as mx

from ..engine.backend import generation_stream
from ..engine.cache import cache_length, make_cache, rollback
from ..engine.drafters import resolve_drafter
from ..engine.forward import forward, prefill


def leviathan(alpha: float, k: int, t_d: float, t_1: float, t_v: float,
              steps: int | None = None) -> float:
    """Predicted speedup: E(k) t_1 / (s t_d + t_v(k+1)), E(k) = (1 - alpha^(k+1)) / (1 - alpha),
    s the draft forwards of a round (`steps`: k for a chain, the default; 1 for a block
    drafter)."""
    expected = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected * t_1 / ((k if steps is None else steps) * t_d + t_v)


# -- measurements ---------------------------------------------------------------------------------

def forward_ms(model, ids: list[int], n: int, repeats: int = 5, drafter: Any = None) -> float:
    """Median time of one cached forward over n tokens after `ids` (then rolled back): the
    decode loop's own forward (compiled where it applies; the first call, which may trace, is
    left out), on the generation stream the loop runs on. `drafter`: the drafter whose model
    `model` is, which fills the cache with what precedes its step and gives the step's other
    inputs (a head: the target's states; `Source.prime`); None: a model prefilled with `ids`."""
    times = []
    with mx.stream(generation_stream()):
        cache = make_cache(model, margin=n)  # rolled back by n: sliding and recurrent layers
        if drafter is not None:
            extra = drafter.prime(cache, ids)
        else:
            prefill(model, cache, ids)
            extra = {}
        primed = cache_length(cache)
        for _ in range(repeats + 1):
            x = mx.array([ids[-1]] * n, dtype=mx.int32)[None]
            start = time.perf_counter()
            mx.eval(forward(model, x, cache, **extra))
            times.append(time.perf_counter() - start)
            rollback(cache, primed)
    return 1000 * statistics.median(times[1:])


def target_costs(target, ids: list[int], k_max: int, repeats: int) -> dict[str, Any]:
    """t_1 and t_v(n) for n = 1..k_max + 1, in ms (measured once, shared by every draft)."""
    return {"t_1": forward_ms(target, ids, 1, repeats),
            "t_v": {n: forward_ms(target, ids, n, repeats) for n in range(1, k_max + 2)}}


def draft_ms(draft, ids: list[int], repeats: int, target: Any = None) -> float:
    """t_d: one draft forward in ms (a step; a block drafter's whole block; 0 for prompt lookup
    and plain decoding)."""
    drafter = resolve_drafter(draft, target=target)
    if drafter.model is None:
        return 0.0
    return forward_ms(drafter.model, ids, drafter.block or 1, repeats, drafter=drafter)

"""KV caches for the decode loop, in mlx-lm's cache protocol (`update_and_fetch`, `offset`,
`trim(n)`, `is_trimmable`, `make_mask`), so mlx-lm model code runs on them unchanged.

Rollback after a rejected draft is `trim`, which only moves the write offset: O(1), no copies.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

Cache = list[Any]  # one cache object per layer


def make_cache(model: nn.Module) -> Cache:
    """A fresh per-layer cache for `model`; raises ValueError if it cannot be rolled back."""
    cache = make_prompt_cache(model)
    if not all(c.is_trimmable() for c in cache):
        kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
        raise ValueError(
            f"speculative decoding needs caches that can roll back; this model uses {kinds}"
        )
    return cache


def cache_length(cache: Cache) -> int:
    """How many tokens the cache holds (all layers advance together)."""
    return cache[0].offset if cache else 0


def rollback(cache: Cache, keep: int) -> None:
    """Forget everything after the first `keep` tokens; a no-op if the cache holds fewer."""
    drop = cache_length(cache) - keep
    if drop > 0:
        for layer in cache:
            layer.trim(drop)

"""Caches in mlx-lm's protocol that roll back: per-layer ones for one sequence (kv.py: KV caches,
the bounded `RollbackRotatingKVCache`, making and rolling back a model's cache), recurrent layers'
states replayed along accepted tokens (recurrent.py), and a batch's rows of every layer kind
(batch.py)."""

from .kv import (
    KEEP,
    Cache,
    RollbackRotatingKVCache,
    cache_length,
    can_cut,
    cut,
    layer_kinds,
    make_cache,
    reach,
    reachable,
    ring_mask,
    ring_slots,
    rollback,
    slot_positions,
)

__all__ = [
    "Cache",
    "KEEP",
    "RollbackRotatingKVCache",
    "cache_length",
    "can_cut",
    "cut",
    "layer_kinds",
    "make_cache",
    "reach",
    "reachable",
    "ring_mask",
    "ring_slots",
    "rollback",
    "slot_positions",
]

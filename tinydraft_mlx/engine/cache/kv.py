"""KV caches for the decode loop, in mlx-lm's cache protocol (`update_and_fetch`, `offset`,
`trim(n)`, `is_trimmable`, `make_mask`), so mlx-lm model code runs on them unchanged.

Rollback after a rejected draft is `trim`, which only moves the write offset: O(1), no copies.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from .recurrent import RecurrentCache, model_kind, recurrent_cache

Cache = list[Any]  # one cache object per layer


KEEP = 4  # sink positions a bounded cache always keeps (as mlx-lm's RotatingKVCache)


def make_cache(model: nn.Module, max_kv_size: int | None = None, margin: int = 1) -> Cache:
    """A fresh per-layer cache for `model`: unbounded, or its attention layers bounded to
    `max_kv_size` positions, with a rollback margin of `margin` slots (use >= k + 1); recurrent
    layers (recurrent.py) reach margin + 1 positions back. Raises ValueError if the model's cache
    cannot be rolled back."""
    layers = make_prompt_cache(model)
    if max_kv_size is not None:
        if layer_kinds(model) is None:
            raise ValueError(
                "max_kv_size needs a model made of attention layers (full or sliding-window) and "
                "recurrent ones; this model builds caches of another kind"
            )
        # full-attention layers are bounded; sliding-window ones keep their own window
        layers = [RollbackRotatingKVCache(max_kv_size, KEEP, margin) if type(c) is KVCache
                  else c for c in layers]
    cache = [recurrent_cache(_rollback_able(layer, margin), model, margin) for layer in layers]
    if not all(c.is_trimmable() for c in cache):
        kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
        raise ValueError(
            f"speculative decoding needs caches that can roll back; this model's layers keep "
            f"{kinds}, a state tinydraft-mlx rolls back only for Gated DeltaNet and Mamba-2 "
            "layers (Qwen3-Next, Qwen3.5, Nemotron-H, Granite 4, Mamba-2)"
        )
    return cache


def layer_kinds(model: nn.Module) -> list | None:
    """Each layer's kind: "kv" (a plain KV cache), ("window", W, keep) (sliding-window attention,
    mlx-lm's `RotatingKVCache(W, keep)`) or "recurrent" (a state recurrent.py rolls back), where
    every layer is one of these: what a `BatchCache` and bounded caches are built for; None
    otherwise."""
    kinds: list = []
    for layer in make_prompt_cache(model):
        if type(layer) is KVCache:
            kinds.append("kv")
        elif type(layer) is RotatingKVCache:
            kinds.append(("window", layer.max_size, layer.keep))
        elif type(layer) is ArraysCache and model_kind(model) is not None:
            kinds.append("recurrent")
        else:
            return None
    return kinds


def _rollback_able(layer: Any, margin: int) -> Any:
    """mlx-lm's `RotatingKVCache` (sliding-window layers, e.g. Gemma 3's) cannot roll back once it
    has wrapped, so it becomes a `RollbackRotatingKVCache` of the same window; others stay."""
    if type(layer) is RotatingKVCache:
        return RollbackRotatingKVCache(layer.max_size, layer.keep, margin)
    return layer


def cache_length(cache: Cache) -> int:
    """How many tokens the cache holds (all layers advance together)."""
    return cache[0].offset if cache else 0


def rollback(cache: Cache, keep: int) -> None:
    """Forget everything after the first `keep` tokens (fewer if the cache holds fewer). Layers
    that disagree (a forward interrupted between layers, e.g. by Ctrl-C in a prefill) are all
    brought back to the shortest, so the cache is consistent again."""
    if not cache:
        return
    keep = min(keep, min(layer.offset for layer in cache))
    if not reachable(cache, keep):
        raise ValueError(f"cannot roll back {cache_length(cache) - keep} tokens of a recurrent "
                         f"layer's state (it holds the inputs of its last {reach(cache)} "
                         "positions)")
    for layer in cache:
        if layer.offset > keep or isinstance(layer, RecurrentCache):  # n = 0: its tape shrinks
            layer.trim(layer.offset - keep)


def reach(cache: Cache) -> int | None:
    """How many tokens back `cache` can roll back where it has recurrent layers (their tape);
    None where it is not limited by them."""
    held = [layer.held() for layer in cache if isinstance(layer, RecurrentCache)]
    return min(held) if held else None


def reachable(cache: Cache, keep: int) -> bool:
    """Whether `rollback(cache, keep)` can go that far back (its recurrent layers' tape)."""
    room = reach(cache)
    return room is None or cache_length(cache) - keep <= room


def can_cut(cache: Cache, n: int) -> bool:
    """Whether `cut(cache, n)` keeps it usable: a cache that fits itself to a target's prefix
    (`keep_prefix`, a head's) always can (it starts anew where it read past n); layers where
    they roll back that far."""
    return callable(getattr(cache, "keep_prefix", None)) or reachable(cache, n)


def cut(cache: Cache, n: int) -> None:
    """Make a one-sequence cache fit a target cache holding the first `n` tokens (check
    `can_cut` first): its own `keep_prefix(n)` where it has one (emptied where that cannot be
    done), else its layers rolled back to at most n tokens."""
    keep_prefix = getattr(cache, "keep_prefix", None)
    if callable(keep_prefix):
        if not keep_prefix(n):
            cache.clear()
        return
    rollback(cache, n)


def slot_positions(end: int | mx.array, keep: int | mx.array, ring: int | mx.array,
                   slots: int | None = None) -> mx.array:
    """(keep + ring,) the absolute position each slot of a `RollbackRotatingKVCache` holds once
    positions [0, end) are written (`end`, `keep`, `ring`: ints or int32 scalar arrays; `slots`:
    keep + ring, given where those are arrays); -1 for an empty slot."""
    s = mx.arange(keep + ring if slots is None else slots)
    sinks = mx.where(s < end, s, -1)
    last = end - 1 - keep  # ring index of the newest position
    ring_pos = keep + last - mx.remainder(last - (s - keep), ring)
    ring_pos = mx.where(ring_pos >= keep, ring_pos, -1)
    return mx.where(s < keep, sinks, ring_pos)


def ring_slots(positions: mx.array, keep: int | mx.array, ring: int | mx.array) -> mx.array:
    """The slot each absolute position is written to: its own below `keep` (a sink), else its
    place in the ring."""
    return mx.where(positions < keep, positions, keep + mx.remainder(positions - keep, ring))


def ring_mask(offset: int | mx.array, n: int, keys: mx.array, keep: int | mx.array,
              window: int | mx.array) -> mx.array:
    """(n, len(keys)) True where the query at position offset + i may see the key at absolute
    position keys[j] (-1: an empty slot): a sink, or one of the latest `window` positions up to
    its own."""
    q = (offset + mx.arange(n))[:, None]
    k = keys[None, :]
    return (k >= 0) & (k <= q) & ((k < keep) | (k > q - window))


class RollbackRotatingKVCache:
    """A bounded KV cache that can still roll back after it wraps.

    Semantics (`max_kv_size` W, `keep` sink positions): the token at absolute position t attends to
    positions [0, keep) and to the most recent W - keep positions up to and including t, however
    many tokens arrive in one call, so a (k+1)-token verify sees exactly what k+1 single-token
    steps would. Storage is `keep` sink slots plus a ring of W - keep + `margin` slots: the margin
    holds positions that no query may see any more, which is what makes `trim(n)` for
    n <= margin + 1 an O(1) offset change even after the ring has wrapped.

    Speaks mlx-lm's cache protocol (`update_and_fetch`, `offset`, `make_mask`, `trim`,
    `is_trimmable`, `state`, `nbytes`), so mlx-lm models run on it unchanged. The mask is computed
    from the absolute position stored in each slot, never from the slot order.
    """

    def __init__(self, max_kv_size: int, keep: int = 4, margin: int = 1):
        if not 0 <= keep < max_kv_size:
            raise ValueError(f"keep must be in [0, max_kv_size) = [0, {max_kv_size}) (got {keep})")
        if margin < 1:
            raise ValueError(f"margin must be >= 1 (got {margin})")
        self.max_kv_size, self.keep, self.margin = max_kv_size, keep, margin
        self.window = max_kv_size - keep  # recent positions each query sees, itself included
        self.ring = self.window + margin
        self.slots = keep + self.ring
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    # -- positions ---------------------------------------------------------------------------

    def in_place(self, n: int) -> bool:
        """Whether n new tokens can be written before attention without overwriting a position
        that one of their queries still needs (else keys are returned as buffer + new)."""
        return n <= self.margin + 1

    def _key_positions(self, n: int) -> mx.array:
        if self.in_place(n):
            return slot_positions(self.offset + n, self.keep, self.ring)
        return mx.concatenate([slot_positions(self.offset, self.keep, self.ring),
                               self.offset + mx.arange(n)])

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """(n, n_keys) boolean mask for the next `n` tokens (True = attend)."""
        return ring_mask(self.offset, n, self._key_positions(n), self.keep, self.window)

    # -- storage -----------------------------------------------------------------------------

    def _write(self, keys: mx.array, values: mx.array) -> None:
        """Store positions [offset, offset + L): sinks in their slots, the newest `ring` in the
        ring."""
        start, end = self.offset, self.offset + keys.shape[2]
        if start < self.keep:
            stop = min(end, self.keep)
            self.keys[..., start:stop, :] = keys[..., : stop - start, :]
            self.values[..., start:stop, :] = values[..., : stop - start, :]
        pos = max(self.keep, end - self.ring, start)
        while pos < end:  # at most two contiguous pieces: before and after the wrap
            slot = self.keep + (pos - self.keep) % self.ring
            n = min(end - pos, self.slots - slot)
            self.keys[..., slot : slot + n, :] = keys[..., pos - start : pos - start + n, :]
            self.values[..., slot : slot + n, :] = values[..., pos - start : pos - start + n, :]
            pos += n

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store the new (B, n_kv_heads, L, head_dim) keys/values; return what attention reads,
        in the slot layout `make_mask` describes."""
        if self.keys is None:
            b, h, _, d = keys.shape
            self.keys = mx.zeros((b, h, self.slots, d), keys.dtype)
            self.values = mx.zeros((b, h, self.slots, values.shape[3]), values.dtype)
        n = keys.shape[2]
        if self.in_place(n):
            self._write(keys, values)
            self.offset += n
            return self.keys, self.values
        old_k, old_v = self.keys, self.values
        out = (mx.concatenate([old_k, keys], axis=2), mx.concatenate([old_v, values], axis=2))
        self._write(keys, values)
        self.offset += n
        return out

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the newest n positions (O(1)); returns how many were forgotten."""
        n = min(self.offset, n)
        if n > self.margin + 1 and self.offset > self.slots:
            raise ValueError(
                f"cannot roll back {n} tokens of a wrapped rotating cache; at most "
                f"margin + 1 = {self.margin + 1}"
            )
        self.offset -= n
        return n

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def size(self) -> int:
        return min(self.offset, self.max_kv_size)

    def empty(self) -> bool:
        return self.keys is None

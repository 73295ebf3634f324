"""KV caches for a batch of sequences of different lengths, each rolled back by its own amount.

One buffer per layer, (B, kv heads, slots, head dim), rows left-aligned: row b's token at absolute
position t lives in slot t (unbounded) or in the slot a `RollbackRotatingKVCache` would give it
(bounded: `keep` sink slots, then a ring), and the row's length is a number on the host. A forward
feeds every row the same number L of tokens (rows with fewer real tokens are padded on the right);
each row's keys are written at its own positions, its queries see only its own written slots
(a (B, 1, L, slots) mask), RoPE runs at each row's own offset. Afterwards `rollback` sets each
row's length to what it keeps: the padding and the rejected drafts become unwritten slots again,
O(1), no copies (the next write goes over them).

Why this and not mlx-lm's `BatchKVCache` (left padding, one shared write index): with a shared
index, rows that accept different numbers of drafts would need their keys shifted, or holes kept
in the middle of their history, after every round; with a length per row a rollback is a number.
The price is the same as left padding: attention reads max(length) slots for every row.

Rows join from one-sequence caches (`add`, one copy of the batch for all joiners) and leave
(`remove`, the batch's rows copied without it), both between rounds; `extract` gives a row back as
a one-sequence cache (a `PromptCache` out). Speaks enough of mlx-lm's cache protocol
(`update_and_fetch`, `offset`, `make_mask`, `state`) for mlx-lm's attention to run on it.

Layers of other kinds share the rows: a sliding-window layer (Gemma 3, gpt-oss) keeps each row in
the slot layout of a `RollbackRotatingKVCache` of its window (a `Ring`), as bounded layers do,
and a recurrent layer is a `RecurrentCache` of every row's state (recurrent.py). Each layer's
mask is its own; mlx-lm's models build one mask per layer kind from a layer of that kind.

`SingleCache` is the same rows interface for a batch of at most one sequence: it holds that
sequence's own one-sequence cache as it is (any layer layout, a tensor-parallel model's; no copy
on joining or leaving), and its forward is the one-sequence compiled step. The engine runs one
sequence (`generate`) on it, and a batch whose models cannot share a `BatchCache`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..forward import forward, forward_batch
from .kv import (
    KEEP,
    Cache,
    RollbackRotatingKVCache,
    cache_length,
    reachable,
    ring_slots,
    rollback,
    slot_positions,
)
from .recurrent import RecurrentCache

STEP = 256  # unbounded buffers grow by this many slots


class Ring:
    """The slot layout of one bounded layer (as `RollbackRotatingKVCache`'s): `keep` sink slots,
    then a ring of window + margin slots; each query sees the sinks and the latest `window`
    positions up to its own."""

    def __init__(self, max_kv_size: int, keep: int, margin: int) -> None:
        self.max_kv_size, self.keep, self.margin = max_kv_size, keep, margin
        self.window = max_kv_size - keep
        self.ring = self.window + margin
        self.slots = keep + self.ring

    def slot_of(self, positions: mx.array) -> mx.array:
        return ring_slots(positions, self.keep, self.ring)

    def relayout(self, keys: mx.array, values: mx.array,
                 length: int) -> tuple[mx.array, mx.array]:
        """A one-sequence bounded cache's buffers of another margin (`keys.shape[2]` slots, the
        same sinks and window) in this layout: each slot takes the position this layout gives
        it, from where the other ring holds it (slots older than the window are never seen)."""
        ring_from = keys.shape[2] - self.keep
        positions = mx.maximum(slot_positions(length, self.keep, self.ring), 0)
        source = ring_slots(positions, self.keep, ring_from)
        return mx.take(keys, source, axis=2), mx.take(values, source, axis=2)

    def mask(self, queries: mx.array, end: mx.array) -> mx.array:
        """(B, 1, n, slots): row b's query at position queries[b, i] may see the slot
        (positions [0, end[b]) written): a sink, or one of the latest `window` up to its own."""
        held = slot_positions(end, self.keep, self.ring)[:, None, :]  # (B, 1, S)
        queries = queries[:, :, None]
        recent = held > queries - self.window
        return ((held >= 0) & (held <= queries) & ((held < self.keep) | recent))[:, None]


class BatchCache:
    """Per-layer batch buffers and the length of each row. `layers`: the number of layers (all
    attention) or each layer's kind (`cache.layer_kinds`): "kv" (full attention), ("window", W,
    keep) (sliding-window attention: a ring per row as `RollbackRotatingKVCache(W, keep)`), or
    "recurrent" (a `RecurrentCache` holding every row's state, rolled back per row by replay).
    `max_kv_size` bounds every full-attention row as `make_cache(model, max_kv_size, margin)`
    bounds one sequence (same slot layout, so rows move in and out by copying); windowed layers
    keep their own window."""

    def __init__(self, layers: int | list, max_kv_size: int | None = None, keep: int = KEEP,
                 margin: int = 1) -> None:
        kinds = ["kv"] * layers if isinstance(layers, int) else layers
        self.layers: list = []
        for kind in kinds:
            if kind == "recurrent":
                self.layers.append(RecurrentCache(2, margin + 1))
            elif kind == "kv":
                bound = Ring(max_kv_size, keep, margin) if max_kv_size is not None else None
                self.layers.append(BatchLayer(self, bound))
            else:
                _, window, sinks = kind
                self.layers.append(BatchLayer(self, Ring(window, sinks, margin)))
        self.kv = [layer for layer in self.layers if isinstance(layer, BatchLayer)]
        rings = [layer.bound.slots for layer in self.kv if layer.bound is not None]
        # bounded: a forward then writes at most margin + 1 tokens; a row that has wrapped its
        # smallest ring can forget at most that many
        self.bounded, self.ring_slots = bool(rings), min(rings, default=None)
        self.recurrent = [layer for layer in self.layers if isinstance(layer, RecurrentCache)]
        self.lengths: list[int] = []
        self.margin = margin
        self._offsets: mx.array | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    def forward(self, model: nn.Module, tokens: mx.array, **inputs: Any) -> Any:
        """(B, L) ids -> (B, L, V) logits, each row at its own offset; every row advances by L
        (rows with fewer real tokens are rolled back by the caller). `inputs`: more keyword
        inputs of the model (an MTP head's hidden states)."""
        return forward_batch(model, tokens, self, **inputs)

    def offsets(self) -> mx.array:
        """(B,) int32: each row's length, where its next token goes."""
        if self._offsets is None:
            self._offsets = mx.array(self.lengths, dtype=mx.int32)
        return self._offsets

    def _set(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self._offsets = None

    # -- a forward ---------------------------------------------------------------------------
    def capacity(self) -> int:
        """Slots of the growing (unbounded) layers' buffers."""
        layer = next((layer for layer in self.kv if layer.bound is None), None)
        return 0 if layer is None or layer.keys is None else layer.keys.shape[2]

    def arrays(self) -> list[mx.array]:
        """Every array the rows' caches hold (to evaluate them at once)."""
        out = []
        for layer in self.layers:
            state = layer.cache if isinstance(layer, RecurrentCache) else layer.state
            out += [a for a in state if a is not None]
        return out

    def reserve(self, n: int, size: int | None = None) -> None:
        """Room for n more tokens in every row (unbounded: the buffers grow to `size`, or to the
        next multiple of STEP). Bounded rows take at most margin + 1 tokens per forward (the
        longest write that cannot overwrite a slot one of its queries needs)."""
        if self.bounded and n > self.margin + 1:
            raise ValueError(f"a bounded batch takes at most margin + 1 = {self.margin + 1} "
                             f"tokens per forward (got {n})")
        need = max(self.lengths, default=0) + n
        if size is None:
            if need <= self.capacity():
                return
            size = -(-need // STEP) * STEP
        for layer in self.kv:
            if layer.bound is None:
                layer.resize(size)

    def advance(self, n: int) -> None:
        """After a forward of n tokens per row."""
        self._set([length + n for length in self.lengths])

    def positions(self, n: int) -> mx.array:
        """(B, n) absolute positions of the next n tokens of each row."""
        return self.offsets()[:, None] + mx.arange(n, dtype=mx.int32)[None]

    def read_length(self, n: int) -> int:
        """How many slots an unbounded layer's attention reads during a forward of n tokens."""
        return max(self.lengths, default=0) + n

    # -- rows --------------------------------------------------------------------------------
    def rollback(self, keep: list[int]) -> None:
        """Row b forgets everything after its first keep[b] tokens (O(1)). A bounded row that has
        wrapped can forget at most margin + 1 tokens (as one sequence's cache)."""
        lengths = []
        slots = self.ring_slots
        for length, k in zip(self.lengths, keep, strict=True):
            k = max(0, min(length, k))
            if slots is not None and length - k > self.margin + 1 and length > slots:
                raise ValueError(f"cannot roll back {length - k} tokens of a wrapped bounded row; "
                                 f"at most margin + 1 = {self.margin + 1}")
            lengths.append(k)
        backs = [length - k for length, k in zip(self.lengths, lengths)]
        for layer in self.recurrent:
            layer.rollback_rows(backs)
        self._set(lengths)

    def reachable(self, index: int, keep: int) -> bool:
        """Whether row `index` can roll back to `keep` tokens (its recurrent layers' tape)."""
        back = self.lengths[index] - keep
        return all(back <= layer.held(index) for layer in self.recurrent)

    def add(self, caches: list[Cache | None]) -> None:
        """Append one row per one-sequence cache, holding what it holds (None or empty: an
        empty row): one copy of the batch for all of them."""
        lengths = [cache_length(c) if c else 0 for c in caches]
        need = max(lengths + self.lengths + [self.capacity()])
        size = -(-need // STEP) * STEP if need else STEP
        for i, layer in enumerate(self.layers):
            if isinstance(layer, RecurrentCache):
                layer.add_rows([c[i] if c else None for c in caches], len(self.lengths))
                continue
            layer.add_rows([(c[i].keys, c[i].values) if n else (None, None)
                            for c, n in zip(caches, lengths)], lengths, size)
        self._set(self.lengths + lengths)

    def remove(self, rows: list[int]) -> None:
        """Drop the rows at these indices (one copy of the rest, which keep their order)."""
        gone = set(rows)
        kept = [i for i in range(len(self.lengths)) if i not in gone]
        if len(kept) == len(self.lengths):
            return
        for layer in self.layers:
            layer.take(kept)
        self._set([self.lengths[i] for i in kept])

    def extract(self, index: int) -> Cache:
        """Row `index` as a one-sequence cache (a copy): an mlx-lm `KVCache` per layer, or a
        `RollbackRotatingKVCache` when bounded."""
        length = self.lengths[index]
        out = []
        for layer in self.layers:
            if isinstance(layer, RecurrentCache):
                out.append(layer.row(index, length))
                continue
            bound = layer.bound
            if bound is not None:
                solo = RollbackRotatingKVCache(bound.max_kv_size, bound.keep, bound.margin)
            else:
                solo = KVCache()
            if layer.keys is not None and length:
                stop = bound.slots if bound is not None else length
                solo.keys = mx.array(layer.keys[index : index + 1, :, :stop])
                solo.values = mx.array(layer.values[index : index + 1, :, :stop])
                solo.offset = length
            out.append(solo)
        return out


class BatchLayer:
    """One layer's buffers of a `BatchCache`, as mlx-lm's attention sees them."""

    def __init__(self, batch: BatchCache, bound: Ring | None = None) -> None:
        self.batch, self.bound = batch, bound
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        return self.batch.offsets()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write each row's (B, heads, L, dim) keys/values at its own positions; return what
        attention reads (the slots `make_mask` describes)."""
        batch, bound, n = self.batch, self.bound, keys.shape[2]
        if self.keys is None:  # rows were all empty: buffers from the first keys seen
            size = bound.slots if bound is not None else -(-n // STEP) * STEP
            self._allocate(keys, values, keys.shape[0], size)
        positions = batch.positions(n)
        slots = positions if bound is None else bound.slot_of(positions)
        slots = slots[:, None, :, None]  # (B, 1, L, 1)
        self.keys = mx.put_along_axis(self.keys, slots, keys, axis=2)
        self.values = mx.put_along_axis(self.values, slots, values, axis=2)
        if bound is not None:
            return self.keys, self.values
        read = batch.read_length(n)
        return self.keys[..., :read, :], self.values[..., :read, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """(B, 1, n, slots read) True where row b's query i (at position length_b + i) may see
        the slot: written, not after it, and (bounded) a sink or within the window."""
        batch = self.batch
        queries = batch.positions(n)  # (B, n)
        if self.bound is not None:
            return self.bound.mask(queries, batch.offsets()[:, None] + n)
        slots = mx.arange(batch.read_length(n), dtype=mx.int32)
        return (slots[None, None] <= queries[:, :, None])[:, None]

    def is_trimmable(self) -> bool:
        return True

    @property
    def state(self) -> tuple[mx.array | None, mx.array | None]:
        return self.keys, self.values

    # -- rows --------------------------------------------------------------------------------
    def _allocate(self, keys: mx.array, values: mx.array, rows: int, size: int) -> None:
        self.keys = mx.zeros((rows, keys.shape[1], size, keys.shape[3]), keys.dtype)
        self.values = mx.zeros((rows, values.shape[1], size, values.shape[3]), values.dtype)

    def resize(self, size: int) -> None:
        if self.keys is None or self.keys.shape[2] == size:
            return
        have = self.keys.shape[2]
        if size < have:
            self.keys, self.values = self.keys[..., :size, :], self.values[..., :size, :]
            return
        pad = [(0, 0), (0, 0), (0, size - have), (0, 0)]
        self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)

    def add_rows(self, rows: list[tuple[mx.array | None, mx.array | None]],
                 lengths: list[int], size: int | None) -> None:
        """Append rows (keys, values of a one-sequence cache, or None for an empty row) in one
        concatenation; `size`: the slots every row gets (unbounded)."""
        batch = self.batch
        template = next((k for k, _ in rows if k is not None), self.keys)
        if template is None:
            return  # every row empty: buffers are made at the first forward
        first_v = next((v for _, v in rows if v is not None), self.values)
        size = self.bound.slots if self.bound is not None else size
        heads, dim, dtype = template.shape[1], template.shape[3], template.dtype
        v_heads, v_dim = first_v.shape[1], first_v.shape[3]
        old = len(batch.lengths)
        if self.keys is None:
            self.keys = mx.zeros((old, heads, size, dim), dtype)
            self.values = mx.zeros((old, v_heads, size, v_dim), first_v.dtype)
        else:
            self.resize(size)
        keys, values = [self.keys], [self.values]
        for (k, v), length in zip(rows, lengths):
            if k is None:
                keys.append(mx.zeros((1, heads, size, dim), self.keys.dtype))
                values.append(mx.zeros((1, v_heads, size, v_dim), self.values.dtype))
                continue
            take = size if self.bound is not None else length
            if self.bound is not None and k.shape[2] != self.bound.slots:
                k, v = self.bound.relayout(k, v, length)
            pad = [(0, 0), (0, 0), (0, size - take), (0, 0)]
            keys.append(mx.pad(k[:1, :, :take], pad).astype(self.keys.dtype))
            values.append(mx.pad(v[:1, :, :take], pad).astype(self.values.dtype))
        self.keys, self.values = mx.concatenate(keys), mx.concatenate(values)

    def take(self, rows: list[int]) -> None:
        if self.keys is None:
            return
        if not rows:
            self.keys = self.values = None
            return
        index = mx.array(rows, dtype=mx.int32)
        self.keys, self.values = self.keys[index], self.values[index]


class SingleCache:
    """The rows interface of `BatchCache` for at most one row, held as a one-sequence cache of
    any layout (see the module docstring)."""

    bounded = False  # a one-sequence cache takes long writes itself (`forward`)

    def __init__(self) -> None:
        self.cache: Cache | None = None

    def __len__(self) -> int:
        return 0 if self.cache is None else 1

    @property
    def lengths(self) -> list[int]:
        return [] if self.cache is None else [cache_length(self.cache)]

    @property
    def layers(self) -> Cache:
        return self.cache or []

    def forward(self, model: nn.Module, tokens: mx.array, *, reserve: int = 0,
                **inputs: Any) -> Any:
        """(1, L) ids -> (1, L, V) logits; the row advances by L. `reserve`: as
        `forward.forward`'s."""
        return forward(model, tokens, self.cache, reserve=reserve, **inputs)

    def rollback(self, keep: list[int]) -> None:
        (n,) = keep
        rollback(self.cache, n)

    def reachable(self, index: int, keep: int) -> bool:
        return reachable(self.cache, keep)

    def add(self, caches: list[Cache]) -> None:
        if self.cache is not None or len(caches) != 1:
            raise ValueError(f"a single-sequence batch holds one row (got {len(self)} + "
                             f"{len(caches)})")
        self.cache = caches[0]

    def remove(self, rows: list[int]) -> None:
        if rows:
            self.cache = None

    def extract(self, index: int) -> Cache:
        return self.cache

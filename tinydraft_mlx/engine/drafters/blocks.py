"""A block drafter (dflash.py's DFlash / DFlash2) in the batch: its source (`BlockDraft`), its
chain (`BlockChain`: one forward proposes every row's block), and its one-sequence cache
(`BlockCache`: the context's keys/values and the target states it has not read yet).

A row's cache holds one entry per position whose target state the drafter has read, from
position `skip` on (a prefix it never saw, e.g. a prompt cache loaded from a file, is skipped:
entry j is position skip + j). The states of the positions read since wait beside it and enter
with the next block: a round's one forward takes every row's new states (padded to the
widest) and its block [x_last, mask, ..., mask] (block_size positions), writes the states'
keys/values and rolls the cache back to them, so the block's own never stay. The proposals'
distributions come out of that forward together: the chain's draft "steps" read them in turn
(a DFlash2 candidate selector's step also reads the previous step's proposal), through the same
sampling as every chain (chains.py's `_step`: each row's warp, seeded noise, processors).
After the verify, each row takes the target's states of its accepted positions.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache import Cache, cache_length, make_cache, rollback
from ..forward import PREFILL_STEP
from ..sampling import ParameterError
from .chains import Chain, HeadCache, HeadChain, _Feed, _joined
from .sources import HeadDraft


class BlockCache(HeadCache):
    """A block drafter's one-sequence cache: its layers' context keys/values for positions
    skip .. skip + length - 1 and `states`, the target states of the positions after them not
    read yet (what a prompt cache keeps of it)."""

    def keep_prefix(self, n: int) -> bool:
        """Make it fit a target cache that holds the first `n` tokens (whose states are those of
        positions before n): entries past n - 1 dropped, unread states cut to positions before
        n. False (nothing changed) where its states stop short of n."""
        if self.skip is None:
            return True
        fed = cache_length(self) + self.skip
        have = sum(s.shape[0] for s in self.states)
        if fed + have < n or n < self.skip:
            return False
        if fed > n:
            rollback(self, n - self.skip)
            self.states = []
            return True
        pending = _joined(self.states)
        self.states = [pending[: n - fed]] if n > fed else []
        return True

    def with_layers(self, layers: Any) -> BlockCache:
        return BlockCache(layers, self.skip, self.states)


class BlockChain(HeadChain):
    """A block drafter's rows in a batch (see the module docstring). Its rows' feeds, how they
    leave and how a row that never joined is let go are a head's (chains.py's `HeadChain`:
    `feeds`, `leave`, `release`), its cache a `BlockCache`."""

    cache_type = BlockCache

    @property
    def marginal(self) -> bool:
        """A block's positions do not read each other's proposals, unless a selector walks it."""
        return not self.model.selects

    def __init__(self, model: nn.Module, caches: Any, chunk: int, width: int | None) -> None:
        super().__init__(model, caches, chunk, width)
        self._logits: mx.array | None = None  # this round's proposals' logits (rows, L - 1, V)
        self._at = 0  # the step the chain is at

    def ready(self, uid: int) -> bool:
        feed = self.feeds.get(uid)
        return feed is not None and feed.skip is not None

    def admit(self, row: Any, cache: Cache, budget: int | None, seen: list,
              start: int = 0) -> tuple[int, bool]:
        """Read the target's prefill states of this row (positions `start` on, from `seen`)
        into its cache, in chunks."""
        feed = self.feeds.get(row.uid)
        if feed is None:  # a prompt cache's drafter resumes where it stopped
            feed = self.feeds[row.uid] = _Feed()
            feed.skip, feed.states = cache.skip, list(cache.states)  # a BlockCache
        states = [s.reshape(-1, s.shape[-1]) for s in self.model.read(seen)]
        if feed.skip is None and states:
            feed.skip = start - cache_length(cache)
        pending = _joined(feed.states + states)
        feed.states = []
        for at in range(0, 0 if pending is None else pending.shape[0], PREFILL_STEP):
            self.model.absorb(pending[None, at : at + PREFILL_STEP], cache, feed.skip)
            mx.eval([layer.state for layer in cache])
        return 0, True

    def commit(self, by_uid: dict[int, tuple[Any, int, bool, int]], seen: list | None) -> None:
        """Each row takes the verify's states of its accepted positions (its cache already
        holds only context: the round's forward rolled the block back)."""
        states = self.model.read(seen)[-1] if seen else None
        for uid, length in zip(self.uids, self.caches.lengths):
            row, before, _, b = by_uid[uid]
            feed = self.feeds[uid]
            if feed.skip is None:  # its first states: the verify's first position
                feed.skip = before - 1 - length
            if states is not None:
                feed.states.append(states[b, : len(row.seq) - before])

    def run(self, ordered: list[tuple[int, Any, int]]) -> tuple[mx.array, list]:
        """As a chain's (`Chain.run`), but where every drafting row is greedy without
        processors (and no selector walks the block) the whole block's argmax at once: no
        per-position steps."""
        rows = [r for _, r, _ in ordered]
        ks = [k for _, _, k in ordered]
        if self.model.selects or any(k and (not r.sampling.greedy or r.processors)
                                     for r, k in zip(rows, ks)):
            return super().run(ordered)
        self._first(rows)
        self.logits = self._logits[:, : max(ks)]
        return mx.argmax(self.logits, axis=-1).astype(mx.int32), [None] * len(rows)

    def _first(self, rows: list[Any]) -> mx.array:
        """One forward for every row: its unread states in, its block's proposals' logits out;
        the first position's returned, the rest kept for `_next`."""
        model, caches = self.model, self.caches
        feeds = [self.feeds[r.uid] for r in rows]
        pending = [_joined(f.states) for f in feeds]
        counts = [0 if p is None else p.shape[0] for p in pending]
        n, size = max(counts), self.model.block_size
        dim, dtype = model.context_width, model.dtype
        context = mx.stack([mx.zeros((n, dim), dtype) if p is None else
                            mx.pad(p, [(0, n - p.shape[0]), (0, 0)]) if p.shape[0] < n else p
                            for p in pending])
        block = mx.array([[r.seq[-1]] + [model.config.mask_token_id] * (size - 1)
                          for r in rows], dtype=mx.int32)
        lengths = list(caches.lengths)
        batched = hasattr(caches, "reserve")  # a BatchCache (else one sequence's own cache)
        shift: Any = feeds[0].skip or 0
        if batched:
            caches.reserve(n + size)
            shift = mx.array([f.skip or 0 for f in feeds], dtype=mx.int32)
        ragged = None if min(counts) == n else mx.array(counts, dtype=mx.int32)
        logits, states = model(block, caches.layers, context=context, counts=ragged,
                               shift=shift)
        if batched:
            caches.advance(n + size)
        caches.rollback([length + c for length, c in zip(lengths, counts)])
        for f in feeds:
            f.states = []
        self._logits, self._at = logits, 0
        if model.selects:
            selector = model.candidate_selector
            self._projected = selector.hidden_projection(states)
            self._candidates = selector.candidates(logits)
            return self._selected(block[:, 0])
        return logits[:, 0]

    def _next(self, tokens: mx.array) -> mx.array:
        self._at += 1
        if self.model.selects:
            return self._selected(tokens)
        return self._logits[:, self._at]

    def _selected(self, previous: mx.array) -> mx.array:
        """DFlash2: the step's candidates scored after `previous`, as (rows, V) logits that are
        -inf off the candidates (what the step samples from, warped like any logits)."""
        i, logits = self._at, self._logits
        candidates = self._candidates[:, i]
        scores = self.model.candidate_selector.scores(logits[:, i], self._projected[:, i],
                                                      candidates, previous)
        full = mx.full(logits[:, i].shape, -mx.inf, dtype=scores.dtype)
        return mx.put_along_axis(full, candidates, scores, axis=-1)


class BlockDraft(HeadDraft):
    """A block drafter for one sequence (the drafter protocol's `Source`): drafted by the
    batch's `BlockChain` every round, at most block_size - 1 tokens a round (`max_k`), from one
    forward of its block (`block`). As a head's (sources.py's `HeadDraft`: how it attaches to
    its target, proposes nothing on the host), its cache pairs with the target states it has not
    read (`BlockCache`), which a prompt cache file does not hold: a loaded prompt cache's
    drafter starts anew, skipping the cached prefix."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.block = model.block_size
        self.max_k = self.block - 1

    def chain(self, caches: Any, chunk: int, width: int | None) -> Chain:
        return BlockChain(self.model, caches, chunk, width)

    def row_cache(self, given: Cache | None, max_kv_size: int | None,
                  margin: int) -> Cache | None:
        """A prompt cache's `BlockCache` as it is; an empty cache of its layers wrapped; else a
        new one. ParameterError with `max_kv_size`: its context is not bounded."""
        if max_kv_size is not None:
            raise ParameterError("max_kv_size", f"None with a {self.name} drafter (its context "
                                 "cache is not bounded)", max_kv_size)
        if isinstance(given, BlockCache):
            return given
        if given is not None and cache_length(given) == 0:
            return BlockCache(given)
        return BlockCache(make_cache(self.model))

    def first_logits(self, ids: list[int]) -> mx.array | None:
        """Its logits for the token after `ids`: the block at ids[-1] over the states before."""
        cache = self.model.make_cache()
        return self._block(cache, ids)[0, 0]

    def prime(self, cache: Cache, ids: list[int]) -> dict[str, mx.array]:
        """Its cache from the target's states of ids[:-1]; a forward then drafts one block
        (its next inputs: no new context)."""
        mx.eval(self._block(cache, ids))
        rollback(cache, len(ids) - 1)
        return {"context": mx.zeros((1, 0, self.model.context_width), self.model.dtype)}

    def _block(self, cache: Cache, ids: list[int]) -> mx.array:
        model = self.model
        states = model.target_states(ids)[:, :-1]
        size = model.block_size
        block = mx.array([[ids[-1]] + [model.config.mask_token_id] * (size - 1)])
        logits, _ = model(block, cache, context=states)
        return logits

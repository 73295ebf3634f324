"""Batched chains of draft steps: one per drafting model of a batch (drafters.py's `Drafting`
keeps them). A `Chain` owns the model's caches for every row that drafts with it (a `BatchCache`
or a `SingleCache`), catches them up on what they missed, runs max(k) steps for all of them at
once, sampling each row from its own warped q, and rolls them back to what was accepted.

`ModelChain`: a draft model, fed token ids. Its row holds a prefix of the row's sequence.
`HeadChain`: a head that reads the target's states (hidden.StateHead: the MTP layer, mtp.py;
an EAGLE-3 head, eagle.py), fed ids with the states beside them. Its row's cache entry i is the
pair (h_i, x_{i+1}); the chain keeps per row how many tokens of the sequence the head has
consumed (entries + `skip`) and the target states it has not read yet (positions consumed - 1
onward, one per token it will consume). A chain step's entry reads the head's own output
instead of a target state, so after the verify every row goes back to the entries made from
target states, and the verify's states of the accepted positions wait for the next round.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache import Cache, cache_length, rollback
from ..forward import PREFILL_STEP, model_inputs, prefill
from ..sampling import draw, process_logits, sample_rows, sampling_groups, seeded, warp
from .inputs import guard


def draft_logits(
    logits: mx.array, history: mx.array, drafts: list[mx.array],
    processors: list, width: int | None,
) -> mx.array:
    """The draft's (Vq,) logits after the processors. The processors know the target's ids
    (`width`): a narrower draft's logits are padded with -inf for them, then cut back."""
    if not processors:
        return logits
    extra = 0 if width is None else width - logits.shape[-1]
    row = logits[None]
    if extra > 0:
        row = mx.pad(row, [(0, 0), (0, extra)], constant_values=-float("inf"))
    return process_logits(row, history, drafts, processors)[0, : logits.shape[-1]]


class Chain:
    """A drafting model's rows in a batch. `caches`: an empty rows cache; `chunk`: the most
    tokens a catch-up feeds per forward; `width`: the target's vocabulary width."""

    marginal = False  # whether its step i's logits ignore the proposals before i (a block's)

    def __init__(self, model: nn.Module, caches: Any, chunk: int, width: int | None) -> None:
        self.model, self.caches, self.chunk, self.width = model, caches, chunk, width
        guard(model, width)  # a narrower draft reads id 0 for the ids it has no row for
        self.uids: list[int] = []  # its rows, in cache row order
        # the latest run's (rows, steps, Vq) step logits, where a row grows a tree from them
        self.logits: mx.array | None = None

    # -- rows in and out ---------------------------------------------------------------------
    def admit(self, row: Any, cache: Cache, budget: int | None, seen: list,
              start: int = 0) -> tuple[int, bool]:
        """Prefill a joining row's one-sequence cache (all of its sequence but the last token),
        at most `budget` tokens (None: all): (tokens fed, whether it is done). `seen`, `start`:
        the capture of the target's prefill from position `start` (a head's chain reads it)."""
        todo = row.seq[cache_length(cache) : -1]
        budget = len(todo) if budget is None else budget
        prefill(self.model, cache, todo[:budget])
        return min(len(todo), budget), len(todo) <= budget

    def ready(self, uid: int) -> bool:
        """Whether the row can draft this round."""
        return True

    def release(self, row: Any, cache: Cache) -> Cache | None:
        """A row that leaves before joining: its one-sequence cache cut to seq[:-1]."""
        rollback(cache, len(row.seq) - 1)
        return cache

    def join(self, rows: list[Any], caches: list[Cache]) -> None:
        self.caches.add(caches)
        self.uids += [r.uid for r in rows]

    def leave(self, rows: list[Any]) -> dict[int, Cache]:
        """Rows out: their caches rolled back to seq[:-1], extracted for the rows that keep their
        caches (`keep_caches`), in one removal."""
        index = {uid: j for j, uid in enumerate(self.uids)}
        members = [r for r in rows if r.uid in index]
        if not members:
            return {}
        lengths = dict(zip(self.uids, self.caches.lengths))
        ends, lost = {}, set()
        for r in members:
            end = min(lengths[r.uid], len(r.seq) - 1)
            if not self.caches.reachable(index[r.uid], end):  # recurrent: cannot go back
                lost.add(r.uid)
                end = lengths[r.uid]
            ends[r.uid] = end
        self.caches.rollback([ends.get(uid, n) for uid, n in lengths.items()])
        out = {r.uid: self.caches.extract(index[r.uid]) for r in members
               if r.keep_caches and r.uid not in lost}
        self._remove(index, members)
        return out

    def _remove(self, index: dict[int, int], members: list[Any]) -> None:
        self.caches.remove([index[r.uid] for r in members])
        gone = {r.uid for r in members}
        self.uids = [uid for uid in self.uids if uid not in gone]

    # -- a round -----------------------------------------------------------------------------
    def commit(self, by_uid: dict[int, tuple[Any, int, bool, int]], seen: list | None) -> None:
        """The round is booked: each row keeps what it saw of the accepted sequence (`by_uid`:
        uid -> (row, its length at the proposal, whether the chain skipped it, its batch index);
        a skipped row was fed padding past that length). `seen`: the verify's capture of the
        target's states (a head's chain reads them)."""
        keep = []
        for uid, length in zip(self.uids, self.caches.lengths):
            row, before, idle, _ = by_uid[uid]
            end = len(row.seq) - 1
            if getattr(row, "draft_end", None) is not None:  # a tree's walk left its chain
                end = min(end, row.draft_end)
            keep.append(min(length, before if idle else end))
        self.caches.rollback(keep)

    def _catch_up(self, rows: list[Any]) -> None:
        """Feed the draft what its rows missed in plain (or host-proposed) rounds, so that at
        most 2 unseen tokens are left to each row's first draft step. Each row caught up counts
        it in its statistics (`catch_ups`; not timed: the round is one graph)."""
        caches = self.caches
        for row, n in zip(rows, caches.lengths):
            row.stats.catch_ups += n < len(row.seq) - 2
        while True:
            todo = [r.seq[n : len(r.seq) - 2] for r, n in zip(rows, caches.lengths)]
            widest = max(len(t) for t in todo)
            if widest == 0:
                return
            n = min(widest, self.chunk)
            lengths = list(caches.lengths)
            x = [model_inputs(self.model, t[:n]) + [0] * (n - len(t[:n])) for t in todo]
            caches.forward(self.model, mx.array(x, dtype=mx.int32))
            caches.rollback([length + min(n, len(t)) for length, t in zip(lengths, todo)])

    def _first(self, rows: list[Any]) -> mx.array:
        """Catch up, then feed each row's unseen tokens: the (rows, Vq) logits of its first
        draft."""
        caches = self.caches
        self._catch_up(rows)
        unseen = [r.seq[n:] for r, n in zip(rows, caches.lengths)]
        lengths = list(caches.lengths)
        width = max(len(u) for u in unseen)
        x = [model_inputs(self.model, u) + [0] * (width - len(u)) for u in unseen]
        logits = caches.forward(self.model, mx.array(x, dtype=mx.int32))
        caches.rollback([n + len(u) for n, u in zip(lengths, unseen)])
        last = mx.array([len(u) - 1 for u in unseen], dtype=mx.int32)
        return mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]

    def _next(self, tokens: mx.array) -> mx.array:
        """One draft step on the previous step's (rows,) tokens: (rows, Vq) logits."""
        return self.caches.forward(self.model, tokens[:, None])[:, 0]

    def run(self, ordered: list[tuple[int, Any, int]]) -> tuple[mx.array, list]:
        """One batched chain of max(k) draft steps over every row (`ordered`: (batch index, row,
        k) in cache order; rows drafting fewer, or none, feed what they have and are rolled back
        at commit): (rows, steps) ids and each row's q (None when greedy). A seeded row proposes
        the Gumbel-max choice of its (seed, position) noise (`seeded.py`), the noise its verify
        uses; unseeded rows draw together, one draw per step."""
        rows = [r for _, r, _ in ordered]
        ks = [k for _, _, k in ordered]
        logits = self._first(rows)
        sampled = [j for j, (r, k) in enumerate(zip(rows, ks)) if k and not r.sampling.greedy]
        unseeded = [j for j in sampled if rows[j].sampling.seed is None]
        # unseeded rows draw together, one key per step (each row still its own uniform)
        keys = mx.random.split(rows[unseeded[0]].draft_key, max(ks)) if unseeded else None
        histories = {j: mx.array(r.seq, dtype=mx.int32) for j, r in enumerate(rows)
                     if r.processors}
        qs: dict[int, list[mx.array]] = {j: [] for j in sampled}
        chain: list[mx.array] = []
        steps: list[mx.array] = []  # what candidate trees read (trees.py)
        for i in range(max(ks)):
            if i:
                logits = self._next(chain[-1])
            steps.append(logits)
            if not sampled and not histories:
                token = mx.argmax(logits, axis=-1).astype(mx.int32)
            else:
                token = self._step(rows, ks, i, logits, histories, qs, keys, chain)
            mx.async_eval(token)
            chain.append(token)
        # kept only where a row grows a tree this round (they hold rows x steps x Vq floats)
        trees = any(getattr(r, "budget", None) for r in rows)
        self.logits = mx.stack(steps, axis=1) if trees else None
        return mx.stack(chain, axis=1), [mx.stack(qs[j]) if j in qs else None
                                         for j in range(len(rows))]

    def _step(self, rows, ks, i, logits, histories, qs, keys, chain) -> mx.array:
        """Step i's token for every chain row: drawn from its warped q where it samples and
        drafts this far (seeded: with its position's noise), else the argmax (a greedy row, or
        padding)."""
        warped: dict[int, mx.array] = {}
        picks: list[mx.array | None] = [None] * len(rows)
        groups = list(sampling_groups(rows, lambda j, r: j in qs and i < ks[j]
                                      and j not in histories).values())
        # unseeded draws: a key per regime group drawn with its warp in one graph, and one for
        # the unseeded rows drawn apart (with processors, or beside seeded rows of their regime)
        fused = [m for m in groups if all(rows[j].sampling.seed is None for j in m)]
        apart = any(rows[j].sampling.seed is None and i < ks[j] for j in qs
                    if not any(j in m for m in fused))
        count = len(fused) + apart
        step_keys = ([] if count == 0 else [keys[i]] if count == 1 else
                     list(mx.random.split(keys[i], count)))
        for members, key in zip(fused, step_keys):
            probs, drawn = draw(logits[mx.array(members)], rows[members[0]].sampling, key)
            for n, j in enumerate(members):
                qs[j].append(probs[n])
                picks[j] = drawn[n]
        for members in (m for m in groups if m not in fused):
            probs = warp(logits[mx.array(members)], rows[members[0]].sampling)
            warped.update({j: probs[n] for n, j in enumerate(members)})
        pooled: list[tuple[int, mx.array]] = []  # unseeded rows drawing at this step
        for j, row in enumerate(rows):
            if picks[j] is not None:  # drawn with its group
                continue
            row_logits = logits[j]
            if j in histories:
                row_logits = draft_logits(row_logits, histories[j], [t[j] for t in chain],
                                          row.processors, self.width)
            if j in qs and i < ks[j]:
                q = warped[j] if j in warped else warp(row_logits, row.sampling)
                qs[j].append(q)
                seed = row.sampling.seed
                if seed is None:
                    pooled.append((j, q))
                else:
                    picks[j] = seeded.choose(q[None], seed, len(row.seq) + i)[0]
            else:
                picks[j] = mx.argmax(row_logits, axis=-1)
        if pooled:
            drawn = sample_rows(mx.stack([q for _, q in pooled]), step_keys[-1])
            for n, (j, _) in enumerate(pooled):
                picks[j] = drawn[n]
        return mx.stack(picks).astype(mx.int32)


class ModelChain(Chain):
    """A draft model's chain (the base class's behaviour)."""


class HeadCache(list):
    """A head's one-sequence cache (its layers, a list as any cache) with what it has not read:
    `skip` (tokens counted as consumed that are no entries; None while it has none) and
    `states` (the target states not read yet, one per token it will consume). What a prompt
    cache keeps of a head, so that a sequence extending the cached one resumes its head."""

    def __init__(self, layers: Any = (), skip: int | None = None,
                 states: list[mx.array] | None = None) -> None:
        super().__init__(layers)
        self.skip, self.states = skip, list(states or [])

    def keep_prefix(self, n: int) -> bool:
        """Make it fit a target cache that holds the first `n` tokens: its unread states cut to
        positions before n. False (nothing changed) where it cannot: it read tokens past n, or
        its states stop short of n."""
        if self.skip is None:
            return True
        fed = cache_length(self) + self.skip
        have = sum(s.shape[0] for s in self.states)
        if fed - 1 > n or fed - 1 + have < n:
            return False
        pending = _joined(self.states)
        cut = n - (fed - 1)
        self.states = [pending[:cut]] if cut else []
        return True

    def with_layers(self, layers: Any) -> HeadCache:
        """A copy holding `layers` (copies of this one's) and the same unread states (never
        updated in place: shared)."""
        return HeadCache(layers, self.skip, self.states)

    def clear(self) -> None:
        """Forget everything (its layers emptied in place)."""
        rollback(self, 0)
        self.skip, self.states = None, []


class _Feed:
    """What a head's row has not read yet: `skip`, the tokens counted as consumed that are no
    cache entries (the first token, and a prefix the target's cache held when the row came in;
    None until its first states), and `states`, the target states not read yet (the first pairs
    with token entries + skip)."""

    def __init__(self) -> None:
        self.skip: int | None = None
        self.states: list[mx.array] = []


class HeadChain(Chain):
    """A state-reading head's chain (see the module docstring); `feeds`: each row's `_Feed`;
    `cache_type`: the one-sequence cache a row that keeps its caches leaves."""

    cache_type = HeadCache

    def __init__(self, model: nn.Module, caches: Any, chunk: int, width: int | None) -> None:
        super().__init__(model, caches, chunk, width)
        self.feeds: dict[int, _Feed] = {}

    def ready(self, uid: int) -> bool:
        """Whether the row can draft this round (it has a state to pair its last token with)."""
        feed = self.feeds.get(uid)
        return feed is not None and feed.skip is not None and bool(feed.states)

    def admit(self, row: Any, cache: Cache, budget: int | None, seen: list,
              start: int = 0) -> tuple[int, bool]:
        """Take the states of the target's prefill of this row (positions `start` on, in the
        capture `seen`) and feed the head every token it can pair with one, up to the
        sequence's last but one (the last waits for the first draft step)."""
        states = self.model.read(seen)
        feed = self.feeds.get(row.uid)
        if feed is None:  # a prompt cache's head resumes where it stopped
            feed = self.feeds[row.uid] = _Feed()
            if isinstance(cache, HeadCache) and cache.skip is not None:
                feed.skip, feed.states = cache.skip, list(cache.states)
        if feed.skip is None and states:
            feed.skip = start + 1 - cache_length(cache)
        feed.states += [s.reshape(-1, s.shape[-1]) for s in states]
        if feed.skip is None:
            return 0, True
        fed = cache_length(cache) + feed.skip
        pending = _joined(feed.states)
        available = 0 if pending is None else pending.shape[0]  # a prefill chunk's so far
        todo = max(0, min(len(row.seq) - 1 - fed, available))
        for at in range(0, todo, PREFILL_STEP):
            n = min(PREFILL_STEP, todo - at)
            tokens = mx.array([row.seq[fed + at : fed + at + n]], dtype=mx.int32)
            self.model(tokens, cache, hidden=pending[None, at : at + n])  # eager: a prefill
            mx.eval([layer.state for layer in cache])
        feed.states = [pending[todo:]] if todo < available else []
        return 0, True

    def release(self, row: Any, cache: Cache) -> Cache | None:
        """A row that leaves before joining: what its prefill fed the head was read from the
        chain's feed, which goes; its cache is emptied (it starts anew)."""
        self.feeds.pop(row.uid, None)
        cache.clear()  # a HeadCache: its head's `row_cache` made it
        return cache

    def leave(self, rows: list[Any]) -> dict[int, Cache]:
        """Rows out; a row that keeps its caches (`keep_caches`) leaves its head's cache with
        what it has not read (`cache_type`), fitted to the sequence's last but one token (what
        the target keeps); none where that cannot be done."""
        index = {uid: j for j, uid in enumerate(self.uids)}
        members = [r for r in rows if r.uid in index]
        out: dict[int, Cache] = {}
        for r in members:
            feed = self.feeds[r.uid]
            if not r.keep_caches or feed.skip is None:
                continue
            cache = self.caches.extract(index[r.uid])
            head = cache if isinstance(cache, self.cache_type) else self.cache_type(cache)
            head.skip, head.states = feed.skip, list(feed.states)
            if head.keep_prefix(len(r.seq) - 1):
                out[r.uid] = head
            elif head is cache:  # a one-sequence batch's own cache: left empty, not stale
                head.clear()
        if members:
            self._remove(index, members)
        for r in rows:
            self.feeds.pop(r.uid, None)
        return out

    def commit(self, by_uid: dict[int, tuple[Any, int, bool, int]], seen: list | None) -> None:
        """Every row goes back to the entries made from target states (at most its length at
        the proposal) and takes the verify's states of its accepted positions."""
        states = self.model.read(seen)[-1] if seen else None
        keep = []
        for uid, length in zip(self.uids, self.caches.lengths):
            row, before, _, b = by_uid[uid]
            feed = self.feeds[uid]
            if feed.skip is None:  # its first states: the head starts after its prompt
                feed.skip = before
            keep.append(min(length, before - feed.skip))
            if states is not None:
                accepted = len(row.seq) - before  # drafts accepted + the target's token
                feed.states.append(states[b, :accepted])
        self.caches.rollback(keep)

    def _feed(self, rows: list[Any], pending: list[mx.array | None], fed: list[int],
              done: list[int], counts: list[int]) -> tuple[mx.array, mx.array]:
        """One forward of counts[j] (token, state) pairs per row: its tokens from fed[j] +
        done[j] on, its unread states from done[j] on."""
        n = max(counts)
        dim, dtype = next((p.shape[-1], p.dtype) for p in pending if p is not None)
        tokens, states = [], []
        for r, p, f, d, c in zip(rows, pending, fed, done, counts):
            tokens.append(r.seq[f + d : f + d + c] + [0] * (n - c))
            part = p[d : d + c] if c else mx.zeros((0, dim), dtype)
            states.append(mx.pad(part, [(0, n - c), (0, 0)]) if c < n else part)
        lengths = list(self.caches.lengths)
        logits, out = self.caches.forward(self.model, mx.array(tokens, dtype=mx.int32),
                                          hidden=mx.stack(states))
        self.caches.rollback([length + c for length, c in zip(lengths, counts)])
        return logits, out

    def _first(self, rows: list[Any]) -> mx.array:
        """Feed each row's unread (token, state) pairs (a backlog of plain rounds first, in
        chunks, leaving at most 2): the (rows, V) logits of its first draft; the head's output
        there is kept for the next step."""
        feeds = [self.feeds[r.uid] for r in rows]
        pending = [_joined(f.states) for f in feeds]
        # a row with no states yet (its whole prompt was cached) feeds nothing: it drafts
        # nothing this round (`ready`)
        fed = [n + (f.skip or 0) for f, n in zip(feeds, self.caches.lengths)]
        left = [0 if f.skip is None else len(r.seq) - n for r, f, n in zip(rows, feeds, fed)]
        done = [0] * len(rows)
        for row, n in zip(rows, left):
            row.stats.catch_ups += n > 2
        while max(n - 2 for n in left) > 0:
            counts = [min(max(n - 2, 0), self.chunk) for n in left]
            self._feed(rows, pending, fed, done, counts)
            done = [d + c for d, c in zip(done, counts)]
            left = [n - c for n, c in zip(left, counts)]
        logits, out = self._feed(rows, pending, fed, done, left)
        for f in feeds:
            f.states = []
        last = mx.array([max(n - 1, 0) for n in left], dtype=mx.int32)[:, None, None]
        self._out = mx.take_along_axis(out, last, axis=1)  # (rows, 1, D)
        return mx.take_along_axis(logits, last, axis=1)[:, 0]

    def _next(self, tokens: mx.array) -> mx.array:
        logits, out = self.caches.forward(self.model, tokens[:, None], hidden=self._out)
        self._out = out
        return logits[:, 0]


def _joined(states: list[mx.array]) -> mx.array | None:
    """A row's unread states as one (n, D) array (None: none)."""
    if not states:
        return None
    return states[0] if len(states) == 1 else mx.concatenate(states)

"""Batched exact speculative decoding: B sequences per round, each rolled back by its own amount.

A `BatchDecoder` holds the live sequences of one (target, draft) pair. `insert` queues a sequence
(its prompt, sampling settings, seed, logits processors, max_tokens, draft kind and k);
`step()` runs one round for every live sequence and returns each one's new tokens; a sequence
leaves when it finishes (EOS, max_tokens) or when `remove` is called (a stop string found above
the engine, a client gone). Sequences join and leave between rounds.

A round, for all rows at once (same semantics as `speculative.decode`, per row):
1. k per row: what the sequence asked for, capped by the tokens it may still emit; k="auto"
   sequences share one k chosen with the batch in view (`policy.choose_for_batch`: the cost of a
   batched round of this size against the acceptance each sequence has shown).
2. Proposals: one batched draft chain for the rows drafting with the model (all model rows step
   together; each row samples from its own q with its own key, applies its own processors); a
   model-free drafter (prompt lookup, none) proposes row by row on the host.
3. One batched verify of every row's [last, d_1..d_k] (right-padded to the longest k), each row
   at its own offset (`batch_cache.py`), then the acceptance rule per row: greedy, or rejection
   sampling against the row's own warped p and q, with the row's key.
4. Commit: each row's caches keep its accepted prefix (`BatchCache.rollback`, no copies), its
   statistics and tokens are booked, finished rows leave the batch.

A row that drafts nothing this round (k = 0) is a plain step inside the same verify. Randomness
is per sequence (its seed's key, split per round as `decode` splits it), so what a sequence
samples depends on its prompt, settings and seed, not on the sequences beside it (up to the
float rounding of batched matmuls, see docs/design.md); with a fixed k it matches `decode`.

Prefill of a joining sequence runs on one-sequence caches, `prefill_step` tokens per `step()` at
most (so a long prompt does not stall the live rows), and the row is copied into the batch when
its prompt is in. Tensor-parallel targets are not batched (`decode` serves them).

Knows nothing about text: token ids in, token ids out.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..backend import generation_stream
from .batch_cache import BatchCache
from .cache import KEEP, Cache, cache_length, make_cache, rollback, standard_layers
from .distributed import ranks_of
from .drafters import (
    HYBRID,
    MODEL,
    Drafter,
    Hybrid,
    draft_logits,
    max_draft_length,
    point_mass,
    resolve_drafter,
)
from .forward import PREFILL_STEP, forward_batch, model_inputs, prefill, trace_count, vocab_width
from .policy import (
    AUTO,
    AUTO_MAX_K,
    DEFAULT_K,
    DraftLengthPolicy,
    batch_costs,
    choose_for_batch,
    sampling_regime,
    save_policy,
    shared_policy,
)
from .rejection import speculative_accept, speculative_accept_rows
from .sampling import (
    ParameterError,
    Processor,
    SamplingParams,
    process_logits,
    sample_rows,
    warp,
)
from .speculative import Token
from .stats import GenerationStats

__all__ = ["BatchDecoder", "Finished"]


@dataclass
class Finished:
    """What a sequence leaves behind: its generated ids, statistics, and (when asked for at
    insert) its one-sequence caches holding prompt + generated[:-1]."""

    uid: int
    tokens: list[int]
    stats: GenerationStats
    target_cache: Cache | None = None
    draft_cache: Cache | None = None


@dataclass
class _Row:
    """One sequence. `seq` is prompt + emitted; in the batch its target row holds seq[:-1]."""

    uid: int
    seq: list[int]
    prompt_len: int
    drafter: Drafter
    k: int | str
    k_cap: int
    sampling: SamplingParams
    key: mx.array
    eos: frozenset[int]
    max_tokens: int
    processors: Sequence[Processor]
    stats: GenerationStats
    logprobs: bool
    keep_caches: bool
    target_cache: Cache | None = None  # one-sequence caches while the prompt is prefilled
    draft_cache: Cache | None = None
    policy: DraftLengthPolicy | None = None
    target_prefill: float = 0.0  # seconds of the prompt's prefill spent on the target
    round_k: int = 0  # this round's k, its keys, proposal (device or host ids) and q
    keys: list = field(default_factory=list)
    drafts: list | mx.array = field(default_factory=list)
    q: mx.array | None = None
    host: bool = False  # this round's proposal was made on the host (prompt lookup's)

    @property
    def chain_k(self) -> int:
        """Draft tokens this row takes from the batched draft chain this round."""
        return 0 if self.host else self.round_k

    @property
    def model(self) -> bool:
        """Whether the row drafts with the decoder's draft model (the batched chain)."""
        return self.drafter.model is not None

    @property
    def generated(self) -> int:
        return len(self.seq) - self.prompt_len

    def split(self, n: int) -> list[mx.array | None]:
        if self.sampling.greedy:
            return [None] * n
        self.key, *keys = mx.random.split(self.key, n + 1)
        return keys


def _rollback_pair(target_cache: Cache | None, draft_cache: Cache | None, keep: int) -> None:
    """A sequence's one-sequence caches forget everything after `keep` tokens."""
    for cache in (target_cache, draft_cache):
        if cache is not None:
            rollback(cache, keep)


def _scaled_draw(row: _Row) -> bool:
    """A plain step that may be drawn from logits / T with a shared key: unseeded (a seeded
    row draws exactly as `decode` would), no processors, no filter (top-k, top-p, min-p)."""
    s = row.sampling
    return (row.round_k == 0 and not s.greedy and s.seed is None and not row.processors
            and s.top_k == 0 and s.top_p == 1.0 and s.min_p == 0.0)


def _regimes(rows: list[_Row], where) -> dict[tuple, list[int]]:
    """Indices of the rows `where` selects, grouped by sampling settings (one warp each)."""
    groups: dict[tuple, list[int]] = {}
    for j, row in enumerate(rows):
        if where(row):
            s = row.sampling
            groups.setdefault((s.temperature, s.top_p, s.top_k, s.min_p), []).append(j)
    return groups


def unbatchable(target: nn.Module, draft: nn.Module | None = None) -> str | None:
    """Which model ("target" or "draft") cannot join a `BatchDecoder`, or None when both can: a
    batch's caches have one layout for every layer (no sliding window, no recurrent state)."""
    for name, model in (("target", target), ("draft", draft)):
        if model is not None and not standard_layers(model):
            return name
    return None


class BatchDecoder:
    """Rounds of speculative decoding over a changing batch of sequences (see the module
    docstring). `draft`: the draft model sequences with draft "model" use (None: none may).
    `max_kv_size`: every sequence's caches bounded as `make_cache` bounds one (then k may be at
    most `max_k`, the rollback margin). `prefill_step`: prompt tokens prefilled per `step()`."""

    def __init__(self, target: nn.Module, draft: nn.Module | None = None, *,
                 max_kv_size: int | None = None, max_k: int = AUTO_MAX_K,
                 prefill_step: int = PREFILL_STEP) -> None:
        if ranks_of(target) is not None:
            raise ValueError("a tensor-parallel target decodes one sequence at a time "
                             "(generate / stream_generate); it is not batched")
        name = unbatchable(target, draft)
        if name is not None:
            raise ValueError(f"the {name} has sliding-window or recurrent layers; batches "
                             "hold standard attention layers only: decode it one sequence "
                             "at a time (generate / stream_generate)")
        self.target, self.draft = target, draft
        self.max_kv_size, self.max_k, self.prefill_step = max_kv_size, max_k, prefill_step
        margin = max_k + 1
        self.margin = margin
        self.target_cache = BatchCache(len(target.layers), max_kv_size, KEEP, margin)
        self.draft_cache = (BatchCache(len(draft.layers), max_kv_size, KEEP, margin)
                            if draft is not None else None)
        self.rows: list[_Row] = []  # in the batch, in cache row order
        self.pending: list[_Row] = []  # prefilling, first come first served
        self.finished: dict[int, Finished] = {}
        self.stream = generation_stream()
        self.width = vocab_width(target)
        self.draft_ratio = 0.25
        # unseeded rows draw together from this key; a seeded row uses its own (see `split`)
        self.key = mx.random.key(random.SystemRandom().getrandbits(63))
        self._uid = 0
        self._queued: tuple[list, list] | None = None  # a plain round queued ahead
        self._joined = False  # rows joined before this round: its time is not the round's
        self._chosen: dict[int, int] | None = None  # uid -> the next round's k, chosen ahead
        self._chain: mx.array | None = None  # this round's draft chain (model rows, steps)

    def __len__(self) -> int:
        """Sequences in the decoder (live and prefilling)."""
        return len(self.rows) + len(self.pending)

    # -- joining and leaving -----------------------------------------------------------------
    def insert(
        self,
        prompt: list[int],
        *,
        draft: object = None,
        k: int | str = DEFAULT_K,
        max_tokens: int = 256,
        sampling: SamplingParams = SamplingParams(),
        eos_token_ids: Iterable[int] = (),
        logits_processors: Sequence[Processor] = (),
        target_cache: Cache | None = None,
        draft_cache: Cache | None = None,
        logprobs: bool = False,
        keep_caches: bool = False,
    ) -> int:
        """Queue a sequence; returns its uid. Arguments are assumed valid (the API checks them):
        `draft` is "model" (the decoder's draft model), "hybrid" (it and prompt lookup), a
        `PromptLookup`, "prompt-lookup", a resolved drafter of the decoder's model, or None;
        caches may hold a prefix of `prompt` (one-sequence caches, e.g. a prompt cache's);
        `keep_caches`: keep the sequence's caches for `remove` / `finished`."""
        if not prompt:
            raise ParameterError("prompt", "at least one token", prompt)
        if isinstance(draft, str) and draft in (MODEL, HYBRID):
            if self.draft is None:
                raise ParameterError("draft", f'not "{draft}" in a decoder without a draft '
                                     "model", draft)
            draft = self.draft if draft == MODEL else Hybrid(self.draft)
        drafter = resolve_drafter(draft)
        if drafter.model is not None and drafter.model is not self.draft:
            raise ParameterError("draft", '"model" (the decoder\'s draft model), prompt lookup '
                                 "or None", type(draft).__name__)
        seed = sampling.seed
        if seed is None:
            seed = random.SystemRandom().getrandbits(63)
        k_cap = max_draft_length(drafter, k)
        if k_cap > self.max_k and self.max_kv_size is not None:
            raise ValueError(f"k must be at most max_k = {self.max_k} in a bounded batch "
                             f"(got {k_cap})")
        if target_cache is None:
            target_cache = make_cache(self.target, self.max_kv_size, self.margin)
        if drafter.model is not None and draft_cache is None:
            draft_cache = make_cache(drafter.model, self.max_kv_size, self.margin)
        self._uid += 1
        stats = GenerationStats(k=k if drafter.drafts else 0, prompt_tokens=len(prompt),
                                cached_tokens=cache_length(target_cache))
        row = _Row(self._uid, list(prompt), len(prompt), drafter, k, k_cap, sampling,
                   mx.random.key(seed), frozenset(eos_token_ids), max_tokens,
                   list(logits_processors), stats, logprobs, keep_caches, target_cache,
                   draft_cache if drafter.model is not None else None)
        self.pending.append(row)
        return row.uid

    def remove(self, uid: int, keep: int | None = None) -> Finished | None:
        """Take a sequence out (live, prefilling or finished) and return what it leaves; `keep`:
        how many generated tokens it keeps (a stop string cut the rest), its caches rolled back
        to match. None for an unknown uid."""
        if uid in self.finished:
            done = self.finished.pop(uid)
            if keep is not None and keep < len(done.tokens):
                done.tokens = done.tokens[:keep]
                _rollback_pair(done.target_cache, done.draft_cache,
                               done.stats.prompt_tokens + keep - 1)
            return done
        for i, row in enumerate(self.pending):
            if row.uid == uid:
                del self.pending[i]
                row.stats.finish_reason = row.stats.finish_reason or "closed"
                return Finished(uid, [], row.stats, *self._solo_caches(row))
        for row in self.rows:
            if row.uid == uid:
                if keep is not None and keep < row.generated:
                    del row.seq[row.prompt_len + keep:]
                row.stats.finish_reason = row.stats.finish_reason or "closed"
                return self._leave([row]).pop(uid, None)
        return None

    def _solo_caches(self, row: _Row) -> tuple[Cache | None, Cache | None]:
        if not row.keep_caches:
            return None, None
        _rollback_pair(row.target_cache, row.draft_cache, len(row.seq) - 1)
        return row.target_cache, row.draft_cache

    def _leave(self, rows: list[_Row]) -> dict[int, Finished]:
        """Rows out of the batch: their caches rolled back to seq[:-1], extracted where kept;
        a queued round forgets them too."""
        leaving = {id(r) for r in rows}
        for row in rows:
            save_policy(row.policy)  # what k="auto" learned, for the next process
        model_rows = [r for r in self.rows if r.model]
        for cache, members in ((self.target_cache, self.rows), (self.draft_cache, model_rows)):
            if cache is not None and members:
                cache.rollback([len(r.seq) - 1 if id(r) in leaving else length
                                for r, length in zip(members, cache.lengths)])
        index = {id(r): i for i, r in enumerate(self.rows)}
        model_index = {id(r): j for j, r in enumerate(model_rows)}
        out = {}
        for row in rows:
            t, d = None, None
            if row.keep_caches:
                t = self.target_cache.extract(index[id(row)])
                if row.model:
                    d = self.draft_cache.extract(model_index[id(row)])
            out[row.uid] = Finished(row.uid, row.seq[row.prompt_len:], row.stats, t, d)
        self.target_cache.remove([index[id(r)] for r in rows])
        if self.draft_cache is not None:
            self.draft_cache.remove([model_index[id(r)] for r in rows if r.model])
        if self._queued is not None:
            stay = [i for i, r in enumerate(self.rows) if id(r) not in leaving]
            self._queued = tuple([part[i] for i in stay] for part in self._queued)
        self.rows = [r for r in self.rows if id(r) not in leaving]
        if not self.rows:
            self._queued = None
        return out

    # -- prefill -----------------------------------------------------------------------------
    def _admit(self) -> None:
        """Prefill queued sequences, `prefill_step` tokens in all; those whose prompt is in join
        the batch."""
        budget, joined = self.prefill_step, []
        while self.pending and budget > 0:
            row = self.pending[0]
            caches = [(self.target, row.target_cache)]
            if row.model:
                caches.append((self.draft, row.draft_cache))
            for model, cache in caches:
                todo = row.seq[cache_length(cache) : -1][:budget]
                if not todo or budget <= 0:
                    continue
                start = time.perf_counter()
                with mx.stream(self.stream):
                    prefill(model, cache, todo)
                spent = time.perf_counter() - start
                row.stats.prefill_seconds += spent
                if model is self.target:
                    row.target_prefill += spent
                budget -= len(todo)
            if any(cache_length(cache) < len(row.seq) - 1 for _, cache in caches):
                break
            joined.append(self.pending.pop(0))
        if joined:
            self._join(joined)

    def _join(self, rows: list[_Row]) -> None:
        """Rows whose prompt is in enter the batch (one copy of each cache for all of them,
        evaluated here so that the next round's time is the round's own)."""
        for row in rows:
            self._ready(row)
        self.target_cache.add([r.target_cache for r in rows])
        models = [r for r in rows if r.model]
        if models:
            self.draft_cache.add([r.draft_cache for r in models])
        for row in rows:
            row.target_cache = row.draft_cache = None
        self.rows += rows
        caches = [self.target_cache] + ([self.draft_cache] if models else [])
        mx.eval([layer.state for cache in caches for layer in cache.layers
                 if layer.keys is not None])
        self._joined = True

    def _ready(self, row: _Row) -> None:
        # prompt lookup indexes the sequence; a model's cache is the batch's (no cache here)
        row.drafter.begin(row.seq, None)
        if row.k == AUTO and row.drafter.drafts:
            target_time = row.target_prefill
            if row.model and target_time > 1e-3:
                ratio = max(0.0, row.stats.prefill_seconds - target_time) / target_time
                self.draft_ratio = min(1.0, ratio)
            row.policy = shared_policy(self.target, row.drafter.policy_key, self.draft_ratio,
                                       sampling_regime(row.sampling))
            row.stats.policy = row.policy

    # -- a round -----------------------------------------------------------------------------
    def step(self) -> dict[int, list[Token]]:
        """Prefill what is queued (up to `prefill_step` tokens), then one round for every live
        sequence: uid -> its new tokens (the last one carries finish_reason when it ends). Rows
        that finished have left the batch (their `Finished` is in `finished` when caches were
        kept).

        Plain rounds (every row at k = 0) are pipelined as mlx-lm's `batch_generate`: when the
        next round is plain too, its forward is queued on this round's tokens before they are
        read, so the host's work overlaps the device's. A queued round runs before anything
        joins (a joiner waits one round)."""
        queued, self._queued = self._queued, None
        if queued is None:
            self._admit()
            if not self.rows:
                return {}
        start, traced = time.perf_counter(), trace_count()  # the round, not the prefill
        if queued is None:
            self._choose(self._chosen)
            with mx.stream(self.stream):
                self._propose()
                results = self._verify()
        else:
            results = queued
        self._chosen = None
        if all(r.round_k == 0 for r in self.rows) and self._may_pipeline():
            chosen = self._pick(ahead=1)
            if not any(chosen):
                self._choose(chosen)
                with mx.stream(self.stream):
                    self._propose()
                    self._queued = self._verify(
                        mx.stack([r[-1] for r in results[0]])[:, None])
                mx.async_eval(self._queued[0])
            else:
                self._chosen = {r.uid: k for r, k in zip(self.rows, chosen)}
        mx.eval(results[0])
        elapsed = time.perf_counter() - start
        timed, self._joined = trace_count() == traced and not self._joined, False
        return self._commit(*results, elapsed, timed)

    def _may_pipeline(self) -> bool:
        """Whether the next round may be queued before this one is read: nobody waiting to
        join, no logits processors (their history would have to follow device tokens), and a
        row that goes on past this round."""
        return (not self.pending and not any(r.processors for r in self.rows)
                and any(r.generated + 1 < r.max_tokens for r in self.rows))

    def _pick(self, ahead: int = 0) -> list[int]:
        """Each row's k for the round `ahead` rounds from now (k="auto" rows share one, chosen
        with the batch in view)."""
        auto = [r for r in self.rows if r.policy is not None]
        k_auto = 0
        if auto:
            limit = max(r.max_tokens - r.generated - 1 - ahead for r in auto)
            k_auto = choose_for_batch(self._costs(), [r.policy for r in auto], limit)
        picks = []
        for row in self.rows:
            limit = row.max_tokens - row.generated - 1 - ahead
            k = k_auto if row.policy is not None else row.k_cap
            picks.append(max(0, min(k, limit, row.k_cap)))
        return picks

    def _choose(self, chosen: list[int] | dict[int, int] | None = None) -> None:
        """Set each row's k for this round: `chosen` ahead of time (a list in row order, or
        uid -> k, which must name every row), else picked now."""
        if isinstance(chosen, dict):
            chosen = ([chosen[r.uid] for r in self.rows]
                      if all(r.uid in chosen for r in self.rows) else None)
        if chosen is None:
            chosen = self._pick()
        for row, k in zip(self.rows, chosen, strict=True):
            row.round_k = k

    def _costs(self) -> DraftLengthPolicy:
        key = self.draft if self.draft is not None else "batch"
        return batch_costs(self.target, key, len(self.rows), self.draft_ratio)

    def _propose(self) -> None:
        """Every row's proposal for this round: `drafts` (up to round_k ids) and `q` (None for
        a host proposal: point masses). Host proposals (prompt lookup, a hybrid's lookup round)
        first; then one batched draft chain for the rows that draft with the model."""
        for row in self.rows:
            row.drafts, row.q, row.host = [], None, False
            if row.round_k > 0:
                row.keys = row.split(2)  # (draft key, verify key)
                match = row.drafter.host_proposal(row.round_k)
                if match is not None:
                    row.drafts, row.host = match, True
                    row.round_k = len(match)  # the source may offer fewer than asked
        self._chain = None
        model_rows = [r for r in self.rows if r.model]
        if model_rows and max(r.chain_k for r in model_rows) > 0:
            self._draft_chain(model_rows)
        for row in self.rows:
            if row.round_k == 0:  # nothing drafted (or nothing to offer): a plain step
                row.keys = row.split(1)  # (step key,)

    def _catch_up(self, rows: list[_Row]) -> None:
        """Feed the draft what its rows missed in plain rounds, so that at most 2 unseen tokens
        are left to each row's first draft step. A k="auto" row that missed any counts a
        catch-up (`GenerationStats.catch_ups`, as the one-sequence loop counts its own); its
        time is part of the round's, one graph for the batch, so no row's `catch_up_seconds`
        is booked."""
        cache = self.draft_cache
        chunk = self.margin + 1 if cache.bounded else self.prefill_step
        for row, length in zip(rows, cache.lengths):
            row.stats.catch_ups += row.policy is not None and length < len(row.seq) - 2
        while True:
            todo = [r.seq[length : len(r.seq) - 2] for r, length in zip(rows, cache.lengths)]
            widest = max(len(t) for t in todo)
            if widest == 0:
                return
            n = min(widest, chunk)
            lengths = list(cache.lengths)
            x = [model_inputs(self.draft, t[:n]) + [0] * (n - len(t[:n])) for t in todo]
            forward_batch(self.draft, mx.array(x, dtype=mx.int32), cache)
            cache.rollback([length + min(n, len(t)) for length, t in zip(lengths, todo)])

    def _draft_chain(self, rows: list[_Row]) -> None:
        """One batched chain of max(round_k) draft steps over every model row (rows drafting
        fewer, or none, this round feed what they have and are rolled back at commit)."""
        cache = self.draft_cache
        self._catch_up(rows)
        steps = max(r.chain_k for r in rows)
        unseen = [r.seq[length:] for r, length in zip(rows, cache.lengths)]
        lengths = list(cache.lengths)
        n = max(len(u) for u in unseen)
        x = [model_inputs(self.draft, u) + [0] * (n - len(u)) for u in unseen]
        logits = forward_batch(self.draft, mx.array(x, dtype=mx.int32), cache)
        cache.rollback([length + len(u) for length, u in zip(lengths, unseen)])
        last = mx.array([len(u) - 1 for u in unseen], dtype=mx.int32)
        logits = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]  # (Bd, Vq)
        sampled = [r for r in rows if not r.sampling.greedy and r.chain_k > 0]
        keys = {id(r): mx.random.split(r.keys[0], r.chain_k) for r in sampled
                if r.sampling.seed is not None}  # seeded rows draw with their own keys
        histories = {id(r): mx.array(r.seq, dtype=mx.int32) for r in rows if r.processors}
        plain = not sampled and not histories
        qs: dict[int, list[mx.array]] = {id(r): [] for r in sampled}
        chain: list[mx.array] = []
        for i in range(steps):
            if i:
                logits = forward_batch(self.draft, chain[-1][:, None], cache)[:, 0]
            if plain:
                token = mx.argmax(logits, axis=-1).astype(mx.int32)
            else:
                picks, warped, shared = [], {}, []
                def sampled_here(r: _Row, i: int = i) -> bool:
                    return id(r) in qs and i < r.chain_k and id(r) not in histories

                for members in _regimes(rows, sampled_here).values():
                    probs = warp(logits[mx.array(members)], rows[members[0]].sampling)
                    warped.update({j: probs[g] for g, j in enumerate(members)})
                for j, row in enumerate(rows):
                    row_logits = logits[j]
                    if id(row) in histories:
                        row_logits = draft_logits(row_logits, histories[id(row)],
                                                  [t[j] for t in chain], row.processors,
                                                  self.width)
                    if id(row) in qs and i < row.chain_k:
                        q = warped[j] if j in warped else warp(row_logits, row.sampling)
                        qs[id(row)].append(q)
                        if id(row) in keys:
                            picks.append(sample_rows(q, keys[id(row)][i]))
                        else:
                            shared.append(j)
                            picks.append(None)
                    else:
                        picks.append(mx.argmax(row_logits, axis=-1))
                if shared:  # unseeded rows: one draw for all of them
                    drawn = sample_rows(mx.stack([qs[id(rows[j])][-1] for j in shared]),
                                        self._shared_key())
                    for g, j in enumerate(shared):
                        picks[j] = drawn[g]
                token = mx.stack(picks).astype(mx.int32)
            mx.async_eval(token)
            chain.append(token)
        drafts = mx.stack(chain, axis=1)  # (Bd, steps)
        self._chain = drafts
        for j, row in enumerate(rows):
            if row.chain_k > 0:
                row.drafts = drafts[j, : row.chain_k]
                if id(row) in qs:
                    row.q = mx.stack(qs[id(row)])

    def _inputs(self, width: int) -> mx.array:
        """(B, width): each row's [last, d_1..d_k], right-padded. Host ids (last tokens,
        prompt lookup) and the draft chain's device ids are merged in a few whole-batch ops."""
        rows = self.rows
        host = [[r.seq[-1]] + (r.drafts if isinstance(r.drafts, list) else [])
                for r in rows]
        x = mx.array([h + [0] * (width - len(h)) for h in host], dtype=mx.int32)
        if self._chain is None or width == 1:
            return x
        chain = self._chain  # (model rows, steps): pick each model row's own, up to its k
        steps = chain.shape[1]
        if steps < width - 1:
            chain = mx.pad(chain, [(0, 0), (0, width - 1 - steps)])
        chain = chain[:, : width - 1]
        model_index, picks, take = 0, [], []
        for r in rows:
            picks.append(model_index if r.model else 0)
            take.append([i < r.chain_k and r.model for i in range(width - 1)])
            model_index += r.model
        chain = chain[mx.array(picks, dtype=mx.int32)]
        rest = mx.where(mx.array(take), chain, x[:, 1:])
        return mx.concatenate([x[:, :1], rest], axis=1)

    def _verify(self, inputs: mx.array | None = None) -> tuple[list, list]:
        """One batched forward of every row's [last, d_1..d_k] (`inputs`: the (B, 1) last
        tokens of a plain round, on the device); per row the arrays its commit reads, not yet
        evaluated: the argmax at each position (greedy) or [n, token] (sampled), and the
        processed logits where the row wants logprobs."""
        rows = self.rows
        width = 1 + max(r.round_k for r in rows)
        x = inputs if inputs is not None else self._inputs(width)
        x = model_inputs(self.target, x)  # a wider draft's ids: see speculative._verify
        logits = forward_batch(self.target, x, self.target_cache)  # (B, L, V)
        simple = [not r.processors and r.sampling.greedy for r in rows]
        argmax = mx.argmax(logits, axis=-1).astype(mx.int32) if any(simple) else None
        results: list[mx.array | None] = [None] * len(rows)
        kept: list[mx.array | None] = [None] * len(rows)
        # unseeded plain rows at a temperature alone need no probabilities: softmax(x / T)
        # sampled from the scaled logits, all such rows of one temperature in one draw
        for members in _regimes(rows, _scaled_draw).values():
            scaled = logits[mx.array(members), 0].astype(mx.float32) / rows[
                members[0]].sampling.temperature
            tokens = sample_rows(mx.softmax(scaled, axis=-1), self._shared_key())
            for i, j in enumerate(members):
                results[j] = tokens[i : i + 1]
        warped: dict[int, mx.array] = {}  # row -> its warped p (other sampled rows)
        for members in _regimes(rows, lambda r: not r.sampling.greedy and not r.processors
                                and not _scaled_draw(r)).values():
            probs = warp(logits[mx.array(members)], rows[members[0]].sampling)  # one warp
            warped.update({j: probs[i : i + 1] for i, j in enumerate(members)})
        plain_shared = []  # unseeded plain rows: drawn together
        for j, row in enumerate(rows):
            k = row.round_k
            row_logits = logits[j : j + 1, : k + 1]  # (1, k+1, V)
            if row.processors:
                history = mx.array(row.seq, dtype=mx.int32)
                drafts = [row.drafts[i] for i in range(k)] if k else []
                drafts = [d if isinstance(d, mx.array) else mx.array(d) for d in drafts]
                row_logits = mx.stack([process_logits(row_logits[:, i], history, drafts[:i],
                                                      row.processors)
                                       for i in range(k + 1)], axis=1)
            kept[j] = row_logits if row.logprobs else None
            if results[j] is not None:  # drawn above
                continue
            if simple[j]:
                results[j] = argmax[j, : k + 1]
            elif row.sampling.greedy:
                results[j] = mx.argmax(row_logits[0], axis=-1).astype(mx.int32)
            elif k == 0 and j in warped and row.sampling.seed is None:
                plain_shared.append(j)
            elif k == 0:  # a plain step, sampled as `speculative._plain_step` samples it
                p = warped[j][:, 0] if j in warped else warp(row_logits[:, 0], row.sampling)
                results[j] = sample_rows(p, row.keys[0])
            elif j not in warped:  # processed logits: this row alone
                p = warp(row_logits, row.sampling)
                n, token = speculative_accept(p, self._q(row, p.shape[-1])[None],
                                              self._drafts(row)[None], row.keys[1])
                results[j] = mx.concatenate([n, token])
        if plain_shared:
            tokens = sample_rows(mx.concatenate([warped[j][:, 0] for j in plain_shared]),
                                 self._shared_key())
            for i, j in enumerate(plain_shared):
                results[j] = tokens[i : i + 1]
        drafting = [j for j in warped if rows[j].round_k > 0]
        for seeded in (True, False):  # acceptance in one batch per kind of key
            members = [j for j in drafting if (rows[j].sampling.seed is not None) == seeded]
            if not members:
                continue
            lengths = [rows[j].round_k for j in members]
            top = max(lengths)
            p = mx.concatenate([warped[j][:, : top + 1] for j in members])
            q = mx.stack([mx.pad(self._q(rows[j], p.shape[-1]), [(0, top - n), (0, 0)])
                          for j, n in zip(members, lengths)])
            d = mx.stack([mx.pad(self._drafts(rows[j]), [(0, top - n)])
                          for j, n in zip(members, lengths)])
            keys = [rows[j].keys[1] for j in members] if seeded else self._shared_key()
            n, token = speculative_accept_rows(p, q, d, lengths, keys)
            pairs = mx.stack([n, token], axis=1)
            for i, j in enumerate(members):
                results[j] = pairs[i]
        return results, kept

    def _shared_key(self) -> mx.array:
        self.key, key = mx.random.split(self.key)
        return key

    @staticmethod
    def _drafts(row: _Row) -> mx.array:
        d = row.drafts
        return (d if isinstance(d, mx.array) else mx.array(d, dtype=mx.int32))[: row.round_k]

    def _q(self, row: _Row, width: int) -> mx.array:
        """The row's (k, Vq) draft distributions; point masses for a deterministic proposal."""
        if row.q is not None:
            return row.q
        return point_mass(self._drafts(row), width)

    def _commit(self, results: list[mx.array], kept: list[mx.array | None], elapsed: float,
                timed: bool) -> dict[int, list[Token]]:
        """Book the round for every row, emit its tokens, roll each row's caches back to its
        accepted prefix (a queued plain round has written one position more), and let finished
        rows leave."""
        ahead = 1 if self._queued is not None else 0
        out: dict[int, list[Token]] = {}
        finished: list[_Row] = []
        t_keep, d_keep = [], []
        peak = mx.get_peak_memory() / 1e9
        sizes = [r.size for r in results]
        flat = mx.concatenate(results).tolist()  # one read for the whole batch
        chain = self._chain.tolist() if self._chain is not None else None
        model_index, at = 0, 0
        for row, size, logits in zip(self.rows, sizes, kept):
            k = row.round_k
            values, at = flat[at : at + size], at + size
            if row.model and chain is not None and not row.host:
                drafts = chain[model_index][:k]
            else:
                drafts = row.drafts if isinstance(row.drafts, list) else row.drafts.tolist()
            model_index += row.model
            if row.sampling.greedy:
                n = 0
                while n < k and drafts[n] == values[n]:
                    n += 1
                token = values[n]
            else:  # [n, token], or [token] for a plain step
                n, token = values if size == 2 else (0, values[0])
            tokens = drafts[:n] + [token]
            before = len(row.seq)
            row.drafter.rollback(before + n)  # a hybrid learns which source was accepted
            row.stats.record_round(k, n)
            row.stats.decode_seconds += elapsed
            row.stats.peak_memory = peak
            if row.policy is not None:
                row.policy.update(k, n, 0.0)  # acceptance only: the batch books the time
            emitted = []
            for i, tok in enumerate(tokens):
                row.seq.append(tok)
                row.stats.generated += 1
                finish = ("eos" if tok in row.eos else
                          "length" if row.generated >= row.max_tokens else None)
                row.stats.finish_reason = finish
                logprobs = None
                if logits is not None:
                    logprobs = logits[0, i] - mx.logsumexp(logits[0, i], axis=-1)
                emitted.append(Token(tok, i < n, row.stats, logprobs, finish))
                if finish is not None:
                    finished.append(row)
                    break
            out[row.uid] = emitted
            t_keep.append(len(row.seq) - 1 + ahead)
            if row.model:  # a host proposal's row was fed the chain's tokens past `before`
                d_keep.append(min(len(row.seq) - 1, before) if row.host else len(row.seq) - 1)
        self.target_cache.rollback(t_keep)
        if self.draft_cache is not None and d_keep:
            self.draft_cache.rollback(d_keep)
        if timed and any(r.policy is not None for r in self.rows):
            self._costs().update(max(r.round_k for r in self.rows), 0, elapsed)
        if finished:
            for uid, done in self._leave(finished).items():
                if done.target_cache is not None:
                    self.finished[uid] = done
        return out

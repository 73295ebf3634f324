"""The engine: rounds of propose -> verify -> accept -> commit for B sequences, each rolled back
by its own amount. One sequence (`speculative.decode`, `generate`) is the batch of one; plain
decoding is the round that drafts nothing (k = 0), pipelined as mlx-lm's `generate_step`.

A `BatchDecoder` holds the live sequences of one (target, draft model) pair. `insert` queues a
sequence (its prompt, sampling settings, seed, logits processors, max_tokens, draft source and
k); `step()` runs one round for every live sequence and returns each one's new tokens; a sequence
leaves when it finishes (EOS, max_tokens) or when `remove` is called (a stop string found above
the engine, a client gone). Sequences join and leave between rounds.

A round, for all rows at once:
1. k per row: what the sequence asked for, capped by the tokens it may still emit; k="auto" rows
   share one k chosen with the batch in view (`policy.choose`).
2. Proposals (`drafters.Drafting`): host proposals (prompt lookup) and one batched chain of draft
   steps for the rows the draft model drafts; each sampled row draws from its own q with its
   own key and applies its own processors.
3. One batched verify of every row's [last, d_1..d_k] (right-padded to the longest k), each row
   at its own offset, then the acceptance rule per row (`acceptance.py`).
4. Commit: each row's caches keep its accepted prefix (no copies), its statistics and tokens are
   booked, finished rows leave the batch.

Cache bookkeeping: `seq` is prompt + emitted tokens; between rounds a row's target cache holds
seq[:-1] (seq[-1] is pending) and its draft cache a prefix of it. A seeded sequence's randomness
is keyed by (seed, position) and its tokens are the target's Gumbel-max choices (`seeded.py`), so
its text is plain decoding's with that seed whatever drafted it and whatever sequences are beside
it (up to the float rounding of batched matmuls, docs/design.md); unseeded sequences draw from
keys of their own, split per round.

Prefill of a joining sequence runs on one-sequence caches, `prefill_step` tokens per `step()` at
most (a long prompt does not stall the live rows); the row joins when its prompt is in. Where the
models cannot share a `BatchCache` (a tensor-parallel target, a cache kind it does not hold), or
one sequence is decoded, the batch is a `SingleCache`: at most one row, its own cache as it is.

Knows nothing about text: token ids in, token ids out.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext

import mlx.core as mx
import mlx.nn as nn

from .acceptance import verify
from .backend import generation_stream
from .bitwise import MAX_K as BITWISE_MAX_K
from .bitwise import buffer_need, pad, trim
from .bitwise import refusal as bitwise_refusal
from .cache import KEEP, Cache, cache_length, can_cut, cut, layer_kinds, make_cache, rollback
from .cache.batch import BatchCache, SingleCache
from .cache.recurrent import RecurrentCache
from .distributed import ranks_of
from .drafters import Drafting, Proposals, resolve_drafter
from .forward import PREFILL_STEP, model_inputs, prefill, trace_count, vocab_width
from .hidden import capture
from .policy import (
    AUTO,
    AUTO_MAX_K,
    DEFAULT_K,
    choose,
    max_draft_length,
    sampling_regime,
    shared_policy,
)
from .sampling import ParameterError, Processor, SamplingParams
from .sampling.rejection import greedy_accept_ids
from .sequence import Finished, OwnPrefill, Row, Token
from .stats import GenerationStats
from .tree_verify import check_budget, choices, compact, in_path_order, layout, shapes
from .tree_verify import forward as tree_forward
from .tree_verify import refusal as tree_refusal
from .trees import MAX_TREE, Tree

__all__ = ["BatchDecoder", "Finished", "Token", "max_draft_length", "unbatchable"]

Progress = Callable[[int, int], None]  # (prompt tokens processed, prompt tokens to process)


def _progress(progress: Progress, total: int, past: int = 0) -> Callable[[int], None]:
    return lambda done: progress(past + done, total)


def unbatchable(target: nn.Module, draft: nn.Module | None = None) -> str | None:
    """Which model ("target" or "draft") cannot share a `BatchCache` with other sequences, or
    None when both can (full and sliding-window attention and recurrent layers only, one
    rank)."""
    if ranks_of(target) is not None:
        return "target"
    for name, model in (("target", target), ("draft", draft)):
        if model is not None and layer_kinds(model) is None:
            return name
    return None


class BatchDecoder:
    """Rounds of speculative decoding over a changing batch of sequences (see the module
    docstring). `draft`: what the names "model" and "hybrid" draft with (a draft model or a
    head of the target; None: they are refused); any head of the target (its MTP layer, an
    EAGLE-3 head) and any host drafter may join with a sequence too. `max_kv_size`: every
    sequence's caches bounded as `make_cache` bounds one (then k may be at most `max_k`, the
    rollback margin). `prefill_step`: prompt tokens prefilled per `step()`. `single`: hold one
    sequence at a time (also where the models cannot be batched)."""

    def __init__(self, target: nn.Module, draft: nn.Module | None = None, *,
                 max_kv_size: int | None = None, max_k: int = AUTO_MAX_K,
                 prefill_step: int = PREFILL_STEP, single: bool = False,
                 bitwise: bool = False) -> None:
        if bitwise and (why := bitwise_refusal(target, max_kv_size)) is not None:
            raise ParameterError("bitwise", why, True)
        self.bitwise = bitwise  # every target forward ROWS positions, one sequence (bitwise.py)
        single = single or bitwise
        self.ranks = ranks_of(target)
        # `draft`'s chain is made now (a draft model's or a head's: chains.py); any other
        # drafter's when its first row comes (`insert`)
        base = resolve_drafter(draft, target=target)
        self.single = single or unbatchable(target, base.model) is not None
        self.target, self.draft = target, draft
        self.max_kv_size, self.max_k, self.prefill_step = max_kv_size, max_k, prefill_step
        self.margin = max_k + 1
        kinds = {id(m): layer_kinds(m) for m in (target, base.model) if m is not None}
        # bounded and sliding-window rows, and recurrent ones, roll back at most margin + 1
        # positions: k is at most max_k, and a batch's padded catch-up forwards are no longer
        self.limited = max_kv_size is not None or any(
            kind != "kv" for model_kinds in kinds.values() for kind in model_kinds or ["other"])

        def rows(model: nn.Module) -> BatchCache | SingleCache:
            if self.single:
                return SingleCache()
            if id(model) not in kinds:  # a head that joins later
                kinds[id(model)] = layer_kinds(model)
            return BatchCache(kinds[id(model)], max_kv_size, KEEP, self.margin)

        self.target_cache = rows(target)
        self.width = vocab_width(target)
        chunk = self.margin + 1 if self.limited and not self.single else prefill_step
        self.drafting = Drafting(rows, chunk, self.width)
        self.drafting.add(base, target)
        self.rows: list[Row] = []  # in the batch, in cache row order
        self.pending: list[Row] = []  # prefilling, first come first served
        self.finished: dict[int, Finished] = {}
        self.stream = generation_stream()
        # unseeded rows draw together from this key; a seeded row uses its own
        self.key = mx.random.key(self._seed(None))
        self._uid = 0
        self._queued: tuple[Proposals, tuple[list, list]] | None = None  # a plain round ahead
        self._joined = False  # rows joined before this round: its time is not the round's
        self._chosen: dict[int, int] | None = None  # uid -> the next round's k, chosen ahead
        self._read = 0.0  # when the latest round's tokens were read

    def __len__(self) -> int:
        """Sequences in the decoder (live and prefilling)."""
        return len(self.rows) + len(self.pending)

    def _seed(self, seed: int | None) -> int:
        if seed is not None:
            return seed
        seed = random.SystemRandom().getrandbits(31 if self.ranks else 63)
        return self.ranks.agree(seed) if self.ranks else seed  # ranks draw alike

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
        tree: int | None = None,
        prefill: OwnPrefill | None = None,
    ) -> int:
        """Queue a sequence; returns its uid. Arguments are assumed valid (the API checks them):
        `draft` is anything `resolve_drafter` takes whose model (if any) is the decoder's
        ("model" and "hybrid" name it);
        caches may hold a prefix of `prompt` (one-sequence caches, e.g. a prompt cache's);
        `keep_caches`: keep the sequence's caches for `remove` / `finished`; `tree`: verify
        candidate trees of at most this many nodes (trees.py; k is their depth limit, and
        with k="auto" each round a tree of this many nodes or fewer, its drafter's reach deep,
        or the k="auto" chain: `TreeChoice`) instead of chains; `prefill`: the prompt's own
        prefill (`OwnPrefill`: a prompt with images), run whole where it covers the rest."""
        if not prompt:
            raise ParameterError("prompt", "at least one token", prompt)
        if self.single and len(self):
            raise ValueError("this decoder holds one sequence at a time (single=True, or a "
                             "tensor-parallel target, or layers a batch cannot hold)")
        source = resolve_drafter(draft, self.draft, self.target)
        check_budget(tree, MAX_TREE)
        if tree is not None and (why := tree_refusal(self.target, source, logits_processors,
                                                     self.bitwise)):
            raise ParameterError("tree", why, tree)
        if tree is not None and self.limited and tree > self.max_k:
            raise ParameterError("tree", f"at most max_k = {self.max_k} with bounded, "
                                 "sliding-window or recurrent layers (their rollback margin)", tree)
        if source.model is not None and not (self.drafting.has(source.model)
                                             or source.reads_target):
            raise ParameterError("draft", "the batch's draft model, a head of its target, "
                                 "prompt lookup or None", type(source.model).__name__)
        self.drafting.add(source, self.target)  # a head's chain when its first row comes
        k_cap = reach = max_draft_length(source, k)
        if k == AUTO and self.limited:  # a block drafter's reach, within what rows roll back
            k_cap = min(k_cap, self.max_k)
        if k == AUTO and self.bitwise:
            k_cap = min(k_cap, BITWISE_MAX_K)
        if self.bitwise and k_cap > BITWISE_MAX_K:
            raise ParameterError("k", f"an integer in [1, {BITWISE_MAX_K}] or \"auto\" with "
                                 "bitwise", k)
        if k_cap > self.max_k and self.limited:
            raise ValueError(f"k must be at most max_k = {self.max_k} with bounded, "
                             f"sliding-window or recurrent layers (got {k_cap})")
        if target_cache is None:
            target_cache = make_cache(self.target, self.max_kv_size, self.margin)
        draft_cache = source.row_cache(draft_cache, self.max_kv_size, self.margin)
        for name, cache in [("target_cache", target_cache), ("draft_cache", draft_cache)]:
            if cache is not None and cache_length(cache) > len(prompt) - 1:
                raise ValueError(f"{name} must hold at most len(prompt) - 1 = "
                                 f"{len(prompt) - 1} tokens (got {cache_length(cache)})")
        self._uid += 1
        stats = GenerationStats(k=k if source.drafts else 0, prompt_tokens=len(prompt),
                                cached_tokens=cache_length(target_cache), tree=tree)
        row = Row(self._uid, list(prompt), len(prompt), source, k_cap, sampling,
                  mx.random.key(self._seed(sampling.seed)), frozenset(eos_token_ids),
                  max_tokens, list(logits_processors), stats, logprobs, keep_caches,
                  target_cache=target_cache, draft_cache=draft_cache, tree=tree,
                  prefill=prefill)
        if k == AUTO and source.drafts:
            pair = shared_policy(self.target, source.policy_key, max(AUTO_MAX_K, reach))
            row.acceptance = pair.acceptance(sampling_regime(sampling))
            if tree is not None:  # each round the tree or the k="auto" chain
                row.choice = pair.tree_choice(tree, sampling_regime(sampling))
            stats.policy = pair
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
                end = done.stats.prompt_tokens + keep - 1
                caches = [c for c in (done.target_cache, done.draft_cache) if c is not None]
                if all(can_cut(c, end) for c in caches):
                    for cache in caches:
                        cut(cache, end)
                else:  # a recurrent state cannot go back that far: nothing is kept
                    done.target_cache = done.draft_cache = None
            return done
        for i, row in enumerate(self.pending):
            if row.uid == uid:
                del self.pending[i]
                row.stats.finish_reason = row.stats.finish_reason or "closed"
                draft = self.drafting.release(row, row.draft_cache)
                if not row.keep_caches:
                    return Finished(uid, [], row.stats)
                rollback(row.target_cache, len(row.seq) - 1)
                return Finished(uid, [], row.stats, row.target_cache, draft)
        for row in self.rows:
            if row.uid == uid:
                if keep is not None and keep < row.generated:
                    del row.seq[row.prompt_len + keep:]
                row.stats.finish_reason = row.stats.finish_reason or "closed"
                return self._leave([row]).pop(uid, None)
        return None

    def _leave(self, rows: list[Row]) -> dict[int, Finished]:
        """Rows out of the batch: their caches rolled back to seq[:-1], extracted where kept;
        a queued round forgets them too."""
        leaving = {id(r) for r in rows}
        for row in rows:
            if row.stats.policy is not None:
                row.stats.policy.save()  # what k="auto" learned, for the next process
        cache = self.target_cache
        keep, lost = [], set()  # lost: recurrent rows that cannot go back that far (a stop cut)
        for i, (r, n) in enumerate(zip(self.rows, cache.lengths)):
            want = min(n, len(r.seq) - 1) if id(r) in leaving else n
            if not cache.reachable(i, want):
                lost.add(r.uid)
                want = n
            keep.append(want)
        cache.rollback(keep)
        index = {id(r): i for i, r in enumerate(self.rows)}
        drafts = self.drafting.leave(rows)
        out = {}
        for row in rows:
            t = (cache.extract(index[id(row)]) if row.keep_caches and row.uid not in lost
                 else None)
            out[row.uid] = Finished(row.uid, row.seq[row.prompt_len:], row.stats, t,
                                    drafts.get(row.uid) if t is not None else None)
        cache.remove([index[id(r)] for r in rows])
        if self._queued is not None:
            stay = [i for i, r in enumerate(self.rows) if id(r) not in leaving]
            proposals, (results, kept_logits, _) = self._queued
            self._queued = (Proposals.plain(len(stay)),
                            ([results[i] for i in stay], [kept_logits[i] for i in stay], None))
        self.rows = [r for r in self.rows if id(r) not in leaving]
        if not self.rows:
            self._queued = None
        return out

    # -- prefill -----------------------------------------------------------------------------
    def admit(self, budget: int | None = None, progress: Progress | None = None) -> None:
        """Prefill queued sequences, `budget` prompt tokens in all (None: all of them); those
        whose prompt is in join the batch. `progress(done, total)` follows the target's
        prefill of one sequence's prompt (the first queued)."""
        left = math.inf if budget is None else budget
        joined = []
        while self.pending and left > 0 and not (self.single and self.rows):
            row = self.pending[0]
            start, at = time.perf_counter(), cache_length(row.target_cache)
            todo = row.seq[at:-1]
            own = row.prefill if row.prefill and row.prefill.covers(at) else None
            chunk = todo if left >= len(todo) or own else todo[: int(left)]
            done = None if progress is None else _progress(progress, len(todo))
            reads = self.drafting.reads_target([row])  # a head's row reads the target's states
            with mx.stream(self.stream), (capture() if reads else nullcontext([])) as seen:
                if done is not None:
                    done(0)
                past = own.prefill(self.target, row.target_cache, len(row.seq) - 1, done) \
                    if own is not None else 0  # mlx-vlm to the last image; the target the rest
                prefill(self.target, row.target_cache, todo[past : len(chunk)],
                        progress=progress and _progress(progress, len(todo), past))
                rest = max(0, left - len(chunk))
                fed, ready = self.drafting.admit(row, row.draft_cache,
                                                 None if rest == math.inf else int(rest),
                                                 list(seen), at)
            row.stats.prefill_seconds += time.perf_counter() - start
            left -= len(chunk) + fed
            if len(chunk) < len(todo) or not ready:
                break
            joined.append(self.pending.pop(0))
        if joined:
            self._join(joined)

    def _join(self, rows: list[Row]) -> None:
        """Rows whose prompt is in enter the batch (one copy of each cache for all of them,
        evaluated here so that the next round's time is the round's own)."""
        self.target_cache.add([r.target_cache for r in rows])
        self.drafting.join(rows, [r.draft_cache for r in rows])
        for row in rows:
            row.target_cache = row.draft_cache = None
        self.rows += rows
        mx.eval([cache.arrays() for cache in (self.target_cache, *self.drafting.caches())
                 if isinstance(cache, BatchCache)])
        self._joined = True

    # -- a round -----------------------------------------------------------------------------
    def step(self) -> dict[int, list[Token]]:
        """Prefill what is queued (up to `prefill_step` tokens), then one round for every live
        sequence: uid -> its new tokens (the last one carries finish_reason when it ends). Rows
        that finished have left the batch (their `Finished` is in `finished` when caches were
        kept).

        Plain rounds (every row at k = 0) are pipelined as mlx-lm's loops: when the next round
        is plain too, its forward is queued on this round's tokens before they are read, so the
        host's work overlaps the device's. Not in a round that emits a sequence's first token
        (on MLX's CPU backend the first token would wait for the queued step too), nor while
        sequences wait to join."""
        queued, self._queued = self._queued, None
        if queued is None:
            self.admit(self.prefill_step)
            if not self.rows:
                return {}
        start, traced = time.perf_counter(), trace_count()  # the round, not the prefill
        if queued is None:
            self._choose(self._chosen)
            for row in self.rows:  # this round's tree budgets (and a tree's depth)
                row.budget = row.tree if row.choice is None else row.choice.budget()
                if row.budget and row.choice is not None:
                    row.round_k = max(0, min(row.k_cap, row.max_tokens - row.generated - 1))
                row.split()
            with mx.stream(self.stream):
                proposals = self.drafting.propose(self.rows, [r.round_k for r in self.rows])
                for row, k in zip(self.rows, proposals.ks):
                    row.round_k = k  # a host source may offer fewer than asked
                grown = any(r.budget and r.round_k for r in self.rows)
                results = (self._verify_trees(proposals, shapes(self.rows, proposals))
                           if grown else self._verify(proposals))
        else:
            proposals, results = queued
        self._chosen = None
        if not any(proposals.ks) and self._may_pipeline():
            chosen = self._pick(ahead=1)
            if not any(chosen):
                self._choose(chosen)
                plain = Proposals.plain(len(self.rows))
                for row in self.rows:
                    row.split()
                if self.bitwise:  # this round wrote ROWS positions: keep its one real one
                    self.target_cache.rollback([len(r.seq) for r in self.rows])
                with mx.stream(self.stream):
                    ahead = self._verify(plain, mx.stack([r[-1:] for r in results[0]]))
                mx.async_eval(ahead[0])
                self._queued = (plain, ahead)
            else:
                self._chosen = {r.uid: k for r, k in zip(self.rows, chosen)}
        mx.eval(results[0])
        now = time.perf_counter()
        # a round queued ahead ran on the device since the previous round was read
        elapsed = now - (start if queued is None else self._read)
        self._read = now
        timed, self._joined = trace_count() == traced and not self._joined, False
        return self._commit(proposals, *results, elapsed, timed)

    def _may_pipeline(self) -> bool:
        """Whether the next round may be queued before this one is read: nobody waiting to
        join, no logits processors (their history would have to follow device tokens), not the
        round of a first token, one rank (or fixed k), and a row that goes on past this round."""
        return (not self.pending and not self._joined
                and not any(r.processors for r in self.rows)
                and not any(r.choice is not None and r.choice.tree() for r in self.rows)
                and not (self.ranks and any(r.acceptance is not None for r in self.rows))
                and any(r.generated + 1 < r.max_tokens for r in self.rows))

    def _pick(self, ahead: int = 0) -> list[int]:
        """Each row's k for the round `ahead` rounds from now (k="auto" rows share one, chosen
        with the batch in view)."""
        k_auto: dict[int, int] = {}  # per pair's policy: its rows' one k
        for policy, auto in self._auto_pairs().items():
            limit = max(r.max_tokens - r.generated - 1 - ahead for r in auto)
            costs = auto[0].stats.policy.round_costs(len(self.rows))
            k = choose(costs, [r.acceptance for r in auto], limit)
            k_auto[policy] = self.ranks.agree(k) if self.ranks is not None else k
        picks = []
        for row in self.rows:
            limit = row.max_tokens - row.generated - 1 - ahead
            k = k_auto[id(row.stats.policy)] if row.acceptance is not None else row.k_cap
            picks.append(max(0, min(k, limit, row.k_cap)))
        return picks

    def _auto_pairs(self) -> dict[int, list[Row]]:
        """The k="auto" rows by the policy of their (target, drafter) pair, in row order: each
        pair chooses its k from its own costs and acceptance, and books its own rounds."""
        pairs: dict[int, list[Row]] = {}
        for row in self.rows:
            if row.acceptance is not None:
                pairs.setdefault(id(row.stats.policy), []).append(row)
        return pairs

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

    def _verify(self, proposals: Proposals, inputs: mx.array | None = None) -> tuple:
        """One batched forward of every row's [last, d_1..d_k] (`inputs`: the (B, 1) last
        tokens of the current round, on the device, for a plain round queued ahead), then the
        acceptance rule per row (lazy): (results, kept logits, the capture of the target's
        states where a head's row reads them, else None)."""
        x = inputs if inputs is not None else proposals.inputs([r.seq[-1] for r in self.rows])
        x = model_inputs(self.target, x)  # a wider draft's ids: clamped (acceptance.py)
        reads = self.drafting.reads_target(self.rows)
        n, fixed = x.shape[1], {}
        if self.bitwise:  # one row: ROWS positions, its generation's key buffer (bitwise.py)
            row = self.rows[0]
            x, fixed = pad(x), {"reserve": buffer_need(row.prompt_len, row.max_tokens)}
        with capture() if reads else nullcontext([]) as seen:
            logits = self.target_cache.forward(self.target, x, **fixed)  # (B, L, V)
        if self.bitwise:
            logits = trim(logits, seen, n)
        results, kept = verify(self.rows, proposals, logits, self._shared_key,
                               ahead=0 if inputs is None else 1)
        return results, kept, seen if reads else None

    def _verify_trees(self, proposals: Proposals, trees: list[Tree]) -> tuple:
        """`_verify` for a round in which rows verify trees (`trees`: every row's, a chain where
        it asks for none; tree_verify.py): a tree row's result is the target's choice at each
        of its nodes, its kept logits all of its nodes' (the commit takes its path's)."""
        placed = layout(trees)
        reads = self.drafting.reads_target(self.rows)
        with capture() if reads else nullcontext([]) as seen:
            logits = tree_forward(self.target, self.target_cache,
                                  model_inputs(self.target, placed.tokens), placed)
        grown = {b: t for b, (r, t) in enumerate(zip(self.rows, trees))
                 if r.budget and r.round_k}
        results, kept = verify(self.rows, proposals, logits, self._shared_key, skip=grown)
        for b, chosen in choices(self.rows, grown, logits, proposals).items():
            results[b], kept[b] = chosen, logits[b : b + 1] if self.rows[b].logprobs else None
            self.rows[b].shape = grown[b]
        return results, kept, seen if reads else None

    def _shared_key(self) -> mx.array:
        self.key, key = mx.random.split(self.key)
        return key

    def _commit(self, proposals: Proposals, results: list[mx.array],
                kept: list[mx.array | None], seen: list | None, elapsed: float,
                timed: bool) -> dict[int, list[Token]]:
        """Book the round for every row, emit its tokens, roll each row's caches back to its
        accepted prefix (a queued plain round has written one position more), and let finished
        rows leave."""
        ahead = 1 if self._queued is not None else 0
        out: dict[int, list[Token]] = {}
        finished: list[Row] = []
        keep, befores = [], []
        peak = mx.get_peak_memory() / 1e9
        sizes = [r.size for r in results]
        flat = mx.concatenate(results).tolist()  # one read for the whole batch
        drafted = proposals.values() if any(proposals.ks) else [[]] * len(self.rows)
        paths = []  # each row's accepted positions of its verify, in order
        at = 0
        for row, size, logits, drafts in zip(self.rows, sizes, kept, drafted):
            k = row.round_k
            values, at = flat[at : at + size], at + size
            if row.shape is not None:  # a tree: its walk (trees.py)
                nodes, tests = len(row.shape), (len(values) - len(row.shape)) // 2
                path, tokens = row.shape.walk(values[:nodes], *(
                    [values[nodes : nodes + tests], values[nodes + tests :]] if tests else []))
                n, k = len(path) - 1, len(row.shape) - 1
                row.draft_end = len(row.seq) + row.shape.agreed(path)
                logits = None if logits is None else logits[:, path]
            else:
                if row.sampling.greedy:
                    n, token = greedy_accept_ids(values, drafts[:k])
                else:  # [n, token], or [token] for a plain step
                    n, token = values if size == 2 else (0, values[0])
                tokens, path = drafts[:n] + [token], list(range(n + 1))
            befores.append(len(row.seq))
            row.stats.record_round(k, n, max(row.shape.depths) if row.shape else None)
            row.stats.decode_seconds += elapsed
            row.stats.peak_memory = peak
            if row.choice is not None:
                row.choice.book(row.budget if row.shape is not None else None, len(tokens),
                                elapsed)
            if row.acceptance is not None and k and row.shape is None:
                row.acceptance.update(k, n)
            out[row.uid] = self._emit(row, tokens, n, logits, finished)
            keep.append(len(row.seq) - 1 + ahead)
            paths.append(path)
        if any(r.shape is not None for r in self.rows):  # the walked paths into place
            compact(self.target_cache.layers, [b - 1 for b in befores], paths)
            seen = None if seen is None else in_path_order(seen, paths)
        self.target_cache.rollback(keep)
        self.drafting.commit(self.rows, befores, proposals, seen)
        pairs = self._auto_pairs() if timed else {}
        if pairs:  # what k="auto" books
            elapsed += self._settle(any(proposals.ks))
            for auto in pairs.values():
                if any(r.shape is not None for r in auto):
                    continue  # a tree's round is not a chain's cost
                k = max(r.round_k for r in auto)
                auto[0].stats.policy.round_costs(len(self.rows)).update(k, elapsed)
        for row in self.rows:
            row.shape = row.draft_end = None
        if finished:
            for uid, done in self._leave(finished).items():
                if done.target_cache is not None:
                    self.finished[uid] = done
        return out

    def _settle(self, drafted: bool) -> float:
        """The seconds a drafting round's rollback of recurrent layers takes (their replay is
        lazy: left alone, the next round would run it, and a plain round after a drafting one
        would be booked the drafting round's work); 0 otherwise."""
        if not drafted:
            return 0.0
        states = [layer.cache for layer in self.target_cache.layers
                  if isinstance(layer, RecurrentCache)]
        if not states:
            return 0.0
        start = time.perf_counter()
        mx.eval(states)
        return time.perf_counter() - start

    @staticmethod
    def _emit(row: Row, tokens: list[int], n: int, logits: mx.array | None,
              finished: list[Row]) -> list[Token]:
        """Append the round's tokens to the row (up to its end) as `Token`s."""
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
        return emitted

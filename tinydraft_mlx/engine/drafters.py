"""Draft sources, batched by construction, and the one resolver that turns the user's `draft`
argument into one: a draft model (a `PrunedDraft` is one too), prompt lookup, both (`Hybrid`:
each round from whichever has recently given more tokens per second), or none.

Two parts. A row's *source* (`NoDraft`, `LookupDraft`, `ModelDraft`, `HybridDraft`) is the
per-sequence state: `host_proposal(k)` gives a proposal made on the host (prompt lookup's ids,
possibly none) or None where the draft model should draft the row; `settle(keep)` ends a round
(the first `keep` tokens of the sequence are accepted). `Drafting` is the batch's proposer: it
owns the draft model's caches for every row whose source has the model, and per round makes
every row's proposal, host ones first, then one batched chain of draft steps for the rest
(`propose`), and rolls the draft rows back to what was accepted (`commit`). The engine only calls
`Drafting`; it never asks what kind of source a row has.

Knows nothing about the round's acceptance, text or serving.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from . import seeded
from .cache import Cache, cache_length
from .forward import model_inputs, prefill
from .lookup import NO_DRAFT, PROMPT_LOOKUP, NgramIndex, PromptLookup
from .policy_store import fingerprint
from .sampling import (
    ParameterError,
    Processor,
    draw,
    process_logits,
    sample_rows,
    sampling_groups,
    warp,
)

MODEL = "model"
HYBRID = "hybrid"


class Source(Protocol):
    """One sequence's draft source (see the module docstring)."""

    name: str
    drafts: bool  # False: plain decoding
    model: nn.Module | None  # the draft model whose cache the batch keeps for this row
    policy_key: object  # what k="auto" keeps its learning under

    def begin(self, seq: list[int]) -> None: ...

    def host_proposal(self, k: int) -> list[int] | None: ...

    def settle(self, keep: int) -> None: ...


class NoDraft:
    """Plain decoding: nothing is ever proposed."""

    name, drafts, model, policy_key = NO_DRAFT, False, None, None

    def begin(self, seq: list[int]) -> None:
        pass

    def host_proposal(self, k: int) -> list[int] | None:
        return []

    def settle(self, keep: int) -> None:
        pass


class ModelDraft:
    """A draft model: the batch's chain of draft steps drafts this row every round."""

    name, drafts = MODEL, True

    def __init__(self, model: nn.Module) -> None:
        self.model = self.policy_key = model

    def begin(self, seq: list[int]) -> None:
        pass

    def host_proposal(self, k: int) -> list[int] | None:
        return None

    def settle(self, keep: int) -> None:
        pass


class LookupDraft:
    """Prompt lookup: the continuation of the latest earlier occurrence of the current suffix,
    from an n-gram index of the sequence (no model, no cache). A deterministic proposal: its q is
    the point mass on each proposed token."""

    name, drafts, model = PROMPT_LOOKUP, True, None

    def __init__(self, settings: PromptLookup) -> None:
        self.settings = settings
        self.policy_key = repr(settings)
        self.index: NgramIndex | None = None

    def begin(self, seq: list[int]) -> None:
        self.index = self.settings.index(seq)

    def host_proposal(self, k: int) -> list[int] | None:
        return self.index.propose(k) if k else []

    def settle(self, keep: int) -> None:
        pass  # the index reads the sequence itself


class Hybrid:
    """The `draft` argument for prompt lookup and a draft model together: each round proposes
    from the n-gram index when it has a match and its recent rounds have given at least as many
    tokens per second as the model's, else from the model (see `HybridDraft`)."""

    def __init__(self, model: nn.Module, lookup: PromptLookup | None = None) -> None:
        if not callable(model):
            raise ParameterError("Hybrid model", "a draft model", type(model).__name__)
        self.model, self.lookup = model, lookup or PromptLookup()


class _Recent:
    """One source's recent rounds: exponential means of the tokens a round gave (its accepted
    drafts plus the target's own token) and of its seconds; `rate` is tokens per second (None
    before its first round)."""

    WEIGHT = 0.5  # of the latest round: about the last 2-4 rounds count

    def __init__(self) -> None:
        self.tokens = self.seconds = 0.0
        self.rounds = 0

    def update(self, tokens: int, seconds: float) -> None:
        w = 1.0 if self.rounds == 0 else self.WEIGHT
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.rounds += 1

    @property
    def rate(self) -> float | None:
        return None if self.rounds == 0 else self.tokens / max(self.seconds, 1e-9)


class HybridDraft:
    """Prompt lookup and a draft model. Per round, when the index has a match, the match is
    proposed if lookup has not been tried yet, or if its recent rounds have given at least as
    many tokens per second as the model's (a lookup round costs only the verify; a model round
    adds its draft steps and its catch-up on what lookup rounds emitted), or if the model has
    drafted `RETRY` rounds since lookup was last tried (so that a file being copied later is
    noticed); otherwise the model drafts. Exact either way: a lookup proposal is a point mass,
    the model's comes with its q. A round's seconds run from its proposal to its settlement,
    which in a batch is the batch's round."""

    name, drafts = HYBRID, True
    RETRY = 8  # model rounds between two tries of a lookup that has been losing

    def __init__(self, hybrid: Hybrid) -> None:
        self.model = hybrid.model
        self.lookup = LookupDraft(hybrid.lookup)
        # a string (as a model-free drafter's), stable across processes for the policy file
        self.policy_key = f"{HYBRID}:{fingerprint(hybrid.model)}:{hybrid.lookup!r}"
        self.recent = {PROMPT_LOOKUP: _Recent(), MODEL: _Recent()}
        self.seq: list[int] = []
        self._source: str | None = None  # this round's, until its acceptance is known
        self._start = 0  # seq's length at the proposal
        self._began = 0.0  # when the round's proposal was made
        self._since_lookup = 0  # model rounds since lookup was last chosen

    def begin(self, seq: list[int]) -> None:
        self.seq = seq
        self.lookup.begin(seq)

    def host_proposal(self, k: int) -> list[int] | None:
        """This round's lookup proposal, or None when the model should draft; records which."""
        self._start, self._began = len(self.seq), time.perf_counter()
        match = self.lookup.host_proposal(k) if k else []
        if match and self._prefers_lookup():
            self._source, self._since_lookup = PROMPT_LOOKUP, 0
            return match
        self._source = MODEL if k else None
        self._since_lookup += bool(k)
        return None if k else []

    def _prefers_lookup(self) -> bool:
        mine, model = self.recent[PROMPT_LOOKUP].rate, self.recent[MODEL].rate
        if mine is None:
            return True
        if model is None:
            return False
        return mine >= model or self._since_lookup >= self.RETRY

    def settle(self, keep: int) -> None:
        """The end of a round: keep - (seq's length at the proposal) tokens of this round's
        proposal were accepted."""
        if self._source is not None:
            accepted = max(0, keep - self._start)
            self.recent[self._source].update(accepted + 1, time.perf_counter() - self._began)
            self._source = None


def resolve_drafter(draft: object, model: nn.Module | None = None) -> Source:
    """The source for a `draft` argument: a model, "prompt-lookup" or a `PromptLookup`, a
    `Hybrid`, None or "none" (plain decoding), or a source already resolved (returned as it
    is); with a batch's draft `model`, also "model" and "hybrid" (that model, alone or with
    prompt lookup). ParameterError for anything else."""
    if isinstance(draft, str) and draft in (MODEL, HYBRID):
        if model is None:
            raise ParameterError("draft", f'not "{draft}" in a decoder without a draft model',
                                 draft)
        return ModelDraft(model) if draft == MODEL else HybridDraft(Hybrid(model))
    if draft is None:
        return NoDraft()
    if isinstance(draft, (NoDraft, ModelDraft, LookupDraft, HybridDraft)):
        return draft
    if isinstance(draft, PromptLookup):
        return LookupDraft(draft)
    if isinstance(draft, Hybrid):
        return HybridDraft(draft)
    if isinstance(draft, str):
        if draft.lower() == NO_DRAFT:
            return NoDraft()
        if draft.lower() == PROMPT_LOOKUP:
            return LookupDraft(PromptLookup())
        raise ParameterError("draft", f'a model, "{PROMPT_LOOKUP}", a Hybrid, "{NO_DRAFT}" or None',
                             draft)
    if callable(draft):  # a model: anything mlx-lm-like, model(tokens, cache=...) -> logits
        return ModelDraft(draft)
    raise ParameterError("draft", f'a model, "{PROMPT_LOOKUP}", a Hybrid, "{NO_DRAFT}" or None',
                         type(draft).__name__)


def draft_model(draft: object) -> nn.Module | None:
    """The model behind a `draft` argument (None for prompt lookup and plain decoding)."""
    return resolve_drafter(draft).model


def point_mass(tokens: mx.array, width: int) -> mx.array:
    """(k, width) one-hot rows: the draft distribution of a deterministic proposal."""
    return (mx.arange(width)[None] == tokens[:, None]).astype(mx.float32)


def draft_logits(
    logits: mx.array, history: mx.array, drafts: list[mx.array],
    processors: Sequence[Processor], width: int | None,
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


@dataclass
class Proposals:
    """One round's proposals for every row of the batch, in row order: `ks` the tokens each row
    drafts (0: a plain step), host ids where the host proposed (else None), and the model's
    chain (model rows, steps) with each row's index in it (None for a host row). `q`: a row's
    (k, Vq) draft distributions when it sampled from the model (None: point masses)."""

    ks: list[int]
    host: list[list[int] | None]
    chain: mx.array | None
    chain_rows: list[int | None]
    q: list[mx.array | None]

    @classmethod
    def plain(cls, rows: int) -> Proposals:
        """A round in which no row drafts."""
        return cls([0] * rows, [[]] * rows, None, [None] * rows, [None] * rows)

    def inputs(self, lasts: list[int]) -> mx.array:
        """(B, 1 + max k): each row's [last, d_1..d_k], right-padded, with the chain's device
        ids merged in a few whole-batch ops."""
        width = 1 + max(self.ks, default=0)
        host = [[last] + (h or []) for last, h in zip(lasts, self.host)]
        x = mx.array([h + [0] * (width - len(h)) for h in host], dtype=mx.int32)
        if self.chain is None or width == 1:
            return x
        chain, steps = self.chain, self.chain.shape[1]
        if steps < width - 1:
            chain = mx.pad(chain, [(0, 0), (0, width - 1 - steps)])
        chain = chain[:, : width - 1]
        picks = [0 if j is None else j for j in self.chain_rows]
        take = [[j is not None and i < k for i in range(width - 1)]
                for j, k in zip(self.chain_rows, self.ks)]
        chain = chain[mx.array(picks, dtype=mx.int32)]
        rest = mx.where(mx.array(take), chain, x[:, 1:])
        return mx.concatenate([x[:, :1], rest], axis=1)

    def drafts(self, b: int) -> mx.array:
        """Row b's (k,) draft ids on the device."""
        j, k = self.chain_rows[b], self.ks[b]
        if j is not None:
            return self.chain[j, :k]
        return mx.array(self.host[b] or [], dtype=mx.int32)[:k]

    def q_of(self, b: int, width: int) -> mx.array:
        """Row b's (k, Vq) draft distributions; point masses for a host proposal."""
        return self.q[b] if self.q[b] is not None else point_mass(self.drafts(b), width)

    def values(self) -> list[list[int]]:
        """Every row's draft ids on the host (one read of the chain)."""
        chain = self.chain.tolist() if self.chain is not None else None
        return [h if j is None else chain[j][:k]
                for h, j, k in zip(self.host, self.chain_rows, self.ks)]


class Drafting:
    """The batch's proposer (see the module docstring). `model`: the draft model every row with
    a model-backed source uses (None: only host sources); `caches`: an empty rows cache for its
    rows (a `BatchCache` or a `SingleCache`); `chunk`: the most tokens a catch-up feeds per
    forward; `width`: the target's vocabulary width (processors know its ids)."""

    def __init__(self, model: nn.Module | None, caches: Any, chunk: int,
                 width: int | None) -> None:
        self.model, self.caches, self.chunk, self.width = model, caches, chunk, width
        self.uids: list[int] = []  # rows with the model, in cache row order

    def check(self, source: Source) -> None:
        """ParameterError unless this batch can draft for `source`."""
        if source.model is not None and source.model is not self.model:
            raise ParameterError("draft", "the batch's draft model, prompt lookup or None",
                                 type(source.model).__name__)

    def admit(self, row: Any, cache: Cache | None, budget: int | None) -> tuple[int, bool]:
        """Prefill a joining row's one-sequence draft cache (all of its sequence but the last
        token), at most `budget` tokens (None: all): (tokens fed, whether it is done)."""
        if row.source.model is None or cache is None:
            return 0, True
        todo = row.seq[cache_length(cache) : -1]
        budget = len(todo) if budget is None else budget
        prefill(self.model, cache, todo[:budget])
        return min(len(todo), budget), len(todo) <= budget

    def join(self, rows: list[Any], caches: list[Cache | None]) -> None:
        """Rows enter the batch (after the target's rows), with their draft caches."""
        for row in rows:
            row.source.begin(row.seq)
        members = [(r, c) for r, c in zip(rows, caches) if r.source.model is not None]
        if members:
            self.caches.add([c for _, c in members])
            self.uids += [r.uid for r, _ in members]

    def leave(self, rows: list[Any]) -> dict[int, Cache]:
        """Rows out: their draft caches rolled back to seq[:-1], extracted for the rows that
        keep their caches (`keep_caches`), in one removal."""
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
        self.caches.remove([index[r.uid] for r in members])
        gone = {r.uid for r in members}
        self.uids = [uid for uid in self.uids if uid not in gone]
        return out

    def propose(self, rows: list[Any], ks: list[int]) -> Proposals:
        """Every row's proposal for this round (`ks`: what each row may draft; a host source may
        offer fewer). Rows carry `seq`, `source`, `sampling`, `processors`, `uid` and
        `draft_key` (this round's, None when greedy)."""
        host = [r.source.host_proposal(k) if k else [] for r, k in zip(rows, ks)]
        ks = [k if h is None else len(h) for h, k in zip(host, ks)]
        chain_rows: list[int | None] = [None] * len(rows)
        q: list[mx.array | None] = [None] * len(rows)
        chain = None
        if any(h is None for h in host):
            position = {uid: j for j, uid in enumerate(self.uids)}
            ordered = [None] * len(self.uids)
            for b, row in enumerate(rows):
                if row.uid in position:
                    ordered[position[row.uid]] = (b, row, ks[b] if host[b] is None else 0)
            chain, qs = self._chain(ordered)
            for j, (b, _, k) in enumerate(ordered):
                if k:
                    chain_rows[b], q[b] = j, qs[j]
        return Proposals(ks, host, chain, chain_rows, q)

    def commit(self, rows: list[Any], befores: list[int], proposals: Proposals) -> None:
        """The round is booked (each row's `seq` holds what it accepted): every source settles,
        and each draft row keeps what it saw of the accepted sequence (a host row was fed the
        chain's padding past `before`, its length at the proposal)."""
        for row in rows:
            row.source.settle(len(row.seq) - 1)
        if not self.uids:
            return
        by_uid = {r.uid: (r, before, j is None)
                  for r, before, j in zip(rows, befores, proposals.chain_rows)}
        keep = []
        for uid, length in zip(self.uids, self.caches.lengths):
            row, before, idle = by_uid[uid]
            keep.append(min(length, before if idle else len(row.seq) - 1))
        self.caches.rollback(keep)

    # -- the model's chain -------------------------------------------------------------------
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

    def _chain(self, ordered: list[tuple[int, Any, int]]) -> tuple[mx.array, list]:
        """One batched chain of max(k) draft steps over every model row (rows drafting fewer, or
        none, feed what they have and are rolled back at commit): (model rows, steps) ids and
        each row's q (None when greedy). A seeded row proposes the Gumbel-max choice of its
        (seed, position) noise (`seeded.py`), the noise its verify uses; unseeded rows draw
        together, one draw per step."""
        rows = [r for _, r, _ in ordered]
        ks = [k for _, _, k in ordered]
        caches = self.caches
        self._catch_up(rows)
        unseen = [r.seq[n:] for r, n in zip(rows, caches.lengths)]
        lengths = list(caches.lengths)
        width = max(len(u) for u in unseen)
        x = [model_inputs(self.model, u) + [0] * (width - len(u)) for u in unseen]
        logits = caches.forward(self.model, mx.array(x, dtype=mx.int32))
        caches.rollback([n + len(u) for n, u in zip(lengths, unseen)])
        last = mx.array([len(u) - 1 for u in unseen], dtype=mx.int32)
        logits = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]  # (Bd, Vq)
        sampled = [j for j, (r, k) in enumerate(zip(rows, ks)) if k and not r.sampling.greedy]
        unseeded = [j for j in sampled if rows[j].sampling.seed is None]
        # unseeded rows draw together, one key per step (each row still its own uniform)
        keys = mx.random.split(rows[unseeded[0]].draft_key, max(ks)) if unseeded else None
        histories = {j: mx.array(r.seq, dtype=mx.int32) for j, r in enumerate(rows)
                     if r.processors}
        qs: dict[int, list[mx.array]] = {j: [] for j in sampled}
        chain: list[mx.array] = []
        for i in range(max(ks)):
            if i:
                logits = caches.forward(self.model, chain[-1][:, None])[:, 0]
            if not sampled and not histories:
                token = mx.argmax(logits, axis=-1).astype(mx.int32)
            else:
                token = self._step(rows, ks, i, logits, histories, qs, keys, chain)
            mx.async_eval(token)
            chain.append(token)
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


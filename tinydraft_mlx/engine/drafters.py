"""Draft sources, batched by construction, and the one resolver that turns the user's `draft`
argument into one: a draft model (a `PrunedDraft` is one too), the target's own MTP layer
(`MtpHead`, "mtp") or an EAGLE-3 head (`Eagle3Head`), prompt lookup, both a model (or a head)
and lookup (`Hybrid`: each round from whichever has recently given more tokens per second), or
none.

Two parts. A row's *source* (`NoDraft`, `LookupDraft`, `ModelDraft`, `HeadDraft`, `HybridDraft`)
is the per-sequence state: `host_proposal(k)` gives a proposal made on the host (prompt lookup's
ids, possibly none) or None where its model should draft the row; `settle(keep)` ends a round
(the first `keep` tokens of the sequence are accepted). `Drafting` is the batch's proposer: it
keeps one chain (chains.py) per drafting model (the draft model, each head), and per round
makes every row's proposal, host ones first, then one batched chain of draft steps per model
that a row needs (`propose`), and rolls the chains' rows back to what was accepted (`commit`).
The engine only calls `Drafting`; it never asks what kind of source a row has.

Knows nothing about the round's acceptance, text or serving.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from .cache import Cache, cache_length, make_cache
from .chains import Chain, HeadCache, HeadChain, ModelChain
from .eagle import EAGLE3
from .forward import prefill
from .hidden import StateHead, watch
from .lookup import NO_DRAFT, PROMPT_LOOKUP, NgramIndex, PromptLookup
from .mtp import MTP, head_of
from .policy_store import fingerprint
from .sampling import ParameterError

MODEL = "model"
HYBRID = "hybrid"


@dataclass(frozen=True)
class HostProposal:
    """A proposal made on the host with the distribution it was drawn from: `tokens` (k ids)
    and `q`, (k, Vq) with row i the distribution token i was sampled from (a drafter that
    proposes deterministically returns plain ids instead: point masses)."""

    tokens: list[int]
    q: mx.array


class Source(Protocol):
    """The drafter protocol: one sequence's drafter, everything the round, the forward, prompt
    caches, batches, the server and the check tool ask of it (they never test its type).

    - `name`: how stats, metrics and the server name it; `drafts`: False for plain decoding;
      `policy_key`: what k="auto" keeps its learning under.
    - Proposing: `begin(seq)` once the row joins (seq grows in place); each round
      `host_proposal(k)`: ids proposed on the host (or a `HostProposal` with its q), or None
      where its model's batched chain drafts the row; `settle(keep)` ends the round (the first
      `keep` tokens of the sequence are accepted).
    - Its model (`model`, None for a host-only drafter): `chain(caches, chunk, width)` makes the
      batch's chain for it (chains.py); `attach(target)` checks that it may draft for `target`
      and prepares it; `reads_target`: whether its chain reads the target's states (the verify
      and the prefill then capture them).
    - Its one-sequence cache: `row_cache(given, max_kv_size, margin)` (None without a model);
      `cache_in_file`: whether a prompt cache file keeps it (else a loaded one starts anew).
    - The check tool: `first_logits(ids)` its logits for the token after `ids` (None without a
      model); `prime(cache, ids)` fills a fresh cache with what precedes one step after `ids`
      and returns that step's extra inputs.
    """

    name: str
    drafts: bool
    model: nn.Module | None
    policy_key: object
    reads_target: bool
    cache_in_file: bool

    def begin(self, seq: list[int]) -> None: ...

    def host_proposal(self, k: int) -> list[int] | HostProposal | None: ...

    def settle(self, keep: int) -> None: ...

    def attach(self, target: nn.Module) -> None: ...

    def chain(self, caches: Any, chunk: int, width: int | None) -> Chain: ...

    def row_cache(self, given: Cache | None, max_kv_size: int | None,
                  margin: int) -> Cache | None: ...

    def first_logits(self, ids: list[int]) -> mx.array | None: ...

    def prime(self, cache: Cache, ids: list[int]) -> dict[str, mx.array]: ...


class HostDrafter:
    """What a drafter without a model answers (a base for host-only drafters: prompt lookup,
    plain decoding, and plug-ins that propose on the host): no chain, no cache."""

    name, drafts, model, policy_key = "host", True, None, None
    reads_target, cache_in_file = False, True

    def begin(self, seq: list[int]) -> None:
        pass

    def host_proposal(self, k: int) -> list[int] | HostProposal | None:
        return []

    def settle(self, keep: int) -> None:
        pass

    def attach(self, target: nn.Module) -> None:
        pass

    def chain(self, caches: Any, chunk: int, width: int | None) -> Chain:
        raise ValueError(f"{self.name} drafts on the host: it has no chain")

    def row_cache(self, given: Cache | None, max_kv_size: int | None,
                  margin: int) -> Cache | None:
        return None

    def first_logits(self, ids: list[int]) -> mx.array | None:
        return None

    def prime(self, cache: Cache, ids: list[int]) -> dict[str, mx.array]:
        return {}


class NoDraft(HostDrafter):
    """Plain decoding: nothing is ever proposed."""

    name, drafts = NO_DRAFT, False


class ModelDraft:
    """A draft model: the batch's chain of draft steps drafts this row every round."""

    name, drafts, reads_target, cache_in_file = MODEL, True, False, True

    def __init__(self, model: nn.Module) -> None:
        self.model = self.policy_key = model

    def begin(self, seq: list[int]) -> None:
        pass

    def host_proposal(self, k: int) -> list[int] | HostProposal | None:
        return None

    def settle(self, keep: int) -> None:
        pass

    def attach(self, target: nn.Module) -> None:
        pass

    def chain(self, caches: Any, chunk: int, width: int | None) -> Chain:
        return ModelChain(self.model, caches, chunk, width)

    def row_cache(self, given: Cache | None, max_kv_size: int | None,
                  margin: int) -> Cache | None:
        return given if given is not None else make_cache(self.model, max_kv_size, margin)

    def first_logits(self, ids: list[int]) -> mx.array | None:
        return self.model(mx.array([ids]))[0, -1]

    def prime(self, cache: Cache, ids: list[int]) -> dict[str, mx.array]:
        prefill(self.model, cache, ids)
        return {}


class HeadDraft(ModelDraft):
    """A head that reads the target's states (the target's own MTP layer, mtp.py; an EAGLE-3
    head, eagle.py): drafted by the batch's chain of that head every round. Its cache pairs
    with the target states it has not read yet (`HeadCache`), which a prompt cache file does
    not hold: a loaded prompt cache's head starts anew."""

    reads_target, cache_in_file = True, False

    def __init__(self, model: StateHead) -> None:
        super().__init__(model)
        self.name = model.kind

    def attach(self, target: nn.Module) -> None:
        """ParameterError unless the head reads `target`; its states made capturable."""
        if self.model.target is not target:
            raise ParameterError("draft", "a head of this decoder's target", "another model's")
        watch(target, getattr(self.model, "after", ()))

    def chain(self, caches: Any, chunk: int, width: int | None) -> Chain:
        return HeadChain(self.model, caches, chunk, width)

    def row_cache(self, given: Cache | None, max_kv_size: int | None,
                  margin: int) -> Cache | None:
        """A prompt cache's `HeadCache` as it is; an empty cache of its layers (a caller's,
        bounded as it chose) wrapped; else a new one."""
        if isinstance(given, HeadCache):
            return given
        if given is not None and cache_length(given) == 0:
            return HeadCache(given)
        return HeadCache(make_cache(self.model, max_kv_size, margin))

    def first_logits(self, ids: list[int]) -> mx.array | None:
        """Its logits after `ids`, reading the target's state before the last token."""
        states = self.model.target_states(ids)
        logits, _ = self.model(mx.array([ids[1:]]), None, hidden=states[:, :-1])
        return logits[0, -1]

    def prime(self, cache: Cache, ids: list[int]) -> dict[str, mx.array]:
        """Its cache from the target's states of `ids`; the next step reads the last one."""
        states = self.model.target_states(ids)
        mx.eval(self.model(mx.array([ids[1:]]), cache, hidden=states[:, :-1]))
        return {"hidden": states[:, -1:]}


class LookupDraft(HostDrafter):
    """Prompt lookup: the continuation of the latest earlier occurrence of the current suffix,
    from an n-gram index of the sequence (no model, no cache). A deterministic proposal: its q is
    the point mass on each proposed token."""

    name = PROMPT_LOOKUP

    def __init__(self, settings: PromptLookup) -> None:
        self.settings = settings
        self.policy_key = repr(settings)
        self.index: NgramIndex | None = None

    def begin(self, seq: list[int]) -> None:
        self.index = self.settings.index(seq)

    def host_proposal(self, k: int) -> list[int] | HostProposal | None:
        return self.index.propose(k) if k else []


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
        self.drafter = resolve_drafter(hybrid.model)  # a draft model's or a head's
        self.reads_target = self.drafter.reads_target
        self.cache_in_file = self.drafter.cache_in_file
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

    # its model's side is the model's (or head's) own drafter's
    def attach(self, target: nn.Module) -> None:
        self.drafter.attach(target)

    def chain(self, caches: Any, chunk: int, width: int | None) -> Chain:
        return self.drafter.chain(caches, chunk, width)

    def row_cache(self, given: Cache | None, max_kv_size: int | None,
                  margin: int) -> Cache | None:
        return self.drafter.row_cache(given, max_kv_size, margin)

    def first_logits(self, ids: list[int]) -> mx.array | None:
        return self.drafter.first_logits(ids)

    def prime(self, cache: Cache, ids: list[int]) -> dict[str, mx.array]:
        return self.drafter.prime(cache, ids)


Maker = Callable[[Any, Any], "Source | None"]  # (draft model, target) -> a source, or None
_NAMED: dict[str, Maker] = {}


def register_drafter(name: str, make: Maker) -> None:
    """Name a drafter: `draft=name` (the API, batches, the server's `draft` field) then resolves
    to `make(model, target)`, a fresh `Source` for one sequence (model: the batch's or server's
    draft model, or None; target: the target model), or None where these models cannot draft
    that way. The server offers every name its models can draft with; the exactness tests run
    over every registered name."""
    if not isinstance(name, str) or not name or name != name.strip().lower():
        raise ParameterError("name", "a non-empty lower-case string", name)
    _NAMED[name] = make


def unregister_drafter(name: str) -> None:
    """Forget a name given with `register_drafter` (KeyError for an unknown one)."""
    del _NAMED[name]


def registered_drafters() -> list[str]:
    """Every drafter name, in the order they were registered."""
    return list(_NAMED)


def drafter_names(model: Any = None, target: Any = None) -> list[str]:
    """The names these models can draft with (`model`: a draft model or a head, or None)."""
    return [name for name, make in _NAMED.items() if make(model, target) is not None]


def _head(model: Any) -> HeadDraft | None:
    return HeadDraft(model) if isinstance(model, StateHead) else None


def _model(model: Any) -> Source | None:
    """A draft model's source (a head's, where the batch's draft is one)."""
    return None if model is None else _head(model) or ModelDraft(model)


register_drafter(NO_DRAFT, lambda model, target: NoDraft())
register_drafter(PROMPT_LOOKUP, lambda model, target: LookupDraft(PromptLookup()))
register_drafter(MODEL, lambda model, target: _model(model))
register_drafter(HYBRID, lambda model, target: None if model is None and head_of(target) is None
                 else HybridDraft(Hybrid(model if model is not None else head_of(target))))
register_drafter(MTP, lambda model, target: _head(head_of(target)))
register_drafter(EAGLE3, lambda model, target: _head(model) if getattr(model, "kind", None)
                 == EAGLE3 else None)


def resolve_drafter(draft: object, model: nn.Module | None = None,
                    target: nn.Module | None = None) -> Source:
    """The source for a `draft` argument: None (plain decoding), a registered name
    (`registered_drafters()`: "none", "prompt-lookup", "model", "hybrid", "mtp", "eagle3" and
    plug-ins; "model" and "hybrid" use `model`, the batch's draft model, "mtp" the MTP layer
    attached to `target`), a model or a head, a `PromptLookup`, a `Hybrid`, a plug-in drafter
    (an object whose `source()` makes a fresh `Source`), or a source already resolved (returned
    as it is). ParameterError for anything else."""
    allowed = f'a model, a registered name ({", ".join(_NAMED)}), a Hybrid, a PromptLookup or None'
    if draft is None:
        return NoDraft()
    if isinstance(draft, str):
        make = _NAMED.get(draft.lower())
        if make is None:
            raise ParameterError("draft", allowed, draft)
        source = make(model, target)
        if source is not None:
            return source
        if draft.lower() in (MODEL, HYBRID):
            raise ParameterError("draft", f'not "{draft}" in a decoder without a draft model',
                                 draft)
        if draft.lower() == MTP:
            raise ParameterError("draft", '"mtp" with a target whose MTP layer is loaded '
                                 '(load_models(draft="mtp"))', draft)
        raise ParameterError("draft", f'"{draft}" with models that can draft so', draft)
    if isinstance(draft, (NoDraft, ModelDraft, LookupDraft, HybridDraft)):
        return draft
    if callable(getattr(draft, "source", None)):  # a plug-in drafter
        return draft.source()
    if all(callable(getattr(draft, name, None)) for name in ("host_proposal", "settle")):
        return draft  # a plug-in's source itself
    if isinstance(draft, PromptLookup):
        return LookupDraft(draft)
    if isinstance(draft, Hybrid):
        return HybridDraft(draft)
    if callable(draft):  # a model: anything mlx-lm-like, model(tokens, cache=...) -> logits
        return _model(draft)
    raise ParameterError("draft", allowed, type(draft).__name__)


def draft_model(draft: object, target: nn.Module | None = None) -> nn.Module | None:
    """The draft model behind a `draft` argument whose cache a caller may keep: None for prompt
    lookup, plain decoding and a head of the target (its cache goes with the target states it
    has not read: chains.HeadCache)."""
    if isinstance(draft, str) and draft.lower() in (MTP, EAGLE3):
        return None
    source = resolve_drafter(draft, target=target)
    return None if source.reads_target else source.model


def point_mass(tokens: mx.array, width: int) -> mx.array:
    """(k, width) one-hot rows: the draft distribution of a deterministic proposal."""
    return (mx.arange(width)[None] == tokens[:, None]).astype(mx.float32)


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
        """Row b's (k, W) draft distributions, W the round's one width for q: the target's
        (`width`), or a wider draft's where one proposed, so that every row's q stacks. Point
        masses for a host proposal; a narrower draft's q is zero on the ids it lacks."""
        width = max([width] + [q.shape[-1] for q in self.q if q is not None])
        q = self.q[b]
        if q is None:
            return point_mass(self.drafts(b), width)
        extra = width - q.shape[-1]
        return q if extra == 0 else mx.pad(q, [(0, 0), (0, extra)])

    def values(self) -> list[list[int]]:
        """Every row's draft ids on the host (one read of the chain)."""
        chain = self.chain.tolist() if self.chain is not None else None
        return [h if j is None else chain[j][:k]
                for h, j, k in zip(self.host, self.chain_rows, self.ks)]


class Drafting:
    """The batch's proposer (see the module docstring): one chain per drafting model, made by
    the first source that drafts with it (`add`). `rows`: a function making an empty rows cache
    for a model (a `BatchCache` or a `SingleCache`); `chunk`: the most tokens a catch-up feeds
    per forward; `width`: the target's vocabulary width (processors know its ids)."""

    def __init__(self, rows: Callable[[nn.Module], Any], chunk: int,
                 width: int | None) -> None:
        self.chains: dict[int, Chain] = {}
        self.rows, self.chunk, self.width = rows, chunk, width

    def has(self, model: nn.Module) -> bool:
        """Whether a chain drafts with `model`."""
        return id(model) in self.chains

    def add(self, source: Source, target: nn.Module) -> None:
        """A chain for `source`'s model, if the batch has none yet (the source attached to
        `target` first: ParameterError where it cannot draft for it)."""
        if source.model is not None and id(source.model) not in self.chains:
            source.attach(target)
            self.chains[id(source.model)] = source.chain(self.rows(source.model), self.chunk,
                                                         self.width)

    def caches(self) -> list[Any]:
        """Every chain's rows cache."""
        return [chain.caches for chain in self.chains.values()]

    @staticmethod
    def reads_target(rows: list[Any]) -> bool:
        """Whether a row among `rows` drafts from the target's states (its verify and prefill
        must capture them)."""
        return any(r.source.reads_target for r in rows)

    def admit(self, row: Any, cache: Cache | None, budget: int | None,
              seen: list = (), start: int = 0) -> tuple[int, bool]:
        """Prefill a joining row's one-sequence draft cache (all of its sequence but the last
        token), at most `budget` tokens (None: all): (tokens fed, whether it is done). `seen`:
        the capture of the target's prefill from position `start` (a head's row reads it)."""
        if row.source.model is None or cache is None:
            return 0, True
        return self.chains[id(row.source.model)].admit(row, cache, budget, list(seen), start)

    def release(self, row: Any, cache: Cache | None) -> Cache | None:
        """A row that leaves before joining (its prompt not all in): its one-sequence draft
        cache as it may be kept (None: none), and whatever its chain held for it dropped."""
        if row.source.model is None or cache is None:
            return None
        return self.chains[id(row.source.model)].release(row, cache)

    def join(self, rows: list[Any], caches: list[Cache | None]) -> None:
        """Rows enter the batch (after the target's rows), with their draft caches."""
        for row in rows:
            row.source.begin(row.seq)
        for key, chain in self.chains.items():
            members = [(r, c) for r, c in zip(rows, caches)
                       if r.source.model is not None and id(r.source.model) == key]
            if members:
                chain.join([r for r, _ in members], [c for _, c in members])

    def leave(self, rows: list[Any]) -> dict[int, Cache]:
        """Rows out: their draft caches rolled back to seq[:-1], extracted for the rows that
        keep their caches (`keep_caches`)."""
        out: dict[int, Cache] = {}
        for chain in self.chains.values():
            out.update(chain.leave(rows))
        return out

    def propose(self, rows: list[Any], ks: list[int]) -> Proposals:
        """Every row's proposal for this round (`ks`: what each row may draft; a host source may
        offer fewer). Rows carry `seq`, `source`, `sampling`, `processors`, `uid` and
        `draft_key` (this round's, None when greedy). Each chain a row of this round needs runs
        once for all of its rows; the chains' ids are stacked into one array."""
        host: list[list[int] | None] = []
        q: list[mx.array | None] = [None] * len(rows)
        for b, (row, k) in enumerate(zip(rows, ks)):
            h = row.source.host_proposal(k) if k else []
            if h is not None and not isinstance(h, list):  # a HostProposal: ids with their q
                h, q[b] = list(h.tokens), (h.q[: len(h.tokens)] if h.tokens else None)
            if h is None and not self.chains[id(row.source.model)].ready(row.uid):
                h = []  # nothing to draft from yet (a head's whole prompt came cached)
            host.append(h)
        ks = [k if h is None else len(h) for h, k in zip(host, ks)]
        chain_rows: list[int | None] = [None] * len(rows)
        parts: list[mx.array] = []
        needed = {id(r.source.model) for r, h in zip(rows, host) if h is None}
        at = 0
        for key, chain in self.chains.items():
            if key not in needed:
                continue
            position = {uid: j for j, uid in enumerate(chain.uids)}
            ordered = [None] * len(chain.uids)
            for b, row in enumerate(rows):
                if row.uid in position:
                    ordered[position[row.uid]] = (b, row, ks[b] if host[b] is None else 0)
            ids, qs = chain.run(ordered)
            for j, (b, _, k) in enumerate(ordered):
                if k:
                    chain_rows[b], q[b] = at + j, qs[j]
            parts.append(ids)
            at += ids.shape[0]
        steps = max((p.shape[1] for p in parts), default=0)
        parts = [p if p.shape[1] == steps else mx.pad(p, [(0, 0), (0, steps - p.shape[1])])
                 for p in parts]
        chain = None if not parts else parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return Proposals(ks, host, chain, chain_rows, q)

    def commit(self, rows: list[Any], befores: list[int], proposals: Proposals,
               seen: list | None = None) -> None:
        """The round is booked (each row's `seq` holds what it accepted): every source settles,
        and each chain's rows keep what they saw of the accepted sequence (a host row was fed
        the chain's padding past `before`, its length at the proposal). `seen`: the verify's
        capture of the target's states, where a head's row is in the batch."""
        for row in rows:
            row.source.settle(len(row.seq) - 1)
        by_uid = {r.uid: (r, before, j is None, b)
                  for b, (r, before, j) in enumerate(zip(rows, befores, proposals.chain_rows))}
        for chain in self.chains.values():
            if chain.uids:
                chain.commit(by_uid, seen)

"""The built-in drafters: plain decoding (`NoDraft`), a draft model (`ModelDraft`), a head that
reads the target's states (`HeadDraft`: the target's MTP layer, an EAGLE-3 head), prompt lookup
(`LookupDraft`), and a draft model (or head) with prompt lookup (`Hybrid`, `HybridDraft`: each
round from whichever has recently given more tokens per second).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache import Cache, cache_length, make_cache
from ..forward import prefill
from ..hidden import StateHead, watch
from ..policy import RecentRate
from ..policy_store import fingerprint
from ..sampling import ParameterError
from .chains import Chain, HeadCache, HeadChain, ModelChain
from .lookup import NO_DRAFT, PROMPT_LOOKUP, NgramIndex, PromptLookup
from .protocol import HostDrafter, HostProposal

MODEL = "model"
HYBRID = "hybrid"


class NoDraft(HostDrafter):
    """Plain decoding: nothing is ever proposed."""

    name, drafts = NO_DRAFT, False


class ModelDraft:
    """A draft model: the batch's chain of draft steps drafts this row every round."""

    name, drafts, reads_target, cache_in_file = MODEL, True, False, True
    max_k = block = None

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
        return self._read(ids, None)[0][0, -1]

    def prime(self, cache: Cache, ids: list[int]) -> dict[str, mx.array]:
        """Its cache from the target's states of `ids`; the next step reads the last one."""
        logits, states = self._read(ids, cache)
        mx.eval(logits)
        return {"hidden": states[:, -1:]}

    def _read(self, ids: list[int], cache: Cache | None) -> tuple[mx.array, mx.array]:
        """(its logits over ids[1:], each position reading the target's state before it, the
        target's states of `ids`), its `cache` (if any) advanced."""
        states = self.model.target_states(ids)
        logits, _ = self.model(mx.array([ids[1:]]), cache, hidden=states[:, :-1])
        return logits, states


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

    def host_tree(self, k: int, budget: int) -> list[list[int]]:
        """Several continuations for a candidate tree (`host_proposal`'s first)."""
        return self.index.continuations(k, budget) if k else []


class Hybrid:
    """The `draft` argument for prompt lookup and a draft model together: each round proposes
    from the n-gram index when it has a match and its recent rounds have given at least as many
    tokens per second as the model's, else from the model (see `HybridDraft`)."""

    def __init__(self, model: nn.Module, lookup: PromptLookup | None = None) -> None:
        if not callable(model):
            raise ParameterError("Hybrid model", "a draft model", type(model).__name__)
        self.model, self.lookup = model, lookup or PromptLookup()


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
        self.drafter = model_source(hybrid.model)  # a draft model's or a head's
        self.reads_target = self.drafter.reads_target
        self.cache_in_file = self.drafter.cache_in_file
        self.max_k, self.block = self.drafter.max_k, self.drafter.block
        self.lookup = LookupDraft(hybrid.lookup)
        # a string (as a model-free drafter's), stable across processes for the policy file
        self.policy_key = f"{HYBRID}:{fingerprint(hybrid.model)}:{hybrid.lookup!r}"
        self.recent = {PROMPT_LOOKUP: RecentRate(), MODEL: RecentRate()}
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


def model_source(model: Any) -> Any:
    """A drafting model's source: its own where it makes one (`model.source()`: a block
    drafter's), a head's where it is one (it reads the target), else a draft model's; None for
    None."""
    if model is None:
        return None
    if callable(getattr(model, "source", None)):
        return model.source()
    return HeadDraft(model) if isinstance(model, StateHead) else ModelDraft(model)

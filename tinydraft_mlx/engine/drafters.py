"""Draft sources behind one small protocol, and the one resolver that turns the user's `draft`
argument into one: a draft model (a `PrunedDraft` is one too), prompt lookup, both (`Hybrid`:
each round from whichever has recently given more tokens per second), or none.

The decode loop asks a `Drafter` for proposals and never what kind it holds:

- `begin(seq, cache, fill)`: a generation starts on `seq` (the loop's growing list: prompt +
  emitted); `cache` is the draft model's KV cache (None without a model). A model draft prefills
  what its cache lacks but the last token, or with `fill` False nothing yet: its first
  `catch_up` feeds it all it lacks (`k="auto"` starts it when it first drafts or looks);
  prompt lookup indexes `seq`.
- `propose(k, sampling, key, history, processors, width)`: up to k tokens (k,) continuing `seq`
  and, when sampling, their distributions q (k, width) (point masses for a deterministic
  proposal); fewer (or none) where the source has nothing to offer.
- `catch_up(predict)`: after plain rounds, feed a model what it missed of `seq`, its last token
  included, and keep the logits after that last token for the next `propose`'s first step (the
  catch-up's forward computes them with the rest): (seconds spent, its logits after each of the
  n <= `predict` tokens before the last, (n, V): rows predicting seq[-n:], evidence for
  `k="auto"` from the catch-up's own forward); (0.0, None) where at most two tokens were missed
  (the first draft step feeds those).
- `beyond()`: after a greedy `propose` whose first step fed the draft two tokens (the previous
  round's last draft d_k and the target's token after it: that round was accepted whole),
  whether the draft's argmax after d_k was that token, i.e. whether one more draft position
  would have been accepted there (evidence for `k="auto"`, from logits the step computed
  anyway), as a lazy (1,) int32 array (1: it was), which the loop reads with the round's
  verdict, in one host sync; None otherwise and from drafters without a model.
- `ahead(last, token)`: queue the forward of the next round's first draft step behind this
  round's verify, as if the round were accepted whole (`last`: d_k, `token`: the target's token
  after it, both lazy (1,)); True where something was queued (a model draft), else False. The
  next `propose` draws its first token from those logits (the same draw, with the same key, as
  without the step run ahead) where the round was accepted whole and nothing was fed since;
  `rollback` to fewer tokens than it saw drops it.
- `rollback(keep)`: forget everything after `keep` tokens of `seq` (the accepted prefix; one
  more, the target's token, after a round accepted whole whose next step ran ahead).
- `drafts` (False: plain decoding), `model` (the model whose cache generation and prompt caches
  keep), `policy_key` (what `k="auto"` keeps its learning under), `name` ("model",
  "prompt-lookup", "hybrid", "none").
- `host_proposal(k)`: a proposal made on the host without the model (prompt lookup's), when
  this round should use one, else None; the batched loop drafts the other rows with the model.

Knows nothing about the loop, text or serving.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from .cache import Cache, cache_length, rollback
from .forward import forward, model_inputs, prefill
from .lookup import NO_DRAFT, PROMPT_LOOKUP, NgramIndex, PromptLookup
from .policy import AUTO, AUTO_MAX_K
from .policy_store import fingerprint
from .sampling import (
    ParameterError,
    Processor,
    SamplingParams,
    draw,
    process_logits,
)

MODEL = "model"
HYBRID = "hybrid"

Proposal = tuple[mx.array, mx.array | None]  # draft ids (k,), their q (k, V) when sampling


class Drafter(Protocol):
    """What the decode loop asks of a draft source, for one generation at a time."""

    name: str
    drafts: bool
    model: nn.Module | None
    policy_key: object

    def begin(self, seq: list[int], cache: Cache | None, fill: bool = True) -> None: ...

    def propose(self, k: int, sampling: SamplingParams, key: mx.array | None,
                history: mx.array | None, processors: Sequence[Processor],
                width: int | None) -> Proposal: ...

    def catch_up(self, predict: int = 0) -> tuple[float, mx.array | None]: ...

    def beyond(self) -> mx.array | None: ...

    def ahead(self, last: mx.array, token: mx.array) -> bool: ...

    def rollback(self, keep: int) -> None: ...

    def host_proposal(self, k: int) -> list[int] | None: ...


def _empty() -> Proposal:
    return mx.zeros((0,), dtype=mx.int32), None


class NoDraft:
    """Plain decoding: nothing is ever proposed."""

    name, drafts, model, policy_key = NO_DRAFT, False, None, None

    def begin(self, seq: list[int], cache: Cache | None, fill: bool = True) -> None:
        pass

    def propose(self, k, sampling, key, history, processors, width) -> Proposal:
        return _empty()

    def catch_up(self, predict: int = 0) -> tuple[float, mx.array | None]:
        return 0.0, None

    def beyond(self) -> mx.array | None:
        return None

    def ahead(self, last, token) -> bool:
        return False

    def rollback(self, keep: int) -> None:
        pass

    def host_proposal(self, k: int) -> list[int] | None:
        return None


class ModelDraft:
    """A draft model: k single-token steps, queued with `mx.async_eval` (no host sync along the
    chain), on its own KV cache, which holds a prefix of `seq`."""

    name, drafts = MODEL, True

    def __init__(self, model: nn.Module) -> None:
        self.model = self.policy_key = model
        self.seq: list[int] = []
        self.cache: Cache | None = None
        self._beyond: tuple[mx.array, int] | None = None  # (logits after d_k, the token after)
        self._ahead: _Ahead | None = None  # the next round's first step, queued (`ahead`)

    def begin(self, seq: list[int], cache: Cache | None, fill: bool = True) -> None:
        """`cache` None: the model drafts in a batch, on the batch's cache."""
        self.seq, self.cache, self._ahead = seq, cache, None
        if cache is not None and fill:
            prefill(self.model, cache, seq[cache_length(cache) : -1])

    def propose(self, k, sampling, key, history, processors, width) -> Proposal:
        """The model must have seen all of `seq` but its last 2 tokens (`catch_up` first after
        plain rounds), or all of it where its first step's forward has run already (`ahead`,
        `catch_up`)."""
        self._beyond = None
        start, self._ahead = self._ahead, None
        if k == 0:
            return _empty()
        held = cache_length(self.cache)
        if start is not None and not (start.length == held == len(self.seq)):
            start = None  # tokens since, or the round was not accepted whole
        # the tokens the first step feeds (or fed, where its forward has run already)
        unseen = self.seq[held:] if start is None else self.seq[held - start.rows.shape[0] :]
        drafts, q, after = _draft_chain(self.model, self.cache, unseen, k, sampling, key,
                                        history, processors, width,
                                        None if start is None else start.rows)
        if len(unseen) == 2 and sampling.greedy and not processors:
            self._beyond = after[-2], unseen[-1]
        return drafts, q

    def ahead(self, last: mx.array, token: mx.array) -> bool:
        """Queue the forward of the next round's first draft step behind this round's verify,
        as if the round were accepted whole: feed the draft d_k (`last`, (1,)) and the target's
        token after it (`token`, (1,), lazy: the bonus if all k were accepted). The device runs
        it while the host reads the verdict and books the round; `propose` draws from its
        logits where the round was accepted whole and nothing has been fed since (what the
        step would have computed then: same inputs, same cache, same compiled shape), else
        `rollback` drops it with its two positions. Nothing where the model drafts in a batch
        (no cache of its own)."""
        if self.cache is None:
            return False
        x = model_inputs(self.model, mx.concatenate([last, token]).astype(mx.int32))
        rows = forward(self.model, x[None], self.cache)[0]  # (2, Vq)
        mx.async_eval(rows)
        self._ahead = _Ahead(cache_length(self.cache), rows)
        return True

    def beyond(self) -> mx.array | None:
        """See the module docstring; the argmax of logits the proposal's first step computed,
        taken only when asked (fixed k never asks), lazily: read on its own after the verify
        (a second host sync and a graph of its own) it cost 1.7% of a k="auto" generation
        drafting k = 1 (demo pair, CPU)."""
        if self._beyond is None:
            return None
        logits, following = self._beyond
        self._beyond = None
        return (mx.argmax(logits) == following).astype(mx.int32).reshape(1)

    def catch_up(self, predict: int = 0) -> tuple[float, mx.array | None]:
        """Feed the model what it missed (after plain rounds), its last token included, as one
        prefill, and keep the logits after that last token for the next `propose` (as a step
        run ahead: its first step then runs no forward); returns the seconds it took (prefill
        evaluates, so this is device time too) and its logits after each of the `predict`
        tokens before the last (rows predicting seq[-n:]). Nothing to do (0.0, None) where at
        most 2 tokens were missed (within a run of drafting rounds: its first step feeds them).
        A catch-up that left the last token to the first step made that round a run's slowest
        (demo pair, CPU: 4.1-4.6 ms where a run's k = 1 rounds took 3.1-3.3), and a new pair's
        cost R(k) was judged on such rounds (`policy.py`)."""
        unseen = self.seq[cache_length(self.cache) :]
        if len(unseen) <= 2:
            return 0.0, None
        start = time.perf_counter()
        rows = prefill(self.model, self.cache, unseen, predict=predict + 1)
        self._ahead = _Ahead(len(self.seq), rows[-1:])
        return time.perf_counter() - start, rows[:-1] if predict else None

    def rollback(self, keep: int) -> None:
        if self._ahead is not None and self._ahead.length > keep:
            self._ahead = None
        if self.cache is not None:
            rollback(self.cache, keep)

    def host_proposal(self, k: int) -> list[int] | None:
        return None


class LookupDraft:
    """Prompt lookup: the continuation of the latest earlier occurrence of the current suffix,
    from an n-gram index of `seq` (no model, no cache). A deterministic proposal: its q is the
    point mass on each proposed token."""

    name, drafts, model = PROMPT_LOOKUP, True, None

    def __init__(self, settings: PromptLookup) -> None:
        self.settings = settings
        self.policy_key = repr(settings)
        self.index: NgramIndex | None = None

    def begin(self, seq: list[int], cache: Cache | None, fill: bool = True) -> None:
        self.index = self.settings.index(seq)

    def propose(self, k, sampling, key, history, processors, width) -> Proposal:
        return _host(self.host_proposal(k), sampling, width)

    def catch_up(self, predict: int = 0) -> tuple[float, mx.array | None]:
        return 0.0, None

    def beyond(self) -> mx.array | None:
        return None

    def ahead(self, last, token) -> bool:
        return False

    def rollback(self, keep: int) -> None:
        pass  # the index reads `seq` itself

    def host_proposal(self, k: int) -> list[int] | None:
        return self.index.propose(k) if k else []


def _host(proposal: list[int], sampling: SamplingParams, width: int | None) -> Proposal:
    """A host proposal as (ids, q): its q is the point mass on each token."""
    if not proposal:
        return _empty()
    drafts = mx.array(proposal, dtype=mx.int32)
    return drafts, None if sampling.greedy else point_mass(drafts, width)


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
    noticed); otherwise the model drafts (tried once before lookup's record counts against it).
    A match that keeps being rejected stops crowding out a good model draft, and a model that
    pays less than the copies stops crowding out lookup. Exact either way: a lookup proposal is
    a point mass, the model's comes with its q. A round's seconds run from its proposal to its
    acceptance (`host_proposal` to `rollback`), which in a batch is the batch's round."""

    name, drafts = HYBRID, True
    RETRY = 8  # model rounds between two tries of a lookup that has been losing

    def __init__(self, hybrid: Hybrid) -> None:
        self.model = hybrid.model
        self.inner = ModelDraft(hybrid.model)
        self.lookup = LookupDraft(hybrid.lookup)
        # a string (as a model-free drafter's), stable across processes for the policy file
        self.policy_key = f"{HYBRID}:{fingerprint(hybrid.model)}:{hybrid.lookup!r}"
        self.recent = {PROMPT_LOOKUP: _Recent(), MODEL: _Recent()}
        self.seq: list[int] = []
        self._source: str | None = None  # this round's, until its acceptance is known
        self._start = 0  # seq's length at the proposal
        self._began = 0.0  # when the round's proposal was made
        self._since_lookup = 0  # model rounds since lookup was last chosen

    def begin(self, seq: list[int], cache: Cache | None, fill: bool = True) -> None:
        self.seq = seq
        self.lookup.begin(seq, None)
        self.inner.begin(seq, cache, fill)

    def host_proposal(self, k: int) -> list[int] | None:
        """This round's lookup proposal, or None when the model should draft; records which."""
        self._start, self._began = len(self.seq), time.perf_counter()
        match = self.lookup.host_proposal(k) if k else []
        if match and self._prefers_lookup():
            self._source, self._since_lookup = PROMPT_LOOKUP, 0
            return match
        self._source = MODEL if k else None
        self._since_lookup += bool(k)
        return None

    def _prefers_lookup(self) -> bool:
        mine, model = self.recent[PROMPT_LOOKUP].rate, self.recent[MODEL].rate
        if mine is None:
            return True
        if model is None:
            return False
        return mine >= model or self._since_lookup >= self.RETRY

    def propose(self, k, sampling, key, history, processors, width) -> Proposal:
        match = self.host_proposal(k)
        if match is not None:
            return _host(match, sampling, width)
        self.inner.catch_up()  # only when the model drafts: lookup rounds need no catch-up
        return self.inner.propose(k, sampling, key, history, processors, width)

    def catch_up(self, predict: int = 0) -> tuple[float, mx.array | None]:
        """Nothing here: the model catches up in `propose` when it is the round's source (its
        time is then the round's)."""
        return 0.0, None

    def beyond(self) -> mx.array | None:
        """None: which source drafts changes from round to round."""
        return None

    def ahead(self, last, token) -> bool:
        """Nothing queued: the next round may well be a lookup round."""
        return False

    def rollback(self, keep: int) -> None:
        """Also the end of a round: keep - (seq's length at the proposal) tokens of this round's
        proposal were accepted."""
        if self._source is not None:
            accepted = max(0, keep - self._start)
            self.recent[self._source].update(accepted + 1, time.perf_counter() - self._began)
            self._source = None
        self.inner.rollback(keep)


def resolve_drafter(draft: object) -> Drafter:
    """The drafter for a `draft` argument: a model, "prompt-lookup" or a `PromptLookup`, a
    `Hybrid`, None or "none" (plain decoding), or a drafter already resolved (returned as it
    is). ParameterError for anything else."""
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


def max_draft_length(drafter: Drafter, k: int | str) -> int:
    """The most tokens a round may draft: 0 without drafting, 8 for k="auto", else k."""
    return 0 if not drafter.drafts else AUTO_MAX_K if k == AUTO else k


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
class _Ahead:
    """A first draft step's forward run ahead (`ModelDraft.ahead`: queued behind a verify;
    `ModelDraft.catch_up`: the catch-up's last row): the draft cache's length after it (seq's
    length where it is used) and its logits after each token it fed last (two, or one)."""

    length: int
    rows: mx.array


def _draft_chain(
    draft: nn.Module,
    cache: Cache,
    unseen: list[int],
    k: int,
    params: SamplingParams,
    key: mx.array | None,
    history: mx.array | None = None,
    processors: Sequence[Processor] = (),
    width: int | None = None,
    start: mx.array | None = None,
) -> tuple[mx.array, mx.array | None, mx.array]:
    """Propose k tokens. Returns draft tokens (k,), when sampling their distributions q (k, V),
    and the first step's logits after each of `unseen`, (len(unseen), Vq), lazily (raw: before
    any processor; `ModelDraft.beyond` reads the one after unseen[-2]).

    Feeds `unseen` then d_1..d_(k-1): d_k itself is never run through the draft this round.
    With `processors`, the logits of d_i are processed with the history `history` + d_1..d_(i-1).
    `start`: the first step's logits, its forward on `unseen` already run (`ModelDraft.ahead`).
    """
    keys = None if params.greedy else mx.random.split(key, k)
    x = mx.array(model_inputs(draft, unseen), dtype=mx.int32)
    tokens, qs, first = [], [], None
    for i in range(k):
        if i == 0 and start is not None:  # the step's forward ran ahead (`ModelDraft.ahead`)
            all_logits = start
        else:
            all_logits = forward(draft, x[None], cache)[0]  # (L, Vq)
        first = all_logits if first is None else first
        logits = draft_logits(all_logits[-1], history, tokens, processors, width)
        if params.greedy:
            token = mx.argmax(logits, axis=-1).astype(mx.int32)
        else:
            q, token = draw(logits, params, keys[i])
            qs.append(q)
        mx.async_eval(token)
        tokens.append(token)
        x = token[None]
    return mx.stack(tokens), (mx.stack(qs) if qs else None), first

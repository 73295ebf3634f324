"""The decode loop: rounds of propose -> verify -> accept -> commit, over any drafter
(`drafters.py`). Plain decoding is the k = 0 round of the same loop: a plain step, pipelined as
mlx-lm's `generate_step` when the next round is plain too (no draft; `k="auto"`'s plain rounds;
a prompt lookup that found nothing is one unpipelined plain step), with the same statistics,
caches and rollback.

Knows nothing about text: token ids in, token ids out. Each round the draft proposes k tokens (its
steps are queued with `mx.async_eval`, no host sync along the chain), the target scores
[last, d_1..d_k] in one forward pass, the acceptance rule keeps n of them plus one target token, and
both caches roll back to the accepted prefix. One `.tolist()` per round is the only host sync.
Where a round is likely to be accepted whole (`AHEAD_MIN`: with k="auto" by its policy's acceptance
estimate, else by the share of recent rounds accepted whole), it also queues the next round's
first draft step behind its verify (`Drafter.ahead`: the draft fed d_k and the target's token after
it, still lazy), so that the device runs it while the host reads the verdict and books the round:
used where the round was accepted whole (its token drawn then, with the key that round would have
used anyway: seeded tokens do not change), dropped with its two positions where it was not (demo
pair, CPU, T = 0: k = 1 rounds after a round accepted whole 7% shorter, after a rejection 6%
longer; docs/design.md, "Performance model").

Cache bookkeeping: `seq` is prompt + emitted tokens. At the start of a round the target holds
seq[:-1] (seq[-1] is pending) and the draft holds a prefix of it; whatever the draft has not seen
(one token, or two after a fully accepted round) is fed to it first.

Logits processors (mlx-lm's protocol, `f(tokens, logits) -> logits`) see at verify position i the
history seq + d_1..d_(i-1), as plain decoding would at that position; the draft applies them to
its own logits with the same history. The public API with text is in `api.py`.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import wired_limit

from ..backend import generation_stream
from .cache import Cache, cache_length, make_cache, rollback
from .distributed import ranks_of
from .drafters import Drafter, Proposal, max_draft_length, resolve_drafter
from .forward import PREFILL_STEP, forward, model_inputs, prefill, trace_count, vocab_width
from .policy import (
    AUTO,
    CATCH_UP_EVIDENCE,
    DEFAULT_K,
    DRAFT_RATIO,
    DraftLengthPolicy,
    sampling_regime,
    save_policy,
    settle,
    shared_policy,
)
from .rejection import acceptance_probability, greedy_accept, speculative_accept
from .sampling import Processor, SamplingParams, draw, process_logits, warp, with_warp
from .stats import GenerationStats

__all__ = ["PREFILL_STEP", "Processor", "Progress", "Token", "decode", "max_draft_length",
           "prefill", "vocab_width"]

Progress = Callable[[int, int], None]  # (prompt tokens processed, prompt tokens to process)


@dataclass(frozen=True)
class Token:
    """One generated token. `from_draft`: a draft proposal the target accepted. `logprobs`: the
    target's log-probabilities at this position, (V,), after logits processors and before any
    warp (lazy: computed only if read). `finish_reason`: "eos" or "length" on the last token,
    else None. `stats`: the generation's live statistics object."""

    id: int
    from_draft: bool
    stats: GenerationStats
    logprobs: mx.array | None = None
    finish_reason: str | None = None


AHEAD_MIN = 0.5  # share of rounds accepted whole from which a first draft step runs ahead
AHEAD_DECAY = 0.1  # weight of the latest round in that share


def _verify(
    target: nn.Module,
    cache: Cache,
    last: int,
    drafts: mx.array,
    q: mx.array | None,
    params: SamplingParams,
    key: mx.array | None,
    history: mx.array | None = None,
    processors: Sequence[Processor] = (),
    also: mx.array | None = None,
    ahead: Drafter | None = None,
) -> tuple[list[int], mx.array, bool]:
    """Score [last, d_1..d_k] in one pass; return [n, token, d_1..d_k] with one host sync, the
    (k+1, V) log-probabilities of the processed logits (lazy), and whether `ahead` (a drafter)
    queued the next round's first draft step behind the verify (`Drafter.ahead`), before the
    sync. `also`: a lazy (m,) int32 array read in the same sync, its values appended to the list.

    With `processors`, position i's logits are processed with history + d_1..d_(i-1) (history:
    prompt + emitted tokens), exactly what plain decoding would see there.

    A draft with a wider vocabulary can propose ids beyond the target's embedding: they are
    clamped for the forward pass only (an out-of-bounds read otherwise; undefined on Metal).
    Such a proposal is never accepted (p is 0 there, and argmax p is below the width), so the
    positions after it, the only ones the clamp changes, are always discarded."""
    x = model_inputs(target, mx.concatenate([mx.array([last], dtype=mx.int32), drafts]))
    logits = forward(target, x[None], cache)  # (1, k+1, Vp)
    if processors:
        rows = [process_logits(logits[:, i], history, [drafts[j] for j in range(i)],
                               processors)
                for i in range(logits.shape[1])]
        logits = mx.stack(rows, axis=1)
    if params.greedy:
        n, token = greedy_accept(mx.argmax(logits, axis=-1), drafts[None])
    else:
        q = q[None] if q is not None else mx.zeros((1, 0, logits.shape[-1]), dtype=mx.float32)
        n, token = with_warp(speculative_accept, params)(logits, q, drafts[None], key)
    logprobs = logits[0] - mx.logsumexp(logits[0], axis=-1, keepdims=True)  # (k+1, Vp)
    tail = [] if also is None else [also.astype(drafts.dtype)]
    out = mx.concatenate([n, token, drafts, *tail])
    queued = False
    if ahead is not None:  # the next round's first draft step, run while the host reads this
        mx.async_eval(out)
        queued = ahead.ahead(drafts[-1:], token)
    return out.tolist(), logprobs, queued


def _rollback_both(target_cache: Cache, drafter: Drafter, keep: int) -> None:
    """Both caches forget everything after `keep` tokens (the accepted prefix)."""
    rollback(target_cache, keep)
    drafter.rollback(keep)


def _propose(drafter: Drafter, k: int, sampling: SamplingParams, key: mx.array | None,
             width: int | None, history: mx.array | None,
             processors: Sequence[Processor]) -> Proposal:
    """Up to k draft tokens (k,) and, when sampling, their distributions q (k, V)."""
    return drafter.propose(k, sampling, key, history, processors, width)


@dataclass
class _Generation:
    """One generation's state, shared by its rounds. `seq` is prompt + emitted tokens; at the
    start of a round the target holds seq[:-1]. `choose(limit)` gives the next round's k."""

    target: nn.Module
    target_cache: Cache
    drafter: Drafter
    seq: list[int]
    stats: GenerationStats
    sampling: SamplingParams
    eos: frozenset[int]
    max_tokens: int
    processors: Sequence[Processor]
    stream: mx.Stream
    key: mx.array
    k_cap: int
    policy: DraftLengthPolicy | None = None
    ranks: object = None
    width: int | None = None
    looks: bool = False  # k="auto" takes the draft's predictions as evidence (_prefill)
    whole: int = 0  # tokens the latest round drafted if it was accepted whole (else 0)
    whole_rate: float = AHEAD_MIN  # recent share of drafting rounds accepted whole
    # sampled looks: the target's logits (1, V) at the current plain stretch's last tokens
    plain_rows: list[mx.array] = field(default_factory=list)
    # k="auto" with a draft model on one rank: the draft starts empty (`_prefill`), its first
    # catch-up fills it (`fills`: not yet), and the first round is plain
    draft_cache: Cache | None = None
    fills: bool = False
    target_token_seconds: float = 0.0  # the target's prefill time per token (the draft ratio)

    @property
    def pipelined(self) -> bool:
        """Whether plain steps may be queued a round ahead: the next round's k is then chosen
        before this one's token is read; from k="auto"'s local timings, tensor-parallel ranks
        would have to agree on it every token, so they run its plain rounds unpipelined."""
        return self.ranks is None or self.policy is None

    @property
    def aheads(self) -> bool:
        """Whether a drafting round may queue the next round's first draft step behind its
        verify (`Drafter.ahead`): without logits processors (the step would need the history),
        on one rank."""
        return not self.processors and self.ranks is None

    def whole_chance(self, k: int) -> float:
        """The chance that a round drafting k tokens is accepted whole (`AHEAD_MIN` decides
        whether its next first draft step runs ahead): k="auto"'s estimate (its policy's mean
        acceptance of the first k positions, updated every round and informed by a look's
        evidence), else the recent share of drafting rounds accepted whole. A generation's share
        starts at AHEAD_MIN, so a k="auto" generation's first rejected round turned the step
        ahead off for the round after it: that round, among the three a new pair's R(1) is
        first judged on, ran 3.3-4.0 ms where a run's took 2.5-2.8 (demo pair, acceptance 0.9,
        CPU)."""
        return self.whole_rate if self.policy is None else self.policy.whole_chance(k)

    @property
    def keeps_plain_rows(self) -> bool:
        """Whether plain steps keep the target's logits (`plain_rows`) for the next catch-up's
        evidence: sampled rounds where the loop looks before it leaps. The logits the token was
        drawn from, computed with it anyway: keeping the log-probabilities evaluated with each
        token (a log-softmax over the vocabulary every plain round) made sampled plain rounds
        under k="auto" ~3% slower than plain decoding (demo pair, T = 0.7)."""
        return self.looks and not self.sampling.greedy

    def reconsider(self, evidence: list[float], limit: int) -> int:
        """This round's k again, once the policy has booked the catch-up's evidence."""
        self.policy.observe(evidence)
        return self.policy.choose(limit, caught_up=True)

    def choose(self, limit: int) -> int:
        """k for a round that may emit at most limit + 1 tokens."""
        if self.fills and not self.stats.generated:  # the first token is the target's alone
            return 0
        if self.policy is None:
            return min(self.k_cap, limit)
        if self.fills:  # the policy file's entry, read once the first token is out (`_prefill`)
            settle(self.policy)
        k = self.policy.choose(limit)
        return self.ranks.agree(k) if self.ranks is not None else k

    def split(self, n: int) -> list[mx.array]:
        """n fresh keys (None when greedy: greedy rounds use no randomness)."""
        if self.sampling.greedy:
            return [None] * n
        self.key, *keys = mx.random.split(self.key, n + 1)
        return keys


@dataclass
class _Step:
    """A plain step queued on the device: its token (1,), its log-probabilities (V,), the
    history after it (for logits processors), and its logits (1, V), computed with the token
    (what a sampled look's evidence warps: `plain_rows`)."""

    token: mx.array
    logprobs: mx.array
    history: mx.array | None
    logits: mx.array


def decode(
    target: nn.Module,
    draft: object,
    prompt: list[int],
    *,
    k: int | str = DEFAULT_K,
    max_tokens: int = 256,
    sampling: SamplingParams = SamplingParams(),
    eos_token_ids: Iterable[int] = (),
    target_cache: Cache | None = None,
    draft_cache: Cache | None = None,
    logits_processors: Sequence[Processor] = (),
    prompt_progress_callback: Progress | None = None,
) -> Iterator[Token]:
    """Yield generated tokens as rounds are accepted. Arguments are assumed valid (see
    `api.stream_generate`). `draft` is a model, a `PromptLookup`, None (plain decoding) or a
    resolved `Drafter` (`drafters.resolve_drafter`); `k` an int or "auto" (a `DraftLengthPolicy`
    picks it every round). Caches may be passed in holding a prefix of `prompt` (it is not
    recomputed); whenever the generator stops (length, EOS, close, an error, in the prefill too)
    each cache holds at most seq[:-1]. `prompt_progress_callback(processed, total)` follows the
    target's prefill of the prompt tokens not already cached.

    As mlx-lm's loop: device work runs on a dedicated generation stream, and the wired-memory
    limit is raised to the device's recommended working set for the generation (Metal; a no-op
    elsewhere)."""
    g, draft_cache = _start(target, draft, prompt, k, max_tokens, sampling, eos_token_ids,
                            target_cache, draft_cache, logits_processors)
    with wired_limit((target, g.drafter.model), [g.stream]):
        try:  # from the prefill on: however it ends, `finally` leaves the caches consistent
            _prefill(g, draft_cache, k, prompt_progress_callback)
            yield from _rounds(g)
        finally:
            g.stats.finish_reason = g.stats.finish_reason or "closed"
            _rollback_both(g.target_cache, g.drafter, len(g.seq) - 1)
            save_policy(g.policy)  # what k="auto" learned, for the next process
            if g.ranks is not None and sys.exc_info()[0] in (None, GeneratorExit):
                g.ranks.check_same(g.seq[len(prompt):])  # the ranks must have generated the same


def _start(target, draft, prompt, k, max_tokens, sampling, eos_token_ids, target_cache,
           draft_cache, processors) -> tuple[_Generation, Cache | None]:
    """The generation's state and the draft model's cache (made where missing), checked."""
    drafter = resolve_drafter(draft)
    model = drafter.model
    margin = max_draft_length(drafter, k) + 1  # sliding-window layers roll back this far
    target_cache = make_cache(target, margin=margin) if target_cache is None else target_cache
    if model is not None and draft_cache is None:
        draft_cache = make_cache(model, margin=margin)
    draft_cache = draft_cache if model is not None else None
    for name, cache in [("target_cache", target_cache), ("draft_cache", draft_cache)]:
        if cache is not None and cache_length(cache) > len(prompt) - 1:
            raise ValueError(
                f"{name} must hold at most len(prompt) - 1 = {len(prompt) - 1} tokens "
                f"(got {cache_length(cache)})"
            )
    ranks = ranks_of(target)  # a tensor-parallel target: decisions are made once, on rank 0
    seed = sampling.seed
    if seed is None:
        seed = random.SystemRandom().getrandbits(31 if ranks else 63)
        seed = ranks.agree(seed) if ranks else seed
    stats = GenerationStats(k=k if drafter.drafts else 0, prompt_tokens=len(prompt),
                            cached_tokens=cache_length(target_cache))
    g = _Generation(target, target_cache, drafter, list(prompt), stats, sampling,
                    frozenset(eos_token_ids), max_tokens, processors, generation_stream(),
                    mx.random.key(seed), max_draft_length(drafter, k), ranks=ranks,
                    width=vocab_width(target))
    return g, draft_cache


def _prefill(g: _Generation, draft_cache: Cache | None, k: int | str,
             callback: Progress | None) -> None:
    """Prefill the target (with progress) and start the drafter; with k="auto", take the pair's
    policy.

    With k="auto" and a draft model (one rank), the draft starts empty: nothing is prefilled for
    it here, and the first round is plain whatever the policy would say, so the time to the
    first token is the target's alone. Its first catch-up (the policy's first look at the text,
    or its first drafting round) feeds it the prompt and what has been generated, in one
    forward, and sets the policy's draft/target cost ratio from that forward's time per token
    over the target prefill's. A generation that never drafts nor looks never runs the draft
    (demo pair, CPU: the draft's prefill and an evidence comparison on 16 prompt rows, 4.8-7 ms
    a generation whether the draft was used or not, put k="auto" 4-6% behind plain decoding on
    an always-rejected draft; docs/design.md). For the same reason a pair new to the process
    reads its policy file entry (fingerprinting both models) when its second round is chosen."""
    pending = g.seq[cache_length(g.target_cache) : -1]
    progress = None
    if callback is not None:
        def progress(done: int) -> None:
            callback(done, len(pending))

    auto = k == AUTO and g.drafter.drafts
    # k="auto" learns from the draft's predictions where they tell what a draft would have had
    # accepted: without logits processors (the draft would apply them), on one rank (ranks
    # agree on k once a round); from the plain rounds it catches up on (`_rounds`):
    # `_catch_up_evidence`
    g.looks = auto and not g.processors and g.ranks is None
    start = time.perf_counter()
    with mx.stream(g.stream):
        if progress is not None:
            progress(0)
        prefill(g.target, g.target_cache, pending, progress=progress)
    g.stats.prefill_seconds = target_prefill = time.perf_counter() - start
    if pending:
        g.target_token_seconds = target_prefill / len(pending)
    g.draft_cache = draft_cache
    g.fills = auto and g.drafter.model is not None and g.ranks is None
    start = time.perf_counter()
    with mx.stream(g.stream):
        g.drafter.begin(g.seq, draft_cache, fill=not g.fills)
    draft_prefill = time.perf_counter() - start
    g.stats.prefill_seconds += draft_prefill
    if auto:  # acceptance is learned per sampling regime
        ratio = DRAFT_RATIO  # until the draft's first catch-up measures it (`_filled`)
        if not g.fills and target_prefill > 1e-3:
            ratio = draft_prefill / target_prefill
        # a first round that is plain anyway reads the policy file after the first token
        g.policy = shared_policy(g.target, g.drafter.policy_key, min(1.0, max(0.0, ratio)),
                                 sampling_regime(g.sampling), settled=not g.fills)
        g.policy.looks = g.looks
        # what its first catch-up will feed beyond the plain rounds (a prompt cache's draft
        # cache may hold part of the prompt already)
        g.policy.empty = len(g.seq) - 1 - cache_length(g.draft_cache) if g.fills else 0
        g.looks = g.looks and g.policy.looks  # (a stand-in policy may decline)
        g.stats.policy = g.policy


def _filled(g: _Generation, seconds: float, fed: int) -> None:
    """The draft, started empty (`_prefill`), has been fed `fed` tokens in `seconds` by its
    first catch-up: the policy's draft/target cost ratio from their times per token."""
    g.fills = False
    if fed and g.target_token_seconds > 0 and g.policy is not None:
        ratio = seconds / fed / g.target_token_seconds
        g.policy.draft_ratio = min(1.0, max(0.0, ratio))


def _rounds(g: _Generation) -> Iterator[Token]:
    """Rounds until max_tokens or EOS: propose -> verify -> accept -> commit. A round of k = 0
    (plain decoding, k="auto"'s plain rounds, a prompt lookup that found nothing) is a plain
    step; plain steps are pipelined as mlx-lm's `generate_step`: when the next round is plain
    too, its step is queued before this one's token is read, so the host's work overlaps the
    device's (the step queued past the last token is rolled back by `decode`'s `finally`)."""
    chosen, step = None, None  # the next round's k and plain step, when already decided
    while g.stats.generated < g.max_tokens:
        start, traced = time.perf_counter(), trace_count()
        limit = g.max_tokens - g.stats.generated - 1
        k = g.choose(limit) if chosen is None else chosen
        chosen, catch_up = None, 0.0
        filled = False
        if k > 0:  # after plain rounds the draft catches up first, which k="auto" learns from
            looked = time.perf_counter()
            if g.fills:  # the draft's first catch-up also feeds it the prompt (`_prefill`)
                fed = len(g.seq) - cache_length(g.draft_cache)
            with mx.stream(g.stream):
                catch_up, rows = g.drafter.catch_up(predict=CATCH_UP_EVIDENCE if g.looks else 0)
                evidence = _catch_up_evidence(g, rows) if rows is not None else []
            if g.fills and catch_up > 0:
                _filled(g, catch_up, fed)
                filled = True
            if evidence:
                k = g.reconsider(evidence, limit)
            if catch_up > 0:  # the look's whole price, its evidence included (its rows' head
                # and, sampled, the warps): booked as the round's own time, it made R(1) after a
                # look 2.4x R(0) at T = 0.7 where a k = 1 round costs 1.6x, and kept k = 1 plain
                catch_up = time.perf_counter() - looked
                g.stats.catch_ups += 1
                g.stats.catch_up_seconds += catch_up
        if k > 0:
            draft_key, verify_key = g.split(2)
            with mx.stream(g.stream):
                history = mx.array(g.seq, dtype=mx.int32) if g.processors else None
                drafts, q = _propose(g.drafter, k, g.sampling, draft_key, g.width, history,
                                     g.processors)
            if drafts.size:
                # after a fully accepted round the draft never saw d_k (nor the bonus token): it
                # stays behind, catching up in this round, whose first draft step so tells
                # whether one more position would have been accepted there (read with the verdict)
                beyond = g.drafter.beyond() if g.looks and g.whole and \
                    g.policy.wants_beyond(g.whole) else None
                ahead = g.drafter if g.aheads and g.whole_chance(k) >= AHEAD_MIN else None
                with mx.stream(g.stream):
                    values, logprobs, queued = _verify(
                        g.target, g.target_cache, g.seq[-1], drafts, q, g.sampling,
                        verify_key, history, g.processors, also=beyond, ahead=ahead)
                if beyond is not None:
                    g.policy.observe_beyond(g.whole, bool(values.pop()))
                n, token, *proposed = values  # keep seq + d_1..d_n
                g.whole = len(proposed) if n == len(proposed) else 0
                g.whole_rate += AHEAD_DECAY * (bool(g.whole) - g.whole_rate)
                g.plain_rows.clear()
                rollback(g.target_cache, len(g.seq) + n)
                # accepted whole, a draft step queued ahead saw the bonus token too: it stays
                g.drafter.rollback(len(g.seq) + n + bool(g.whole and queued))
                timed = trace_count() == traced
                if (yield from _commit(g, proposed[:n] + [token], len(proposed), logprobs,
                                       start, timed, catch_up, filled)):
                    return
                continue
        pipelined, g.whole = step is not None, 0
        if step is None:  # nothing queued: this round's step goes first
            step = _queue(g, mx.array(g.seq[-1:], dtype=mx.int32), None)
        following = None
        # not past the first token: it would wait for the step queued behind it too (MLX's CPU
        # backend: plain decoding's first token 29.2 -> 24.0 ms, demo pair), and k="auto"
        # starts its draft once that token is out (`_prefill`)
        if g.pipelined and 0 < g.stats.generated < g.max_tokens - 1:
            chosen = g.choose(limit - 1)  # the next round's k, before this token is read
            if chosen == 0:
                following = _queue(g, step.token, step.history)
        token = step.token.item()
        if g.keeps_plain_rows:
            g.plain_rows = [*g.plain_rows[1 - CATCH_UP_EVIDENCE :], step.logits]
        # timed: a pipelined step that traced nothing (a stretch's first step waits for the
        # one queued behind it too; the policy leaves its last, which waits for little, out of
        # R(0) as well); ranks run every plain step unpipelined
        timed = trace_count() == traced and (pipelined or not g.pipelined)
        if (yield from _commit(g, [token], 0, step.logprobs[None], start, timed, catch_up,
                               filled)):
            return
        step = following


def _catch_up_evidence(g: _Generation, rows: mx.array) -> list[float]:
    """What a catch-up's draft logits `rows` (predicting seq[-n:]) tell about drafting there:
    per position the probability that a one-token draft would have been accepted. Greedy, the
    target's argmax is the token that followed; sampled, the target's distribution there is
    known for the plain stretch's tokens only (`plain_rows`): sum min(p, q) of the warped
    distributions (`rejection.acceptance_probability`)."""
    n = min(rows.shape[0], g.stats.generated)  # generated text only (a first catch-up also
    if n == 0:  # feeds the prompt, text the target did not write)
        return []
    rows = rows[-n:]
    if g.sampling.greedy:
        drafted = mx.argmax(rows, axis=-1).tolist()
        return [float(d == t) for d, t in zip(drafted, g.seq[-n:])]
    m = min(n, len(g.plain_rows))
    if m == 0:
        return []
    p = warp(mx.concatenate(g.plain_rows[-m:]), g.sampling)
    return acceptance_probability(p, warp(rows[-m:], g.sampling)).tolist()


def _queue(g: _Generation, token: mx.array, history: mx.array | None) -> _Step:
    """Queue the plain step after `token` (1,) and start evaluating its token."""
    if history is None and g.processors:
        history = mx.array(g.seq, dtype=mx.int32)
    (key,) = g.split(1)
    with mx.stream(g.stream):
        step = _Step(*_plain_step(g.target, g.target_cache, token, history, g.sampling, key,
                                  g.processors))
    mx.async_eval(step.token)
    return step


def _commit(g: _Generation, tokens: list[int], drafted: int, logprobs: mx.array,
            start: float, timed: bool, catch_up: float,
            filled: bool = False) -> Generator[Token, None, bool]:
    """Book a round that drafted `drafted` tokens and accepted all but the last of `tokens`,
    then emit them; returns True when the generation has finished (EOS or max_tokens). The
    draft's catch-up is the price of switching from plain rounds, booked apart from the round's
    own cost (`filled`: it also fed a draft that started empty the prompt, no switch's price);
    a round that traced a compiled step (once per shape and process) books acceptance only."""
    n = len(tokens) - 1
    elapsed = time.perf_counter() - start
    g.stats.record_round(drafted, n)
    g.stats.decode_seconds += elapsed
    g.stats.peak_memory = mx.get_peak_memory() / 1e9
    if g.policy is not None:
        g.policy.update(drafted, n, elapsed - catch_up if timed else 0.0, catch_up=catch_up,
                        filled=filled)
    for i, tok in enumerate(tokens):
        g.seq.append(tok)
        g.stats.generated += 1
        finish = ("eos" if tok in g.eos else
                  "length" if g.stats.generated >= g.max_tokens else None)
        g.stats.finish_reason = finish
        yield Token(tok, i < n, g.stats, logprobs[i], finish)
        if finish is not None:
            return True
    return False


def _plain_step(
    target: nn.Module,
    cache: Cache,
    token: mx.array,
    history: mx.array | None,
    sampling: SamplingParams,
    key: mx.array | None,
    processors: Sequence[Processor],
) -> tuple[mx.array, mx.array, mx.array | None, mx.array]:
    """Queue one plain step after `token` (1,): (next token (1,), this position's
    log-probabilities (V,), the history including the next token, the logits (1, V) the token
    is drawn from). Nothing is evaluated."""
    logits = forward(target, token[None], cache)[:, -1]  # (1, V)
    if processors:
        logits = process_logits(logits, history, [], processors)
    logprobs = logits[0] - mx.logsumexp(logits[0], axis=-1, keepdims=True)  # (V,)
    if sampling.greedy:
        nxt = mx.argmax(logits, axis=-1).astype(mx.int32)
    else:
        nxt = draw(logits, sampling, key)[1]
    return nxt, logprobs, (mx.concatenate([history, nxt]) if processors else None), logits



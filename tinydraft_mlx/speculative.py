"""The draft/verify loop, and plain decoding (no draft: `_plain`, pipelined as mlx-lm's
`generate_step`, with the same statistics, caches and rollback; the plain rounds `k="auto"` chooses
run as pipelined stretches of it, or, on tensor-parallel ranks, as rounds with k = 0).

Knows nothing about text: token ids in, token ids out. Each round the draft proposes k tokens (its
steps are queued with `mx.async_eval`, no host sync along the chain), the target scores
[last, d_1..d_k] in one forward pass, the acceptance rule keeps n of them plus one target token, and
both caches roll back to the accepted prefix. One `.tolist()` per round is the only host sync.

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
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import wired_limit

from .backend import generation_stream
from .cache import Cache, cache_length, make_cache, rollback
from .distributed import ranks_of
from .drafters import Drafter, Proposal, max_draft_length, resolve_drafter
from .forward import PREFILL_STEP, forward, prefill, traces, vocab_width
from .policy import AUTO, DraftLengthPolicy, shared_policy
from .rejection import greedy_accept, speculative_accept
from .sampling import Processor, SamplingParams, process_logits, warp
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
) -> tuple[list[int], mx.array]:
    """Score [last, d_1..d_k] in one pass; return [n, token, d_1..d_k] with one host sync, and
    the (k+1, V) log-probabilities of the processed logits (lazy).

    With `processors`, position i's logits are processed with history + d_1..d_(i-1) (history:
    prompt + emitted tokens), exactly what plain decoding would see there.

    A draft with a wider vocabulary can propose ids beyond the target's embedding: they are
    clamped for the forward pass only (an out-of-bounds read otherwise; undefined on Metal).
    Such a proposal is never accepted (p is 0 there, and argmax p is below the width), so the
    positions after it, the only ones the clamp changes, are always discarded."""
    x = mx.concatenate([mx.array([last], dtype=mx.int32), drafts])
    width = vocab_width(target)
    if width is not None:
        x = mx.minimum(x, width - 1)
    logits = forward(target, x[None], cache)  # (1, k+1, Vp)
    if processors:
        rows = [process_logits(logits[:, i], history, [drafts[j] for j in range(i)],
                               processors)
                for i in range(logits.shape[1])]
        logits = mx.stack(rows, axis=1)
    if params.greedy:
        n, token = greedy_accept(mx.argmax(logits, axis=-1), drafts[None])
    else:
        p = warp(logits, params)
        q = q[None] if q is not None else mx.zeros((1, 0, p.shape[-1]), dtype=p.dtype)
        n, token = speculative_accept(p, q, drafts[None], key)
    logprobs = logits[0] - mx.logsumexp(logits[0], axis=-1, keepdims=True)  # (k+1, Vp)
    return mx.concatenate([n, token, drafts]).tolist(), logprobs


def _rollback_both(target_cache: Cache, drafter: Drafter, keep: int) -> None:
    """Both caches forget everything after `keep` tokens (the accepted prefix)."""
    rollback(target_cache, keep)
    drafter.rollback(keep)


def _propose(drafter: Drafter, k: int, sampling: SamplingParams, key: mx.array | None,
             width: int | None, history: mx.array | None,
             processors: Sequence[Processor]) -> Proposal:
    """Up to k draft tokens (k,) and, when sampling, their distributions q (k, V)."""
    return drafter.propose(k, sampling, key, history, processors, width)


def decode(
    target: nn.Module,
    draft: object,
    prompt: list[int],
    *,
    k: int | str = 4,
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
    resolved `Drafter` (`drafters.resolve_drafter`); `k` an
    int or "auto" (a `DraftLengthPolicy` picks it every round). Caches may be passed in holding a
    prefix of `prompt` (it is not recomputed); whenever the generator stops (length, EOS, close,
    an error) each cache holds at most seq[:-1]. `prompt_progress_callback(processed, total)`
    follows the target's prefill of the prompt tokens not already cached.

    As mlx-lm's loop: device work runs on a dedicated generation stream, and the wired-memory
    limit is raised to the device's recommended working set for the generation (Metal; a no-op
    elsewhere)."""
    drafter = resolve_drafter(draft)
    model = drafter.model
    target_cache = make_cache(target) if target_cache is None else target_cache
    if model is not None and draft_cache is None:
        draft_cache = make_cache(model)
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
    key = mx.random.key(seed)
    policy = None
    k_cap = max_draft_length(drafter, k)
    stats = GenerationStats(k=k if drafter.drafts else 0, prompt_tokens=len(prompt),
                            cached_tokens=cache_length(target_cache))
    seq = list(prompt)
    stream = generation_stream()
    width = vocab_width(target)
    pending = seq[cache_length(target_cache) : -1]
    progress = None
    if prompt_progress_callback is not None:
        def progress(done: int) -> None:
            prompt_progress_callback(done, len(pending))

    with wired_limit((target, model), [stream]):
        eos = frozenset(eos_token_ids)
        try:  # from the prefill on: however it ends, `finally` leaves the caches consistent
            start = time.perf_counter()
            with mx.stream(stream):
                if progress is not None:
                    progress(0)
                prefill(target, target_cache, pending, progress=progress)
                target_prefill = time.perf_counter() - start
                drafter.begin(seq, draft_cache)  # a draft model prefills what it lacks
            stats.prefill_seconds = time.perf_counter() - start
            if k == AUTO and drafter.drafts:
                # the draft/target cost ratio seen in prefill seeds the first guess of a draft
                # step; acceptance is learned per sampling regime, costs per pair
                draft_prefill = stats.prefill_seconds - target_prefill
                ratio = draft_prefill / target_prefill if target_prefill > 1e-3 else 0.25
                regime = (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p)
                policy = shared_policy(target, drafter.policy_key, min(1.0, max(0.0, ratio)),
                                       regime)
                stats.policy = policy
            if not drafter.drafts:
                yield from _plain(target, target_cache, seq, max_tokens, sampling, key, eos,
                                  stats, stream, logits_processors)
                return
            chosen = None  # k picked at the end of a plain stretch, for the round after it
            while stats.generated < max_tokens:
                start = time.perf_counter()
                # never draft more than can be emitted: a round emits up to k_round + 1 tokens
                limit = max_tokens - stats.generated - 1
                if policy is None:
                    k_round = min(k_cap, limit)
                else:
                    k_round = policy.choose(limit) if chosen is None else min(chosen, limit)
                    chosen = None
                if ranks is not None and policy is not None:  # chosen from local timings
                    k_round = ranks.agree(k_round)
                elif k_round == 0 and policy is not None:
                    # plain rounds chosen by k="auto" run pipelined, as plain decoding does,
                    # until the policy picks a k again (one process: the ranks would have to
                    # agree on every token)
                    key, plain_key = mx.random.split(key)
                    chosen = yield from _plain(target, target_cache, seq, max_tokens, sampling,
                                               plain_key, eos, stats, stream, logits_processors,
                                               policy)
                    if chosen is None:  # finished (length or EOS)
                        return
                    continue
                traced = traces(target) + traces(model)
                draft_key = verify_key = None  # greedy rounds use no randomness
                if not sampling.greedy:
                    key, draft_key, verify_key = mx.random.split(key, 3)
                with mx.stream(stream):
                    catch_up = drafter.catch_up() if k_round else 0.0
                    history = mx.array(seq, dtype=mx.int32) if logits_processors else None
                    drafts, q = _propose(drafter, k_round, sampling, draft_key, width, history,
                                         logits_processors)
                    (n, token, *proposed), logprobs = _verify(
                        target, target_cache, seq[-1], drafts, q, sampling, verify_key,
                        history, logits_processors,
                    )
                # keep seq + d_1..d_n. After a fully accepted round the draft never saw d_k (nor
                # the bonus token): it stays behind and catches up at the start of the next round.
                _rollback_both(target_cache, drafter, len(seq) + n)
                stats.record_round(len(proposed), n)
                elapsed = time.perf_counter() - start
                stats.decode_seconds += elapsed
                stats.peak_memory = mx.get_peak_memory() / 1e9
                # the draft's catch-up is the price of switching from plain rounds, booked apart
                # from the round's own cost; a round that traced a compiled step (once per shape
                # and process) says nothing about later rounds
                if policy is not None:
                    timed = traces(target) + traces(model) == traced
                    policy.update(len(proposed), n, elapsed - catch_up if timed else 0.0,
                                  catch_up=catch_up)
                for i, tok in enumerate(proposed[:n] + [token]):
                    seq.append(tok)
                    stats.generated += 1
                    finish = ("eos" if tok in eos else
                              "length" if stats.generated >= max_tokens else None)
                    stats.finish_reason = finish
                    yield Token(tok, i < n, stats, logprobs[i], finish)
                    if finish is not None:
                        return
        finally:
            stats.finish_reason = stats.finish_reason or "closed"
            _rollback_both(target_cache, drafter, len(seq) - 1)
            if ranks is not None and sys.exc_info()[0] in (None, GeneratorExit):
                ranks.check_same(seq[len(prompt):])  # the ranks must have generated the same


def _plain_step(
    target: nn.Module,
    cache: Cache,
    token: mx.array,
    history: mx.array | None,
    sampling: SamplingParams,
    key: mx.array | None,
    processors: Sequence[Processor],
) -> tuple[mx.array, mx.array, mx.array | None]:
    """Queue one plain step after `token` (1,): (next token (1,), this position's
    log-probabilities (V,), the history including the next token). Nothing is evaluated."""
    logits = forward(target, token[None], cache)[:, -1]  # (1, V)
    if processors:
        logits = process_logits(logits, history, [], processors)
    logprobs = logits[0] - mx.logsumexp(logits[0], axis=-1, keepdims=True)  # (V,)
    if sampling.greedy:
        nxt = mx.argmax(logits, axis=-1).astype(mx.int32)
    else:
        nxt = mx.random.categorical(mx.log(warp(logits, sampling)), key=key).astype(mx.int32)
    return nxt, logprobs, (mx.concatenate([history, nxt]) if processors else None)


def _plain(
    target: nn.Module,
    cache: Cache,
    seq: list[int],
    max_tokens: int,
    sampling: SamplingParams,
    key: mx.array,
    eos: frozenset[int],
    stats: GenerationStats,
    stream: mx.Stream,
    processors: Sequence[Processor],
    policy: DraftLengthPolicy | None = None,
) -> Generator[Token, None, int | None]:
    """Plain decoding, pipelined as mlx-lm's `generate_step`: step t+1 is queued (its graph built
    and evaluation started) before token t is read, so the host's work overlaps the device's. The
    step queued past the last token is rolled back by the caller's `finally`, as any round's.

    With `policy` (a stretch of plain rounds chosen by k="auto"): each token is booked as a plain
    round, and before step t+1 is queued the policy chooses again; when it picks k > 0 nothing
    more is queued, and after token t the stretch returns that k (the target then holds seq[:-1],
    as at the start of any round). Returns None when generation finished (length or EOS)."""

    def queue(token: mx.array, history: mx.array | None, key: mx.array) -> tuple:
        step_key = None
        if not sampling.greedy:
            key, step_key = mx.random.split(key)
        with mx.stream(stream):
            step = _plain_step(target, cache, token, history, sampling, step_key, processors)
        mx.async_eval(step[0])
        return step, key

    history = mx.array(seq, dtype=mx.int32) if processors else None
    first_token = stats.generated
    start, traced = time.perf_counter(), traces(target)
    (y, logprobs, history), key = queue(mx.array(seq[-1:], dtype=mx.int32), history, key)
    while True:
        following, chosen = None, 0
        if stats.generated + 1 < max_tokens:
            if policy is not None:  # for the round after this token
                chosen = policy.choose(max_tokens - stats.generated - 2)
            if chosen == 0:
                following, key = queue(y, history, key)
        token = y.item()
        elapsed = time.perf_counter() - start
        stats.record_round(0, 0)
        stats.decode_seconds += elapsed
        stats.peak_memory = mx.get_peak_memory() / 1e9
        if policy is not None:
            # a pipelined plain token's time; not the stretch's first token (nothing overlapped
            # it: the probe's price counts that) nor one whose step traced a compiled shape
            timed = traces(target) == traced and stats.generated > first_token
            policy.update(0, 0, elapsed if timed else 0.0)
        seq.append(token)
        stats.generated += 1
        last = following is None and chosen == 0
        finish = "eos" if token in eos else "length" if last else None
        stats.finish_reason = finish
        yield Token(token, False, stats, logprobs, finish)
        if finish is not None:
            return None
        if following is None:
            return chosen
        # the consumer's time between tokens is not decoding
        start, traced = time.perf_counter(), traces(target)
        y, logprobs, history = following



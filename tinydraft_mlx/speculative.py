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
from .forward import forward, traces
from .lookup import NgramIndex, PromptLookup, draft_model
from .policy import AUTO, AUTO_MAX_K, DraftLengthPolicy, shared_policy
from .rejection import greedy_accept, speculative_accept
from .sampling import SamplingParams, warp
from .stats import GenerationStats

PREFILL_STEP = 512

Processor = Callable[[mx.array, mx.array], mx.array]  # (tokens (L,), logits (1, V)) -> logits
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


def vocab_width(model: nn.Module) -> int | None:
    """Rows of the model's embedding (its logit width for Qwen2), from the mlx-lm config."""
    return getattr(getattr(model, "args", None), "vocab_size", None)


def model_inputs(model: nn.Module, tokens: list[int]) -> list[int]:
    """`tokens` made safe for `model`'s embedding. Only the draft can meet ids beyond its width
    (the target's logits may be wider, e.g. Qwen2.5-7B vs 0.5B); they become its last row. That
    only changes which q the draft proposes from, never the exactness of the output."""
    width = vocab_width(model)
    return tokens if width is None else [min(t, width - 1) for t in tokens]


def prefill(
    model: nn.Module,
    cache: Cache,
    tokens: list[int],
    step: int = PREFILL_STEP,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Run `tokens` through `model`, filling `cache`, in chunks of `step` tokens; `progress(n)`
    after each chunk with the tokens processed so far."""
    tokens = model_inputs(model, tokens)
    for start in range(0, len(tokens), step):
        model(mx.array(tokens[start : start + step], dtype=mx.int32)[None], cache=cache)
        mx.eval([layer.state for layer in cache])
        mx.clear_cache()  # as mlx-lm: free the chunk's temporaries before the next one
        if progress is not None:
            progress(min(start + step, len(tokens)))


def _process(
    logits: mx.array, history: mx.array, drafts: list[mx.array], processors: Sequence[Processor]
) -> mx.array:
    """(1, V) logits after `processors`, for the position that follows history + drafts."""
    if not processors:
        return logits
    tokens = mx.concatenate([history, *(d.reshape(1) for d in drafts)]) if drafts else history
    for processor in processors:
        logits = processor(tokens, logits)
    return logits


def _draft_logits(
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
    return _process(row, history, drafts, processors)[0, : logits.shape[-1]]


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
) -> tuple[mx.array, mx.array | None]:
    """Propose k tokens. Returns draft tokens (k,) and, when sampling, their distributions q (k, V).

    Feeds `unseen` then d_1..d_(k-1): d_k itself is never run through the draft this round.
    With `processors`, the logits of d_i are processed with the history `history` + d_1..d_(i-1).
    """
    keys = None if params.greedy else mx.random.split(key, k)
    x = mx.array(model_inputs(draft, unseen), dtype=mx.int32)
    tokens, qs = [], []
    for i in range(k):
        logits = forward(draft, x[None], cache)[0, -1]  # (Vq,)
        logits = _draft_logits(logits, history, tokens, processors, width)
        if params.greedy:
            token = mx.argmax(logits, axis=-1).astype(mx.int32)
        else:
            q = warp(logits, params)
            token = mx.random.categorical(mx.log(q), key=keys[i]).astype(mx.int32)
            qs.append(q)
        mx.async_eval(token)
        tokens.append(token)
        x = token[None]
    return mx.stack(tokens), (mx.stack(qs) if qs else None)


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
        rows = [_process(logits[:, i], history, [drafts[j] for j in range(i)], processors)
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


def _rollback_both(target_cache: Cache, draft_cache: Cache | None, keep: int) -> None:
    """Both caches forget everything after `keep` tokens (the accepted prefix)."""
    rollback(target_cache, keep)
    if draft_cache is not None:
        rollback(draft_cache, keep)


def max_draft_length(draft: object, k: int | str) -> int:
    """The most tokens a round may draft: 0 without a draft, 8 for k="auto", else k."""
    return 0 if draft is None else AUTO_MAX_K if k == AUTO else k


def _point_mass(tokens: mx.array, width: int) -> mx.array:
    """(k, width) one-hot rows: the draft distribution of a deterministic proposal."""
    return (mx.arange(width)[None] == tokens[:, None]).astype(mx.float32)


def decode(
    target: nn.Module,
    draft: nn.Module | PromptLookup | None,
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
    `api.stream_generate`). `draft` is a model, a `PromptLookup`, or None (plain decoding); `k` an
    int or "auto" (a `DraftLengthPolicy` picks it every round). Caches may be passed in holding a
    prefix of `prompt` (it is not recomputed); whenever the generator stops (length, EOS, close,
    an error) each cache holds at most seq[:-1]. `prompt_progress_callback(processed, total)`
    follows the target's prefill of the prompt tokens not already cached.

    As mlx-lm's loop: device work runs on a dedicated generation stream, and the wired-memory
    limit is raised to the device's recommended working set for the generation (Metal; a no-op
    elsewhere)."""
    lookup = draft if isinstance(draft, PromptLookup) else None
    model = draft_model(draft)
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
    k_cap = max_draft_length(draft, k)
    stats = GenerationStats(k=k if draft is not None else 0, prompt_tokens=len(prompt),
                            cached_tokens=cache_length(target_cache))
    seq = list(prompt)
    index = lookup.index(seq) if lookup is not None else None
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
                if model is not None:
                    prefill(model, draft_cache, seq[cache_length(draft_cache) : -1])
            stats.prefill_seconds = time.perf_counter() - start
            if k == AUTO and draft is not None:
                # the draft/target cost ratio seen in prefill seeds the first guess of a draft
                # step; acceptance is learned per sampling regime, costs per pair
                draft_prefill = stats.prefill_seconds - target_prefill
                ratio = draft_prefill / target_prefill if target_prefill > 1e-3 else 0.25
                draft_key = repr(lookup) if lookup is not None else model
                regime = (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p)
                policy = shared_policy(target, draft_key, min(1.0, max(0.0, ratio)), regime)
                stats.policy = policy
            if draft is None:
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
                    catch_up = _catch_up(model, draft_cache, seq) if k_round else 0.0
                    history = mx.array(seq, dtype=mx.int32) if logits_processors else None
                    drafts, q = _propose(model, draft_cache, index, seq, k_round, sampling,
                                         draft_key, width, history, logits_processors)
                    (n, token, *proposed), logprobs = _verify(
                        target, target_cache, seq[-1], drafts, q, sampling, verify_key,
                        history, logits_processors,
                    )
                # keep seq + d_1..d_n. After a fully accepted round the draft never saw d_k (nor
                # the bonus token): it stays behind and catches up at the start of the next round.
                _rollback_both(target_cache, draft_cache, len(seq) + n)
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
            _rollback_both(target_cache, draft_cache, len(seq) - 1)
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
        logits = _process(logits, history, [], processors)
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


def _catch_up(model: nn.Module | None, draft_cache: Cache | None, seq: list[int]) -> float:
    """Feed the draft model what it missed (after plain rounds) but the last token, as a prefill,
    so that at most 2 tokens remain for its first step; returns the seconds it took (prefill
    evaluates, so this is device time too). Nothing to do (0.0) within a run of drafting rounds."""
    if model is None or draft_cache is None:
        return 0.0
    unseen = seq[cache_length(draft_cache) :]
    if len(unseen) <= 2:
        return 0.0
    start = time.perf_counter()
    prefill(model, draft_cache, unseen[:-1])
    return time.perf_counter() - start


def _propose(
    model: nn.Module | None,
    draft_cache: Cache | None,
    index: NgramIndex | None,
    seq: list[int],
    k: int,
    sampling: SamplingParams,
    key: mx.array | None,
    target_width: int | None,
    history: mx.array | None = None,
    processors: Sequence[Processor] = (),
) -> tuple[mx.array, mx.array | None]:
    """Up to k draft tokens (k,) and, when sampling, their distributions q (k, V): from the
    n-gram index (point masses), or from the draft model, which must have seen all of `seq` but
    its last 2 tokens (after plain rounds of k="auto" the caller runs `_catch_up` first)."""
    empty = mx.zeros((0,), dtype=mx.int32), None
    if k == 0:
        return empty
    if index is not None:
        proposal = index.propose(k)
        if not proposal:
            return empty
        drafts = mx.array(proposal, dtype=mx.int32)
        return drafts, None if sampling.greedy else _point_mass(drafts, target_width)
    unseen = seq[cache_length(draft_cache) :]
    return _draft_chain(model, draft_cache, unseen, k, sampling, key, history, processors,
                        target_width)

"""The draft/verify loop, and plain decoding through the same code (no draft, k = 0).

Knows nothing about text: token ids in, token ids out. Each round the draft proposes k tokens (its
steps are queued with `mx.async_eval`, no host sync along the chain), the target scores
[last, d_1..d_k] in one forward pass, the acceptance rule keeps n of them plus one target token, and
both caches roll back to the accepted prefix. One `.tolist()` per round is the only host sync.

Cache bookkeeping: `seq` is prompt + emitted tokens. At the start of a round the target holds
seq[:-1] (seq[-1] is pending) and the draft holds a prefix of it; whatever the draft has not seen
(one token, or two after a fully accepted round) is fed to it first.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import wired_limit

from .backend import generation_stream
from .cache import KEEP, Cache, cache_length, make_cache, rollback
from .lookup import NO_DRAFT, PROMPT_LOOKUP, NgramIndex, PromptLookup
from .policy import AUTO, AUTO_MAX_K, shared_policy
from .rejection import greedy_accept, speculative_accept
from .sampling import ParameterError, SamplingParams, check_int, warp
from .stats import GenerationStats

MAX_DRAFT_TOKENS = 64
PREFILL_STEP = 512


@dataclass(frozen=True)
class Token:
    """One generated token. `from_draft` is True when it was a draft proposal the target accepted;
    `stats` is the generation's live statistics object."""

    id: int
    from_draft: bool
    stats: GenerationStats


def vocab_width(model: nn.Module) -> int | None:
    """Rows of the model's embedding (its logit width for Qwen2), from the mlx-lm config."""
    return getattr(getattr(model, "args", None), "vocab_size", None)


def model_inputs(model: nn.Module, tokens: list[int]) -> list[int]:
    """`tokens` made safe for `model`'s embedding. Only the draft can meet ids beyond its width
    (the target's logits may be wider, e.g. Qwen2.5-7B vs 0.5B); they become its last row. That
    only changes which q the draft proposes from, never the exactness of the output."""
    width = vocab_width(model)
    return tokens if width is None else [min(t, width - 1) for t in tokens]


def prefill(model: nn.Module, cache: Cache, tokens: list[int], step: int = PREFILL_STEP) -> None:
    """Run `tokens` through `model`, filling `cache`, in chunks of `step` tokens."""
    tokens = model_inputs(model, tokens)
    for start in range(0, len(tokens), step):
        model(mx.array(tokens[start : start + step], dtype=mx.int32)[None], cache=cache)
        mx.eval([layer.state for layer in cache])
        mx.clear_cache()  # as mlx-lm: free the chunk's temporaries before the next one


def _draft_chain(
    draft: nn.Module,
    cache: Cache,
    unseen: list[int],
    k: int,
    params: SamplingParams,
    key: mx.array | None,
) -> tuple[mx.array, mx.array | None]:
    """Propose k tokens. Returns draft tokens (k,) and, when sampling, their distributions q (k, V).

    Feeds `unseen` then d_1..d_(k-1): d_k itself is never run through the draft this round.
    """
    keys = None if params.greedy else mx.random.split(key, k)
    x = mx.array(model_inputs(draft, unseen), dtype=mx.int32)
    tokens, qs = [], []
    for i in range(k):
        logits = draft(x[None], cache=cache)[0, -1]  # (Vq,)
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
) -> list[int]:
    """Score [last, d_1..d_k] in one pass; return [n, token, d_1..d_k] with one host sync.

    A draft with a wider vocabulary can propose ids beyond the target's embedding: they are
    clamped for the forward pass only (an out-of-bounds read otherwise; undefined on Metal).
    Such a proposal is never accepted (p is 0 there, and argmax p is below the width), so the
    positions after it, the only ones the clamp changes, are always discarded."""
    x = mx.concatenate([mx.array([last], dtype=mx.int32), drafts])
    width = vocab_width(target)
    if width is not None:
        x = mx.minimum(x, width - 1)
    logits = target(x[None], cache=cache)  # (1, k+1, Vp)
    if params.greedy:
        n, token = greedy_accept(mx.argmax(logits, axis=-1), drafts[None])
    else:
        p = warp(logits, params)
        q = q[None] if q is not None else mx.zeros((1, 0, p.shape[-1]), dtype=p.dtype)
        n, token = speculative_accept(p, q, drafts[None], key)
    return mx.concatenate([n, token, drafts]).tolist()


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
) -> Iterator[Token]:
    """Yield generated tokens as rounds are accepted. Arguments are assumed valid (see
    `stream_generate`). `draft` is a model, a `PromptLookup`, or None (plain decoding); `k` an int
    or "auto" (a `DraftLengthPolicy` picks it every round). Caches may be passed in holding a
    prefix of `prompt` (it is not recomputed); whenever the generator stops (length, EOS, close)
    each cache holds at most seq[:-1].

    As mlx-lm's loop: device work runs on a dedicated generation stream, and the wired-memory
    limit is raised to the device's recommended working set for the generation (Metal; a no-op
    elsewhere)."""
    lookup = draft if isinstance(draft, PromptLookup) else None
    model = None if lookup is not None else draft
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
    seed = sampling.seed if sampling.seed is not None else random.SystemRandom().getrandbits(63)
    key = mx.random.key(seed)
    policy = None
    k_cap = max_draft_length(draft, k)
    stats = GenerationStats(k=k if draft is not None else 0, prompt_tokens=len(prompt))
    seq = list(prompt)
    index = lookup.index(seq) if lookup is not None else None
    stream = generation_stream()

    with wired_limit((target, model), [stream]):
        start = time.perf_counter()
        with mx.stream(stream):
            prefill(target, target_cache, seq[cache_length(target_cache) : -1])
            target_prefill = time.perf_counter() - start
            if model is not None:
                prefill(model, draft_cache, seq[cache_length(draft_cache) : -1])
        stats.prefill_seconds = time.perf_counter() - start
        if k == AUTO and draft is not None:
            # the draft/target cost ratio seen in prefill seeds the first guess of a draft step
            draft_prefill = stats.prefill_seconds - target_prefill
            ratio = draft_prefill / target_prefill if target_prefill > 1e-3 else 0.25
            draft_key = repr(lookup) if lookup is not None else model
            policy = shared_policy(target, draft_key, min(1.0, max(0.0, ratio)))
            stats.policy = policy
        eos = frozenset(eos_token_ids)
        try:
            while stats.generated < max_tokens:
                start = time.perf_counter()
                # never draft more than can be emitted: a round emits up to k_round + 1 tokens
                limit = max_tokens - stats.generated - 1
                k_round = min(k_cap, limit) if policy is None else policy.choose(limit)
                draft_key = verify_key = None  # greedy rounds use no randomness
                if not sampling.greedy:
                    key, draft_key, verify_key = mx.random.split(key, 3)
                with mx.stream(stream):
                    drafts, q = _propose(model, draft_cache, index, seq, k_round, sampling,
                                         draft_key, vocab_width(target))
                    n, token, *proposed = _verify(
                        target, target_cache, seq[-1], drafts, q, sampling, verify_key
                    )
                # keep seq + d_1..d_n. After a fully accepted round the draft never saw d_k (nor
                # the bonus token): it stays behind and catches up at the start of the next round.
                _rollback_both(target_cache, draft_cache, len(seq) + n)
                stats.record_round(len(proposed), n)
                elapsed = time.perf_counter() - start
                stats.decode_seconds += elapsed
                stats.peak_memory = mx.get_peak_memory() / 1e9
                if policy is not None:  # the round's whole cost, the draft's catch-up included
                    policy.update(len(proposed), n, elapsed)
                for i, tok in enumerate(proposed[:n] + [token]):
                    seq.append(tok)
                    stats.generated += 1
                    yield Token(tok, i < n, stats)
                    if tok in eos:
                        stats.finish_reason = "eos"
                        return
            stats.finish_reason = "length"
        finally:
            stats.finish_reason = stats.finish_reason or "closed"
            _rollback_both(target_cache, draft_cache, len(seq) - 1)


def _propose(
    model: nn.Module | None,
    draft_cache: Cache | None,
    index: NgramIndex | None,
    seq: list[int],
    k: int,
    sampling: SamplingParams,
    key: mx.array | None,
    target_width: int | None,
) -> tuple[mx.array, mx.array | None]:
    """Up to k draft tokens (k,) and, when sampling, their distributions q (k, V): from the
    n-gram index (point masses), or from the draft model, which first catches up on what it has
    not seen (after plain rounds of k="auto": like a prefill)."""
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
    if len(unseen) > 2:
        prefill(model, draft_cache, unseen[:-1])
        unseen = unseen[-1:]
    return _draft_chain(model, draft_cache, unseen, k, sampling, key)


def encode_prompt(tokenizer, prompt: str | list[int], vocab_size: int | None = None) -> list[int]:
    """Token ids for `prompt` (a string, or ids passed through); ValueError if empty or invalid."""
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt)) if prompt else []
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ParameterError("prompt token ids", "non-negative integers", t)
            if vocab_size is not None and t >= vocab_size:
                allowed = f"below the vocabulary size {vocab_size}"
                raise ParameterError("prompt token ids", allowed, t)
    else:
        raise ParameterError("prompt", "a string or a list of token ids", type(prompt).__name__)
    if not ids:
        raise ValueError("prompt must contain at least one token (got an empty prompt)")
    return ids


def eos_ids(tokenizer) -> frozenset[int]:
    """The token ids that end generation, from an mlx-lm TokenizerWrapper or a HF tokenizer."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        single = getattr(tokenizer, "eos_token_id", None)
        ids = [] if single is None else [single]
    return frozenset(int(i) for i in ids)


def check_k(k: int | str) -> None:
    """ParameterError unless k is an int in [1, MAX_DRAFT_TOKENS] or "auto"."""
    if k == AUTO:
        return
    try:
        check_int("k", k, 1, MAX_DRAFT_TOKENS)
    except ParameterError:
        raise ParameterError("k", f'an integer in [1, {MAX_DRAFT_TOKENS}] or "auto"', k) from None


def resolve_draft(draft: nn.Module | PromptLookup | str | None) -> nn.Module | PromptLookup | None:
    """A draft argument as the decode loop takes it: "prompt-lookup" becomes a `PromptLookup`,
    "none" (as in `load_models` and the CLI) becomes None."""
    if isinstance(draft, str):
        if draft.lower() == NO_DRAFT:
            return None
        if draft.lower() != PROMPT_LOOKUP:
            allowed = f'a model, "{PROMPT_LOOKUP}", "{NO_DRAFT}" or None'
            raise ParameterError("draft", allowed, draft)
        return PromptLookup()
    return draft


def stream_generate(
    target: nn.Module,
    draft: nn.Module | PromptLookup | str | None,
    tokenizer,
    prompt: str | list[int],
    *,
    k: int | str = 4,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    max_kv_size: int | None = None,
) -> Iterator[Token]:
    """Generate from `target`, drafting with `draft` (a model; "prompt-lookup" or a `PromptLookup`
    to copy n-gram continuations from prompt + output; None or "none": plain decoding), yielding
    each `Token` as it is accepted. Generation ends after `max_tokens` tokens or an EOS token
    (which is emitted).

    Exactness: sampled output is distributed exactly as plain sampling from `target` with the
    same warp. Greedy output (temperature 0) is plain greedy decoding's, up to the float
    difference between a one-row and a (k+1)-row forward pass: the verify pass scores k+1 rows at
    once, and matmuls of different shapes round differently (fp32 logits of the demo target differ
    by up to ~3e-6; half precision by more), so only a near-tie (top-2 logit gap of that size) can
    flip.

    Sampling order: temperature -> top-k -> top-p -> min-p (transformers' and vLLM's order), and
    top-k keeps ties with the k-th logit. mlx-lm filters at temperature 1 first (top-p, min-p,
    top-k, exactly k tokens), then applies the temperature. Example: logits [2, 1, 0],
    temperature 0.5, top_p 0.7: here token 0 gets probability 1 (0.87 of the mass at T=0.5);
    mlx-lm keeps tokens 0 and 1 (0.67 of the mass at T=1 is below 0.7) and samples token 1 with
    probability 0.12.

    `max_kv_size` W bounds both caches: each token attends to the first 4 positions and the most
    recent W - 4 (as mlx-lm's rotating cache), and output equals plain decoding with the same W.
    `k` is the number of draft tokens per round (1..64), or "auto": each round the k (0..8) with
    the most expected tokens per second under measured acceptance and costs (policy.py).

    Every argument is checked before any work starts (ValueError naming the parameter)."""
    sampling = SamplingParams(temperature, top_p, top_k, min_p, seed)
    draft = resolve_draft(draft)
    if draft is not None:
        check_k(k)
    check_int("max_tokens", max_tokens, 1)
    ids = encode_prompt(tokenizer, prompt, vocab_width(target))
    k_eff = max_draft_length(draft, k)
    if max_kv_size is not None:
        check_int("max_kv_size", max_kv_size, KEEP + k_eff + 1)
    margin = k_eff + 1  # a verify writes k+1 positions and may roll back k of them
    target_cache = make_cache(target, max_kv_size, margin)
    has_cache = draft is not None and not isinstance(draft, PromptLookup)
    draft_cache = make_cache(draft, max_kv_size, margin) if has_cache else None
    return decode(
        target, draft, ids, k=k, max_tokens=max_tokens, sampling=sampling,
        eos_token_ids=eos_ids(tokenizer), target_cache=target_cache, draft_cache=draft_cache,
    )


def generate(
    target: nn.Module,
    draft: nn.Module | PromptLookup | str | None,
    tokenizer,
    prompt: str | list[int],
    *,
    k: int | str = 4,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    max_kv_size: int | None = None,
) -> tuple[list[int], GenerationStats]:
    """Like `stream_generate`, collected: returns (generated token ids, stats)."""
    steps = stream_generate(
        target, draft, tokenizer, prompt, k=k, max_tokens=max_tokens, temperature=temperature,
        top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, max_kv_size=max_kv_size,
    )
    tokens = list(steps)
    return [t.id for t in tokens], tokens[-1].stats

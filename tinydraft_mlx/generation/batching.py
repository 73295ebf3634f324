"""`batch_generate`: many prompts decoded together, speculation on, each exactly as alone.

The text layer over the engine's `BatchDecoder` (engine/rounds.py): every prompt is checked as
`generate` checks it (`options.make_options`, `api.prepare`), runs as one sequence of the batch,
and goes through the same streaming detokenizer and stop strings (`text.responses`) as a single
generation; a sequence that hits a stop string leaves the batch at once, its caches cut to the
tokens emitted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import mlx.nn as nn

from ..engine.cache import cache_length, layer_kinds
from ..engine.drafters.lookup import PromptLookup
from ..engine.forward import vocab_width
from ..engine.rounds import BatchDecoder, Token
from ..engine.sampling import ParameterError
from ..engine.stats import GenerationStats
from .api import Prepared, options_from, prepare
from .options import FIELDS
from .prompt_cache import MARGIN, PromptCache
from .text import Messages, responses

PER_PROMPT = ("max_tokens", "stop", "seed", "prompt_cache")  # may be one per prompt
# `images`: always one entry per prompt (a list of that prompt's images, or None)


def batch_generate(
    target: nn.Module,
    draft: nn.Module | PromptLookup | str | None,
    tokenizer: Any,
    prompts: Sequence[str | list[int] | Messages],
    **kwargs: Any,
) -> list[tuple[list[int], GenerationStats]]:
    """Generate for every prompt at once, in batched rounds: one `(token ids, stats)` per prompt,
    in order. Takes `generate`'s keyword arguments (k, max_tokens, temperature, top_p, top_k,
    min_p, seed, max_kv_size, logits processors and penalties, stop, prompt_cache, bitwise);
    max_tokens, stop, seed and prompt_cache may also be lists, one entry per prompt. `images`
    (a vision-language target): one entry per prompt, its list of images or None. Where the
    sequences cannot share forwards (bitwise=True, a tensor-parallel target), they run one after
    another.

    Exactness: each prompt's output is what `generate` gives it alone. Greedy: the same tokens
    (up to the float rounding of batched matmuls on a near-tie, see docs/design.md). Sampled:
    distributed exactly as plain sampling from `target`; with a seed, plain decoding's tokens with
    that seed, whichever prompts share the batch and whatever k.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ParameterError("prompts", "a non-empty list of prompts", prompts)
    if kwargs.get("prompt_progress_callback") is not None:
        raise ParameterError("prompt_progress_callback", "None in batch_generate",
                             kwargs["prompt_progress_callback"])
    options = kwargs.pop("options", None)
    kwargs.pop("prompt_progress_callback", None)
    images = kwargs.pop("images", None)
    unknown = sorted(set(kwargs) - set(FIELDS) - {"prompt_cache"})
    if unknown:
        raise TypeError(f"batch_generate() got unexpected keyword arguments {unknown}")
    width = vocab_width(target)
    if images is not None and (not isinstance(images, Sequence) or isinstance(images, str)
                               or len(images) != len(prompts)):
        raise ParameterError("images", f"a list of {len(prompts)} entries (each prompt's list "
                             "of images, or None)", type(images).__name__ if not isinstance(
                                 images, Sequence) else f"{len(images)} entries")
    plans = []
    for i, prompt in enumerate(prompts):
        settings = _settings(kwargs, i, len(prompts))
        cache = settings.pop("prompt_cache", None)
        plans.append(prepare(target, draft, tokenizer, prompt,
                             options_from(options, settings, width), prompt_cache=cache,
                             images=None if images is None else images[i]))
    caches = [p.prompt_cache for p in plans if p.prompt_cache is not None]
    if len({id(c) for c in caches}) < len(caches):
        raise ParameterError("prompt_cache", "a different PromptCache for every prompt",
                             "one cache given to several prompts")
    bounds = {p.max_kv_size for p in plans}
    if len(bounds) > 1:
        raise ParameterError("max_kv_size", "the same bound for every prompt of a batch",
                             sorted(bounds, key=str))
    bound = bounds.pop()
    bitwise = plans[0].options.bitwise  # one value for the batch (not a per-prompt option)
    max_k = max(p.k_eff for p in plans)
    if caches and (bound is not None or any(kind != "kv" for kind in layer_kinds(target) or [])):
        max_k = MARGIN - 1  # the row layout of a prompt cache's bounded and windowed layers
    decoder = BatchDecoder(target, _draft_model(plans),
                           max_kv_size=bound, max_k=max(1, max_k), bitwise=bitwise)
    with ExitStack() as held:
        for cache in caches:
            held.enter_context(cache.taken())
        if decoder.single:  # one sequence at a time (bitwise, a tensor-parallel target, ...)
            return [_run(decoder, [plan], tokenizer)[0] for plan in plans]
        return _run(decoder, plans, tokenizer)


def _draft_model(plans: list[Prepared]) -> Any:
    """The draft model the plans' sources share (None: no source has one)."""
    return next((p.drafter.model for p in plans if p.drafter.model is not None), None)


def _settings(kwargs: dict[str, Any], i: int, n: int) -> dict[str, Any]:
    """Prompt i's keyword arguments. max_tokens, seed and prompt_cache: a list gives one entry
    per prompt. stop: a string or a list of strings is every prompt's; a list of n entries that
    are lists (or None) gives each prompt its own."""
    out = dict(kwargs)
    for name in PER_PROMPT:
        value = kwargs.get(name)
        per = isinstance(value, list) and (
            name != "stop" or any(isinstance(v, (list, tuple)) or v is None for v in value))
        if per:
            if len(value) != n:
                raise ParameterError(name, f"one value or a list of {n} (one per prompt)",
                                     f"a list of {len(value)}")
            out[name] = value[i]
    return out


def _run(decoder: BatchDecoder, plans: list[Prepared],
         tokenizer: Any) -> list[tuple[list[int], GenerationStats]]:
    feeds: dict[int, deque[Token]] = {}
    texts: dict[int, Iterator] = {}
    order: list[int] = []
    for plan in plans:
        target_cache = draft_cache = None
        cache = plan.prompt_cache
        if cache is not None:
            cache.reuse(plan.cache_key, plan.reusable)
            target_cache, draft_cache = cache.target_cache, cache.draft_cache
        uid = decoder.insert(plan.ids, draft=plan.drafter, k=plan.options.k,
                             max_tokens=plan.options.max_tokens,
                             sampling=plan.sampling, eos_token_ids=plan.eos,
                             logits_processors=plan.processors, target_cache=target_cache,
                             draft_cache=draft_cache, keep_caches=cache is not None,
                             tree=plan.options.tree, prefill=plan.prefill)
        feeds[uid] = deque()
        texts[uid] = responses(drain(feeds[uid]), tokenizer, plan.options.stop, plan.eos)
        order.append(uid)
    out: dict[int, tuple[list[int], GenerationStats]] = {}
    emitted: dict[int, list[int]] = {uid: [] for uid in order}
    try:
        while len(out) < len(order):
            for uid, tokens in decoder.step().items():
                feeds[uid].extend(tokens)
                for _ in tokens:
                    response = next(texts[uid])
                    emitted[uid].append(response.token)
                    if response.finish_reason is not None:  # its end, or a stop string
                        done = decoder.remove(uid, keep=len(emitted[uid]))
                        out[uid] = (emitted[uid], response.stats)
                        _store(plans[order.index(uid)], done, emitted[uid])
                        break
    finally:
        for uid in order:  # an error: every sequence out, caches consistent
            if uid not in out:
                done = decoder.remove(uid, keep=len(emitted[uid]))
                _store(plans[order.index(uid)], done, emitted[uid])
    return [out[uid] for uid in order]


def drain(feed: deque[Token]) -> Iterator[Token]:
    """The tokens in `feed`, taken from its left until it is empty."""
    while feed:
        yield feed.popleft()


def _store(plan: Prepared, done: Any, emitted: list[int]) -> None:
    if plan.prompt_cache is not None:
        record_caches(plan.prompt_cache, done, plan.cache_key, emitted)


def record_caches(cache: PromptCache, done: Any, ids: list[Any], emitted: list[int],
                  drafter: Any = None) -> bool:
    """Make a prompt cache hold what its sequence's caches hold after leaving a batch (`done`, a
    `Finished` with caches): prompt `ids` (a prompt with images: its key) + the `emitted` tokens
    (`drafter`: the sequence's, where it may be another than the prompt cache's). False, and the
    cache left as it was, when there is nothing to record."""
    if done is None or done.target_cache is None:
        return False
    cache.target_cache = done.target_cache
    # a draft cache that did not come back (it read past a cut), or another drafter's: anew
    ours = drafter is None or cache.drafts_for(drafter)
    cache.draft_cache = done.draft_cache if done.draft_cache is not None and ours \
        else cache.new_draft_cache()
    held = cache_length(cache.target_cache)
    cache.tokens = (ids + emitted)[: held + 1]
    return True

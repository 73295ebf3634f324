"""The generation API: `stream_generate` (mlx-lm-style responses) and `generate` (token ids and
statistics), on top of the token loop (`speculative.decode`), the text layer (`text.py`) and
prompt caches (`prompt_cache.py`).

Every argument is checked before any work starts: a `ValueError` (`ParameterError`) names the
parameter, the allowed range and the value received.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from ..engine.bitwise import refusal as bitwise_refusal
from ..engine.cache import KEEP, Cache, cache_length, make_cache
from ..engine.drafters import Source, resolve_drafter
from ..engine.drafters.lookup import PromptLookup
from ..engine.forward import vocab_width
from ..engine.policy import DEFAULT_K
from ..engine.rounds import Progress, Token, max_draft_length
from ..engine.sampling import ParameterError, Processor, SamplingParams, check_int
from ..engine.speculative import decode
from ..engine.stats import GenerationStats
from ..engine.tree_verify import refusal as tree_refusal
from ..vision import VisionPrefill, has_image_parts, vision_of, vision_prompt
from .options import Options, check_vocab, make_options
from .prompt_cache import PromptCache
from .text import GenerationResponse, Messages, prompt_ids, responses


def eos_ids(tokenizer: Any) -> frozenset[int]:
    """The token ids that end generation, from an mlx-lm TokenizerWrapper or a HF tokenizer."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        single = getattr(tokenizer, "eos_token_id", None)
        ids = [] if single is None else [single]
    return frozenset(int(i) for i in ids)


def stream_generate(
    target: nn.Module,
    draft: nn.Module | PromptLookup | str | None,
    tokenizer: Any,
    prompt: str | list[int] | Messages,
    *,
    k: int | str = DEFAULT_K,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    max_kv_size: int | None = None,
    logits_processors: Sequence[Processor] | None = None,
    repetition_penalty: float | None = None,
    repetition_context_size: int = 20,
    presence_penalty: float | None = None,
    presence_context_size: int = 20,
    frequency_penalty: float | None = None,
    frequency_context_size: int = 20,
    logit_bias: dict[int, float] | None = None,
    stop: str | Sequence[str] | None = None,
    prompt_cache: PromptCache | None = None,
    prompt_progress_callback: Progress | None = None,
    chat_template: str | None = None,
    bitwise: bool = False,
    tree: int | None = None,
    images: Sequence[Any] | None = None,
    options: Options | None = None,
) -> Iterator[GenerationResponse]:
    """Generate from `target`, drafting with `draft`, yielding a `GenerationResponse` per token as
    rounds are accepted (mlx-lm's fields: text, token, logprobs, from_draft, finish_reason,
    prompt_tokens, prompt_tps, generation_tokens, generation_tps, peak_memory; plus stats).

    draft: a model; "prompt-lookup" or a `PromptLookup` to copy n-gram continuations from prompt
    + output; None or "none": plain decoding. prompt: a string, token ids, or chat messages
    ([{"role", "content"}, ...], through the tokenizer's chat template with the generation
    prompt; `chat_template`, a Jinja template, instead of the tokenizer's). Generation ends
    after `max_tokens` tokens, at an EOS token or at the first of the `stop` strings
    (finish_reason "stop"; the text never contains the stop string nor anything after it, and
    the caches keep exactly prompt + the tokens emitted).

    Exactness: sampled output is distributed exactly as plain sampling from `target` with the
    same processors and warp. Greedy output (temperature 0) is plain greedy decoding's, up to the
    float difference between a one-row and a (k+1)-row forward pass: the verify pass scores k+1
    rows at once, and matmuls of different shapes round differently (fp32 logits of the demo
    target differ by up to ~6e-6), so only a near-tie (top-2 logit gap of that size) can flip.
    bitwise=True removes that difference: every target forward carries the same number of
    positions (9) and one key buffer, so greedy output is plain greedy decoding's (also with
    bitwise=True) bit for bit, on any device; k at most 8; one sequence per forward; for
    targets whose decode step runs compiled (Qwen2/Qwen3/Llama/Mistral) with unbounded caches.

    Sampling order: logits processors -> temperature -> top-k -> top-p -> min-p (transformers'
    and vLLM's order), and top-k keeps ties with the k-th logit. mlx-lm filters at temperature 1
    first (top-p, min-p, top-k, exactly k tokens), then applies the temperature. Example: logits
    [2, 1, 0], temperature 0.5, top_p 0.7: here token 0 gets probability 1 (0.87 of the mass at
    T=0.5); mlx-lm keeps tokens 0 and 1 (0.67 of the mass at T=1 is below 0.7) and samples token
    1 with probability 0.12.

    Logits processors: `logits_processors` (mlx-lm's protocol, f(tokens, logits) -> logits) and
    mlx-lm's `make_logits_processors` for repetition_penalty (with repetition_context_size),
    presence_penalty, frequency_penalty (with their context sizes) and logit_bias. Each verified
    position sees its own history (prompt + emitted + the drafts before it); the draft applies
    the same processors to its own logits.

    prompt_cache: a `PromptCache` for these models. The longest common prefix of its tokens and
    the prompt is reused (`stats.cached_tokens`), only the rest is prefilled, and afterwards it
    holds prompt + output. It sets the KV bound (`max_kv_size` must then be None or equal).
    max_kv_size W: both caches keep the first 4 positions and the most recent W - 4 (as mlx-lm's
    rotating cache); output equals plain decoding with the same W.
    k: draft tokens per round (1..64), or "auto": each round the k (0..8) with the most expected
    tokens per second under measured acceptance and costs (policy.py).
    prompt_progress_callback(processed, total): during the prefill of the uncached prompt tokens.
    options: an `Options` from `make_options` instead of the keyword arguments it holds (k,
    max_tokens, sampling, stop, penalties, logit_bias, logits_processors, max_kv_size,
    chat_template, bitwise, tree); giving both is refused.
    tree: verify a tree of at most this many candidate tokens (1..64) a round instead of a chain
    of k (engine/trees.py: the drafter's most probable continuations, DDTree's best-first
    expansion for a block drafter; k is the tree's depth limit; with k="auto" each round takes
    the tree, the drafter's reach deep, or the k="auto" chain, whichever has recently paid more).
    Exact as chains are; attention targets (no recurrent layers), no logits processors.
    images: for a vision-language target (`load_models` attaches the checkpoint's vision tower
    where mlx-vlm is installed: `pip install 'tinydraft-mlx[vision]'`): paths, encoded bytes,
    PIL images or (H, W, 3) uint8 arrays, one per {"type": "image"} part of the chat messages
    (or per image token, `<|image_pad|>` for Qwen, in a string prompt). mlx-vlm prefills the
    prompt; the engine decodes with any drafter (`tinydraft_mlx.vision`).
    """
    given = dict(k=k, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                 min_p=min_p, seed=seed, max_kv_size=max_kv_size,
                 logits_processors=logits_processors, repetition_penalty=repetition_penalty,
                 repetition_context_size=repetition_context_size,
                 presence_penalty=presence_penalty, presence_context_size=presence_context_size,
                 frequency_penalty=frequency_penalty,
                 frequency_context_size=frequency_context_size, logit_bias=logit_bias,
                 stop=stop, chat_template=chat_template, bitwise=bitwise, tree=tree)
    options = options_from(options, given, vocab_width(target))
    plan = prepare(target, draft, tokenizer, prompt, options, prompt_cache=prompt_cache,
                   prompt_progress_callback=prompt_progress_callback, images=images)
    return run_prepared(target, plan, tokenizer)


def run_prepared(target: nn.Module, plan: Prepared, tokenizer: Any) -> Iterator[GenerationResponse]:
    """The responses of a prepared generation (`prepare`) on its own caches, or on its prompt
    cache's."""
    prompt_cache = plan.prompt_cache
    if prompt_cache is not None:
        caches = None
    else:
        margin = plan.k_eff + 1  # a verify writes k+1 positions and may roll back k of them
        caches = (make_cache(target, plan.max_kv_size, margin),
                  plan.drafter.row_cache(None, plan.max_kv_size, margin))

    def steps(target_cache: Cache, draft_cache: Cache | None) -> Iterator[Token]:
        return decode(
            target, plan.drafter, plan.ids, k=plan.options.k, max_tokens=plan.options.max_tokens,
            sampling=plan.sampling, eos_token_ids=plan.eos, target_cache=target_cache,
            draft_cache=draft_cache, logits_processors=plan.processors,
            prompt_progress_callback=plan.progress, bitwise=plan.options.bitwise,
            max_kv_size=plan.max_kv_size, tree=plan.options.tree, prefill=plan.prefill,
        )

    return _stream(steps, caches, tokenizer, plan, prompt_cache)


def options_from(options: Options | None, given: dict[str, Any],
                 vocab_size: int | None) -> Options:
    """`options` when given (then every field in `given` must be at its default), else the
    Options of `given`'s keyword arguments, checked."""
    if options is None:
        return make_options(vocab_size=vocab_size, **given)
    if not isinstance(options, Options):
        raise ParameterError("options", "an Options (make_options)", type(options).__name__)
    default = Options()
    clash = sorted(name for name, value in given.items()
                   if value is not None and value != getattr(default, name)
                   and not (name in ("stop", "logits_processors") and not value))
    if clash:
        raise ParameterError("options", "given alone, not with the arguments it holds",
                             f"also {clash}")
    if vocab_size is not None:
        check_vocab(options, vocab_size)
    return options


@dataclass
class Prepared:
    """One generation, checked against its models: what the loop (one sequence or a batch)
    runs."""

    ids: list[int]
    drafter: Source
    options: Options
    k_eff: int  # the most tokens a round may draft (a tree: its nodes)
    sampling: SamplingParams
    processors: list[Processor]
    eos: frozenset[int]
    max_kv_size: int | None
    prompt_cache: PromptCache | None
    progress: Progress | None = None
    prefill: VisionPrefill | None = None  # a prompt with images: mlx-vlm prefills it

    @property
    def cache_key(self) -> list[Any]:
        """The prompt as a prompt cache matches it: its ids, image positions named by image."""
        return self.ids if self.prefill is None else self.prefill.prompt.keys

    def reusable(self, common: int) -> int:
        """How much of a cached common prefix this prompt's prefill may start after."""
        return common if self.prefill is None else self.prefill.prompt.reusable(common)


def prepare(target: nn.Module, draft: Any, tokenizer: Any, prompt: Any, options: Options, *,
            prompt_cache: PromptCache | None = None,
            prompt_progress_callback: Progress | None = None,
            model: nn.Module | None = None, images: Sequence[Any] | None = None,
            own: VisionPrefill | None = None) -> Prepared:
    """Check what depends on the models (the drafter, the prompt, the logit bias's token ids, a
    prompt cache, the KV bound against a round's length) for a generation of checked `options`;
    ParameterError / PromptCacheError naming the parameter, the allowed range and the value
    received. `model`: the draft model that the names "model" and "hybrid" mean (a server's).
    `images`: the prompt's (`stream_generate`); `own`: a prompt with images already made
    (`vision_prefill`), whose ids are the prompt. `stream_generate`, `batch_generate` and the
    server all go through it."""
    drafter = resolve_drafter(draft, model, target)
    width = vocab_width(target)
    check_vocab(options, width)
    if prompt_progress_callback is not None and not callable(prompt_progress_callback):
        raise ParameterError("prompt_progress_callback", "a callable f(processed, total)",
                             prompt_progress_callback)
    if own is None:
        own = vision_prefill(target, prompt, images or [], options.chat_template)
    ids = prompt_ids(tokenizer, prompt, width, options.chat_template) if own is None \
        else own.prompt.ids
    k = options.k
    k_eff = max(max_draft_length(drafter, k), options.tree or 0)  # a tree's nodes roll back too
    max_kv_size = options.max_kv_size
    if prompt_cache is not None:
        if not isinstance(prompt_cache, PromptCache):
            raise ParameterError("prompt_cache", "a PromptCache", type(prompt_cache).__name__)
        if max_kv_size not in (None, prompt_cache.max_kv_size):
            raise ParameterError("max_kv_size", f"None or the prompt cache's "
                                 f"{prompt_cache.max_kv_size}", max_kv_size)
        max_kv_size = prompt_cache.max_kv_size
    if max_kv_size is not None:
        need = KEEP + k_eff + 1  # the kept sink positions beside a round's k + 1
        try:
            check_int("max_kv_size", max_kv_size, need)
        except ParameterError:
            what = f"tree={options.tree}" if options.tree else f"k={k!r}"
            why = f" (a round of {what} writes {k_eff + 1} positions beside the {KEEP} kept; " \
                  "a smaller window needs a smaller k)" if k_eff else ""
            raise ParameterError("max_kv_size", f"an integer >= {need}{why}",
                                 max_kv_size) from None
    if options.bitwise and (why := bitwise_refusal(target, max_kv_size)) is not None:
        raise ParameterError("bitwise", why, True)
    check_tree(target, drafter, options, max_kv_size)
    if prompt_cache is not None:
        prompt_cache.check_models(target, drafter.model)
        prompt_cache.check_free()
    return Prepared(ids, drafter, options, k_eff, options.sampling, options.processors(),
                    eos_ids(tokenizer), max_kv_size, prompt_cache, prompt_progress_callback,
                    own)


def vision_prefill(target: nn.Module, prompt: Any, images: Sequence[Any],
                   chat_template: str | None = None) -> VisionPrefill | None:
    """The prefill of `prompt` with `images` for `target` (None where neither the images nor
    the prompt's message parts hold one); ParameterError / VisionError (one sentence) where the
    target cannot see them or they do not fit the prompt."""
    if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
        raise ParameterError("images", "a list of images (paths, encoded bytes, PIL images or "
                             "(H, W, 3) arrays)", type(images).__name__)
    if not images and not has_image_parts(prompt):
        return None
    vision = vision_of(target)
    if vision is None:
        raise ParameterError("images", "given to a vision-language target only (load_models "
                             "attaches a checkpoint's vision tower where mlx-vlm is installed: "
                             "pip install 'tinydraft-mlx[vision]')",
                             f"{len(images)} images" if images else "image parts")
    own = VisionPrefill(vision, vision_prompt(vision, prompt, list(images), chat_template))
    prompt_ids(None, own.prompt.ids, vocab_width(target))  # the token-id prompt's checks
    return own


def check_tree(target: nn.Module, drafter: Source, options: Options,
               max_kv_size: int | None) -> None:
    """ParameterError where `options.tree` is set and this generation cannot verify trees (no
    drafter, logits processors, bitwise, recurrent layers or layers of a kind a batch does not
    hold in the target or the draft model, a tensor-parallel target)."""
    if options.tree is None:
        return
    why = tree_refusal(target, drafter, options.processors(), options.bitwise)
    if why is None and max_kv_size is not None and KEEP + options.tree + 1 > max_kv_size:
        why = (f"at most {max_kv_size - KEEP - 1} with max_kv_size {max_kv_size} (a round of "
               f"tree=N writes N + 1 positions beside the {KEEP} kept)")
    if why is not None:
        raise ParameterError("tree", why, options.tree)


def _stream(steps, caches, tokenizer, plan: Prepared,
            prompt_cache) -> Iterator[GenerationResponse]:
    """The responses. A prompt cache is taken when the generation starts (one live generation
    per cache: a second is refused) and reused then; whatever ends the generation (its end, a
    stop string, close, an error, in the prefill too), the loop is closed (its caches rolled
    back), the prompt cache records what its caches hold, and is free again."""
    stops, eos, key = plan.options.stop, plan.eos, plan.cache_key
    if prompt_cache is not None:
        with prompt_cache.taken():
            prompt_cache.reuse(key, plan.reusable)
            yield from _responses(steps(prompt_cache.target_cache, prompt_cache.draft_cache),
                                  tokenizer, stops, eos, prompt_cache, key)
    else:
        yield from _responses(steps(*caches), tokenizer, stops, eos, None, key)


def _responses(steps, tokenizer, stops, eos, prompt_cache, key) -> Iterator[GenerationResponse]:
    emitted: list[int] = []
    try:
        for response in responses(steps, tokenizer, stops, eos):
            emitted.append(response.token)
            yield response
    finally:
        steps.close()
        if prompt_cache is not None:  # the target holds all of tokens but the last
            held = cache_length(prompt_cache.target_cache)
            prompt_cache.tokens = (key + emitted)[: held + 1]


def generate(
    target: nn.Module,
    draft: nn.Module | PromptLookup | str | None,
    tokenizer: Any,
    prompt: str | list[int] | Messages,
    **kwargs: Any,
) -> tuple[list[int], GenerationStats]:
    """Like `stream_generate` (same arguments), collected: returns (generated token ids, stats).
    With stop strings the ids include the token in which the stop string completed."""
    out = list(stream_generate(target, draft, tokenizer, prompt, **kwargs))
    return [r.token for r in out], out[-1].stats

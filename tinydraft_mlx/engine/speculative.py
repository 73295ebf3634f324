"""One sequence: `decode`, the engine's batch of one (`rounds.BatchDecoder` holding a single row
on that sequence's own caches), as a generator of tokens. Plain decoding is the same loop with
no draft (every round k = 0, pipelined as mlx-lm's `generate_step`).

Knows nothing about text: token ids in, token ids out. The public API with text is in `api.py`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence

import mlx.nn as nn
from mlx_lm.generate import wired_limit

from .cache import Cache
from .drafters import resolve_drafter
from .forward import PREFILL_STEP, prefill, vocab_width
from .policy import DEFAULT_K
from .rounds import BatchDecoder, Progress, Token, max_draft_length
from .sampling import Processor, SamplingParams
from .sequence import OwnPrefill

__all__ = ["PREFILL_STEP", "Processor", "Progress", "Token", "decode", "max_draft_length",
           "prefill", "vocab_width"]


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
    bitwise: bool = False,
    max_kv_size: int | None = None,
    tree: int | None = None,
    prefill: OwnPrefill | None = None,
) -> Iterator[Token]:
    """Yield generated tokens as rounds are accepted. Arguments are assumed valid (see
    `api.stream_generate`). `draft` is anything `drafters.resolve_drafter` takes (a model, a
    `PromptLookup`, a `Hybrid`, None for plain decoding); `k` an int or "auto" (`policy.py`
    picks it every round). Caches may be passed in holding a prefix of `prompt` (it is not
    recomputed); whenever the generator stops (length, EOS, close, an error, in the prefill too)
    each cache holds at most seq[:-1]. `prompt_progress_callback(processed, total)` follows the
    target's prefill of the prompt tokens not already cached. `bitwise`: every target forward
    carries the same number of positions (`bitwise.py`): greedy output is plain greedy
    decoding's bit for bit. `max_kv_size`: the bound of caches the decoder makes itself (a
    head's, where none is passed), as `make_cache` bounds one. `tree`: verify candidate
    trees of at most this many nodes (trees.py) instead of chains. `prefill`: the prompt's own
    prefill (a prompt with images: `tinydraft_mlx.vision`).

    As mlx-lm's loop: device work runs on a dedicated generation stream, and the wired-memory
    limit is raised to the device's recommended working set for the generation (Metal; a no-op
    elsewhere)."""
    source = resolve_drafter(draft, target=target)
    reach = max(1, max_draft_length(source, k), tree or 0)  # a tree's nodes roll back too
    decoder = BatchDecoder(target, source.model, max_k=reach,
                           single=True, bitwise=bitwise, max_kv_size=max_kv_size)
    uid = decoder.insert(prompt, draft=source, k=k, max_tokens=max_tokens, sampling=sampling,
                         eos_token_ids=eos_token_ids, logits_processors=logits_processors,
                         target_cache=target_cache, draft_cache=draft_cache, logprobs=True,
                         keep_caches=True, tree=tree, prefill=prefill)
    with wired_limit((target, source.model), [decoder.stream]):
        seq: list[int] = []
        try:  # from the prefill on: however it ends, `finally` leaves the caches consistent
            decoder.admit(None, prompt_progress_callback)
            while True:
                for token in decoder.step().get(uid, []):
                    seq.append(token.id)
                    yield token
                    if token.finish_reason is not None:
                        return
        finally:
            decoder.remove(uid, keep=len(seq))  # what was yielded (a round may emit more)
            if decoder.ranks is not None and sys.exc_info()[0] in (None, GeneratorExit):
                decoder.ranks.check_same(seq)  # the ranks must have generated the same

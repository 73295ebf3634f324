"""The text layer above the token loop: prompts (text, token ids or chat messages), streamed text
through mlx-lm's streaming detokenizer, stop strings, and the `GenerationResponse` each token
yields.

The decode loop (`speculative.py`) knows nothing about text; this module knows nothing about
drafting. A stop string may span tokens and rounds: text is streamed except for the shortest
tail that could still begin a stop string, and at a match everything from the stop string on is
dropped and the loop is closed, so its caches keep exactly prompt + the tokens emitted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..engine.rounds import Token
from ..engine.sampling import ParameterError
from ..engine.stats import GenerationStats
from .tokens import has_text, vocabulary_size

Messages = Sequence[dict[str, Any]]


@dataclass
class GenerationResponse:
    """One generated token, with mlx-lm's field names where the meaning is the same.

    text: the newly decoded text segment (may be empty: a partial character, or a tail held back
    because it could begin a stop string). token: the token id. logprobs: the target's
    log-probabilities at this position, (vocab,), after logits processors and before the
    temperature and truncation (mlx-lm's definition). from_draft: an accepted draft proposal.
    finish_reason: None while running, then "stop" (EOS or a stop string) or "length".
    stop_string: the stop string that ended generation (None otherwise).
    prompt_tokens / prompt_tps: prompt size and prefill speed (tokens reused from a prompt cache
    are counted in prompt_tokens but not prefilled). generation_tokens / generation_tps: tokens so
    far and their rate. peak_memory: GB. stats: the live `GenerationStats`.
    """

    text: str
    token: int
    logprobs: mx.array | None
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None
    stats: GenerationStats
    stop_string: str | None = None


def check_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """The stop strings as a tuple; ParameterError unless a string or a list of non-empty
    strings."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    allowed = "a non-empty string or a list of non-empty strings"
    if not isinstance(items, (list, tuple)):
        raise ParameterError("stop", allowed, stop)
    for item in items:
        if not isinstance(item, str) or not item:
            raise ParameterError("stop", allowed, item)
    return tuple(items)


class StopStrings:
    """Cuts streamed text at the first stop string. `feed(segment)` returns (text to emit now,
    stopped); text that could still begin a stop string is held back until it cannot."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.matched: str | None = None  # the stop string found

    def _held(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def feed(self, segment: str) -> tuple[str, bool]:
        self.pending += segment
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            text, self.pending = self.pending[:at], ""
            return text, True
        keep = self._held()
        cut = len(self.pending) - keep
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, False

    def flush(self) -> str:
        """What is held back, at the end of generation (no stop string can complete now)."""
        text, self.pending = self.pending, ""
        return text


def prompt_ids(tokenizer: Any, prompt: str | Sequence[int] | Messages,
               vocab_size: int | None = None, chat_template: str | None = None) -> list[int]:
    """Token ids for `prompt`: a string (encoded), token ids (checked), or chat messages
    ([{"role": ..., "content": ...}, ...], through `chat_template` or else the tokenizer's chat
    template, with the generation prompt). ParameterError for anything else, an empty prompt,
    or a chat template given with a prompt that is not messages."""
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template):
        raise ParameterError("chat_template", "a non-empty Jinja template string",
                             chat_template)
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt)) if prompt else []
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict)
                                                              for m in prompt):
        ids = chat_ids(tokenizer, prompt, chat_template)
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ParameterError("prompt token ids", "non-negative integers", t)
            if vocab_size is not None and t >= vocab_size:
                raise ParameterError("prompt token ids", f"below the vocabulary size "
                                     f"{vocab_size}", t)
    else:
        allowed = "a string, a list of token ids or a list of chat messages"
        raise ParameterError("prompt", allowed, type(prompt).__name__)
    if not ids:
        raise ParameterError("prompt", "at least one token", prompt)
    if chat_template is not None and not (isinstance(prompt, (list, tuple)) and prompt
                                          and all(isinstance(m, dict) for m in prompt)):
        raise ParameterError("chat_template", "given only with chat messages as the prompt",
                             type(prompt).__name__)
    return ids


def chat_text(tokenizer: Any, messages: Messages, chat_template: str | None = None,
              tools: Sequence[dict[str, Any]] | None = None) -> str:
    """`chat_template` (else the tokenizer's) applied to `messages`, with the generation
    prompt; `tools` (function specs, OpenAI's shape) are rendered as the template does."""
    for m in messages:
        content = m.get("content")
        parts = isinstance(content, list) and all(
            isinstance(p, dict) and isinstance(p.get("type"), str) for p in content)
        if not isinstance(m.get("role"), str) or not (isinstance(content, str) or parts):
            raise ParameterError("messages", 'dicts with string "role" and "content" (a string, '
                                 'or a list of {"type": ...} parts)', m)
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat messages need a chat template; this tokenizer has none (pass "
                         "chat_template=, or --chat-template on the command line)")
    extra: dict[str, Any] = {} if chat_template is None else {"chat_template": chat_template}
    if tools:
        extra["tools"] = list(tools)
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                         tokenize=False, **extra)


def read_template(value: str) -> str:
    """A chat template given on a command line: the text of the file it names, else itself."""
    from pathlib import Path

    path = Path(value)
    return path.read_text() if path.is_file() else value


def chat_ids(tokenizer: Any, messages: Messages, chat_template: str | None = None) -> list[int]:
    """Apply the chat template (with the generation prompt) and encode."""
    text = chat_text(tokenizer, messages, chat_template)
    return list(tokenizer.encode(text, add_special_tokens=False))


def responses(
    steps: Iterator[Token],
    tokenizer: Any,
    stops: Sequence[str],
    eos_ids: frozenset[int],
) -> Iterator[GenerationResponse]:
    """Turn the loop's tokens into responses: detokenize, cut at stop strings, time.

    At a stop string the loop is closed at once: tokens accepted in the same round after the
    stopping one are never emitted, and the caches keep prompt + the emitted tokens.
    """
    detok = tokenizer.detokenizer
    stop = StopStrings(stops)
    n, ids, started = 0, [], False
    size = vocabulary_size(tokenizer)
    try:
        for token in steps:
            n += 1
            stats = token.stats
            if token.id not in eos_ids and has_text(tokenizer, token.id, size):
                detok.add_token(token.id)
                ids.append(token.id)
            finish = {"eos": "stop", "length": "length"}.get(token.finish_reason)
            if finish is not None:
                detok.finalize()
            segment = detok.last_segment
            if segment and not started:
                started = True
                segment = _leading_space(tokenizer, ids, segment)
            text, stopped = stop.feed(segment)
            if stopped:
                finish = stats.finish_reason = "stop"
            elif finish is not None:
                text += stop.flush()
            yield _response(token, text, n, finish, stop.matched)
            if finish is not None:
                return
    finally:
        steps.close()


def _leading_space(tokenizer: Any, ids: list[int], segment: str) -> str:
    """The first text segment with the leading space the tokenizer's `decode` gives it: mlx-lm's
    BPE streaming detokenizer drops the first token's leading space (as SentencePiece decoding
    does), so a completion of "if x ==" would lose the space before its first word, and prompt +
    text would not be the decoded sequence. It drops one space even from a segment that starts
    with spaces (a first token that is an indent), so the test is `decode` against the segment,
    never whether the segment starts with a space. Checked once per generation."""
    decoded = tokenizer.decode(ids)
    return " " + segment if decoded.startswith(" " + segment) else segment


def _response(token: Token, text: str, n: int, finish: str | None,
              stop_string: str | None) -> GenerationResponse:
    stats = token.stats
    prefilled = stats.prompt_tokens - stats.cached_tokens
    return GenerationResponse(
        text=text,
        token=token.id,
        logprobs=token.logprobs,
        from_draft=token.from_draft,
        prompt_tokens=stats.prompt_tokens,
        prompt_tps=prefilled / stats.prefill_seconds if stats.prefill_seconds > 0 else 0.0,
        generation_tokens=n,
        generation_tps=stats.tokens_per_second,
        peak_memory=stats.peak_memory,
        finish_reason=finish,
        stats=stats,
        stop_string=stop_string,
    )

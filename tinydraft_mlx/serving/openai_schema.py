"""OpenAI's wire format, as the server speaks it: pydantic request models, the error body, and the
JSON of responses, stream chunks, tool calls and usage.

Knows nothing about models or HTTP. Extensions beyond OpenAI's fields (documented in docs/guide.md):
requests take `num_draft_tokens` (int or "auto"), `draft` ("model", "prompt-lookup", "hybrid",
"none"), `tree` (a candidate tree's node budget), `top_k`, `min_p` and `repetition_penalty`;
`usage.speculative` reports acceptance; every choice (streamed or not) carries
`tinydraft: {"token_ids": [...], "from_draft": [...]}`, which of its tokens were accepted draft
proposals.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..engine.stats import GenerationStats
from ..generation.tokens import has_text, token_bytes
from .tool_calls import ToolCall
from .worker import Piece

# -- requests ------------------------------------------------------------------------------------


# Strict types, as OpenAI's API: `max_tokens: "3"`, `2.0` or `true`, `temperature: "0.7"`,
# `stream: "yes"`, `prompt: [true, false]` are errors, not converted; an integer is a number.
_STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by both endpoints; None means the server's default. Unknown fields are
    ignored (clients send many), but fields whose meaning we cannot honour are rejected."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    num_draft_tokens: int | str | None = None
    draft: str | None = None
    tree: int | None = None
    user: str | None = None


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ImageURL(BaseModel):
    model_config = _STRICT
    url: str
    detail: str | None = None


class ContentPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # a JSON object, as text


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant message."""

    model_config = _STRICT
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionSpec(BaseModel):
    model_config = _STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    model_config = _STRICT
    type: str
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: str
    function: NamedFunction


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


# -- errors --------------------------------------------------------------------------------------


def error_body(message: str, *, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# -- responses -----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(stats: GenerationStats | None, prompt_tokens: int, completion_tokens: int,
          draft: str) -> dict[str, Any]:
    """OpenAI's usage with `prompt_tokens_details.cached_tokens` and our `speculative` block:
    what was drafted and accepted, per position, the rounds by k, the decode speed, and
    k="auto"'s catch-ups of the draft after plain rounds (their time where it was measured
    alone: 0.0 in a batch)."""
    cached = stats.cached_tokens if stats is not None else 0
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if stats is not None:
        out["speculative"] = {
            "draft": draft,
            "k": stats.k,
            "tree": stats.tree,
            "rounds": stats.rounds,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance_rate": stats.acceptance_rate,
            "per_position_acceptance": stats.per_position_acceptance,
            "mean_accepted_length": stats.mean_accepted_length,
            "k_histogram": {str(k): n for k, n in sorted(stats.k_histogram.items())},
            "prefill_seconds": stats.prefill_seconds,
            "decode_seconds": stats.decode_seconds,
            "decode_tokens_per_second": stats.tokens_per_second,
            "catch_ups": stats.catch_ups,
            "catch_up_seconds": stats.catch_up_seconds,
        }
    return out


def token_text(tokenizer: Any, token: int) -> str:
    """A token's text alone ("" for an id beyond the tokenizer's vocabulary)."""
    return tokenizer.decode([token]) if has_text(tokenizer, token) else ""


def completion_logprobs(tokenizer: Any, pieces: list[Piece], offset: int) -> dict[str, Any]:
    """The legacy completions `logprobs` object; `offset`: text length before these pieces."""
    tokens, values, tops, offsets = [], [], [], []
    for piece in pieces:
        tokens.append(token_text(tokenizer, piece.token))
        values.append(piece.logprob)
        tops.append(None if piece.top_logprobs is None else
                    {token_text(tokenizer, t): lp for t, lp in piece.top_logprobs})
        offsets.append(offset)
        offset += len(piece.text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def _entry(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    return {"token": token_text(tokenizer, token), "logprob": logprob,
            "bytes": token_bytes(tokenizer, token)}


def chat_logprobs(tokenizer: Any, pieces: list[Piece]) -> dict[str, Any]:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for piece in pieces:
        entry = _entry(tokenizer, piece.token, piece.logprob)
        entry["top_logprobs"] = [_entry(tokenizer, t, lp) for t, lp in piece.top_logprobs or []]
        content.append(entry)
    return {"content": content}


def draft_marks(pieces: list[Piece]) -> dict[str, list]:
    """The `tinydraft` extension of a choice: its token ids and which came from the draft."""
    return {"token_ids": [p.token for p in pieces], "from_draft": [p.from_draft for p in pieces]}


def tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A parsed call as OpenAI's `tool_calls` entry (`index` in stream deltas)."""
    out: dict[str, Any] = {"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments_json}}
    if index is not None:
        out = {"index": index, **out}
    return out

"""Anthropic's Messages API wire format, as the server speaks it: pydantic request models, the
error body, and the JSON of messages, content blocks, stream events and usage.

Knows nothing about models or HTTP. Extensions beyond Anthropic's fields (as on the OpenAI
side): requests take `num_draft_tokens`, `draft`, `tree`, `seed`, `min_p`; a message carries
`tinydraft: {"token_ids", "from_draft", "speculative"}`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from .tool_calls import ToolCall

_STRICT = ConfigDict(extra="ignore", strict=True)

# OpenAI's error kinds (what the service raises) as Anthropic's error types, and by status
_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
          429: "rate_limit_error", 503: "overloaded_error"}


class Block(BaseModel):
    """A content block of any type; which fields a type needs is checked when it is read."""

    model_config = _STRICT
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None  # a tool_use block's: an object (checked where read, naming the field)
    source: Any = None  # an image block's: {"type": "base64", "media_type", "data"}
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[Block]


class Tool(BaseModel):
    model_config = _STRICT
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # custom tools only; server tools (web search, ...) are refused


class ToolChoice(BaseModel):
    model_config = _STRICT
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens."""

    model_config = _STRICT
    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # ours
    seed: int | None = None
    min_p: float | None = None
    num_draft_tokens: int | str | None = None
    tree: int | None = None
    draft: str | None = None


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for an HTTP status."""
    kind = _KINDS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def new_id(prefix: str = "msg") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt's tokens not read from the cache."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def tool_use_block(call: ToolCall, with_input: bool = True) -> dict[str, Any]:
    """A parsed call as a `tool_use` block (streamed: its input comes in a delta)."""
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1), "name": call.name,
            "input": call.arguments if with_input else {}}


def event(kind: str, **fields: Any) -> tuple[str, str]:
    """(event name, data) of one stream event."""
    return kind, json.dumps({"type": kind, **fields})

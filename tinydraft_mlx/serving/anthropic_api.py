"""Anthropic's Messages API on the service: POST /v1/messages (stream and not) and POST
/v1/messages/count_tokens; the same engine, exactness and prompt-cache pool as the OpenAI routes.

A request (anthropic_schema.py) becomes a `Spec`: the system prompt and the messages as the chat
template takes them (`tool_use` blocks as the assistant's tool calls, `tool_result` blocks as tool
messages), the tools in the template's shape, `tool_choice` (auto, any, tool, none), a final
assistant message as the reply's prefill. The reply is content blocks (text, and `tool_use`
parsed from the model's text), `stop_reason` (end_turn, max_tokens, stop_sequence, tool_use) and
usage with cache reads; streamed as Anthropic's event sequence.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import format_sse_event

from . import anthropic_schema as an
from . import openai_schema as oa
from .anthropic_schema import CountTokensRequest, MessagesRequest
from .images import anthropic_source
from .reply import Reply
from .service import (
    APIError,
    ClientGone,
    Done,
    Failed,
    Generation,
    Piece,
    Plan,
    Service,
    Spec,
    bad,
    check_unicode,
    failure,
)
from .tool_calls import ToolCall

PATHS = ("/v1/messages",)  # requests under these get Anthropic's error body
FIELDS = {"stop": "stop_sequences", "tools": "tools", "tool_choice": "tool_choice"}
CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def error_response(err: APIError) -> JSONResponse:
    """An APIError in Anthropic's error body (the field it is about named in the message)."""
    message = err.message
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    return JSONResponse(an.error_body(err.status, message), status_code=err.status,
                        headers=err.headers)


def register(app: FastAPI, service: Service) -> None:
    """Add the Messages API's routes to `app`."""

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        plan = await service.plan_off_loop(message_spec(body))
        return await respond(service, request, plan)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        spec = message_spec(body)

        def count(spec: Spec) -> int:
            service.check_model(spec)
            tools, _, forced = service.tools_for(spec)
            return len(service.chat_prompt(spec, tools, spec.prefill + forced))

        return {"input_tokens": await service.plan_off_loop(spec, count)}


# -- requests ------------------------------------------------------------------------------------


MAX_TEMPERATURE = 1.0


def message_spec(req: CountTokensRequest) -> Spec:
    """A Messages request as a Spec (400 for what this server cannot honour)."""
    check_unicode(req.model_dump(exclude_none=True))
    messages, images = _system(req.system), []
    for i, m in enumerate(req.messages):
        messages.extend(_message(i, m, images))
    prefill = ""
    if messages and messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]:
        prefill = messages.pop()["content"]  # the reply continues it
    tools = [_tool(i, t) for i, t in enumerate(req.tools or [])] or None
    fields: dict[str, Any] = dict(model=req.model, messages=messages, tools=tools,
                                  tool_choice=_tool_choice(req.tool_choice), prefill=prefill,
                                  fields=FIELDS, images=images)
    if isinstance(req, MessagesRequest):
        if req.thinking and req.thinking.get("type") not in (None, "disabled"):
            raise bad("thinking", "extended thinking is not supported")
        t = req.temperature
        if t is not None and not 0 <= t <= MAX_TEMPERATURE:  # Anthropic's range
            raise bad("temperature", f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] "
                      f"(got {t!r})")
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences,
                      temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                      seed=req.seed, min_p=req.min_p, num_draft_tokens=req.num_draft_tokens,
                      tree=req.tree, draft=req.draft, stream=req.stream)
    return Spec(**fields)


def _system(system: str | list[an.Block] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    return [{"role": "system", "content": _texts(system, "system")}]


def _texts(blocks: list[an.Block], where: str) -> str:
    for j, block in enumerate(blocks):
        if block.type != "text":
            raise bad(f"{where}[{j}].type", f"only text blocks are supported here (got "
                      f"{block.type!r})")
    return "".join(b.text or "" for b in blocks)


def _message(i: int, m: an.Message, images: list[bytes]) -> list[dict[str, Any]]:
    """One Anthropic message as the template's messages: tool results first (tool messages),
    then the text (and an assistant's tool calls); a user message's image blocks appended to
    `images`, each an {"type": "image"} part where it stood."""
    where = f"messages[{i}]"
    if m.role not in ("user", "assistant"):
        raise bad(f"{where}.role", f'role must be "user" or "assistant" (got {m.role!r})')
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict[str, Any]] = []
    text: list[Any] = []
    calls = []
    for j, block in enumerate(m.content):
        at = f"{where}.content[{j}]"
        if block.type == "text":
            text.append(block.text or "")
        elif block.type == "image" and m.role == "user":
            images.append(anthropic_source(block.source, f"{at}.source"))
            text.append({"type": "image"})
        elif block.type == "tool_use" and m.role == "assistant":
            if not block.name:
                raise bad(f"{at}.name", "a tool_use block needs a name")
            if not isinstance(block.input, dict):
                raise bad(f"{at}.input", "a tool_use block's input must be an object (got "
                          f"{block.input!r})")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
        elif block.type == "tool_result" and m.role == "user":
            content = block.content
            if isinstance(content, list):
                content = _texts(content, f"{at}.content")
            content = content or ""
            if block.is_error:
                content = f"Error: {content}"
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        else:
            raise bad(f"{at}.type", f"a {m.role} message cannot have a {block.type!r} block "
                      "here (text, and tool_use in assistant / tool_result and image in user "
                      "messages)")
    if text or calls or not out:
        content: Any = "".join(text) if all(isinstance(t, str) for t in text) else [
            t if isinstance(t, dict) else {"type": "text", "text": t} for t in text]
        message: dict[str, Any] = {"role": m.role, "content": content}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _tool(i: int, tool: an.Tool) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise bad(f"tools[{i}].type", f"only custom tools are supported (got {tool.type!r})")
    function: dict[str, Any] = {"name": tool.name}  # in OpenAI's order, as templates show it
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema or {"type": "object"}
    return {"type": "function", "function": function}


def _tool_choice(choice: an.ToolChoice | None) -> str | dict[str, str] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise bad("tool_choice.name", 'tool_choice {"type": "tool"} needs a name')
        return {"name": choice.name}
    if choice.type not in CHOICES:
        raise bad("tool_choice.type", f"tool_choice.type must be one of "
                  f"{[*CHOICES, 'tool']} (got {choice.type!r})")
    return CHOICES[choice.type]


# -- replies -------------------------------------------------------------------------------------


def _stop_reason(last: Piece | None, reply: Reply) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a reply that ended with `last`."""
    if last is None or last.finish_reason is None:
        return None, None
    if last.finish_reason == "length":
        return "max_tokens", None
    if last.stop_string is not None:
        return "stop_sequence", last.stop_string
    return ("tool_use" if reply.calls else "end_turn"), None


def _extension(pieces: list[Piece], done: Done, plan: Plan) -> dict[str, Any]:
    speculative = oa.usage(done.stats, len(plan.prompt), len(pieces), plan.draft).get(
        "speculative")
    return {**oa.draft_marks(pieces), "speculative": speculative}


def _cached(done: Done) -> int:
    return done.stats.cached_tokens if done.stats is not None else 0


async def respond(service: Service, request: Request, plan: Plan) -> Response:
    """Run the plan and answer: one message, or the stream of events."""
    return await service.respond(request, plan, "messages", lambda gen: _stream(service, gen),
                                 lambda pieces, done: _reply(service, plan, pieces, done))


def _reply(service: Service, plan: Plan, pieces: list[Piece], done: Done) -> dict[str, Any]:
    reply = Reply(plan)
    content: list[dict[str, Any]] = []
    for part in reply.parts(pieces):
        if isinstance(part, ToolCall):
            content.append(an.tool_use_block(part))
        elif content and content[-1]["type"] == "text":
            content[-1]["text"] += part
        else:
            content.append(an.text_block(part))
    stop_reason, stop_sequence = _stop_reason(pieces[-1] if pieces else None, reply)
    return {
        "id": an.new_id(), "type": "message", "role": "assistant", "model": service.model_name,
        "content": content or [an.text_block("")], "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": an.usage(len(plan.prompt), _cached(done), len(pieces)),
        "tinydraft": _extension(pieces, done, plan)}


async def _stream(service: Service, gen: Generation) -> AsyncIterator[bytes]:
    """message_start, then per content block content_block_start / _delta / _stop, then
    message_delta (stop reason, final usage) and message_stop; an `error` event if the
    generation fails. The job is cancelled however the stream ends."""
    plan = gen.plan
    reply = Reply(plan)

    def sse(kind: str, **fields: Any) -> bytes:
        name, data = an.event(kind, **fields)
        return format_sse_event(data_str=data, event=name)

    index, open_text, count, last = -1, False, 0, None
    try:
        yield sse("message_start", message={
            "id": an.new_id(), "type": "message", "role": "assistant",
            "model": service.model_name, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": an.usage(len(plan.prompt), 0, 0)})
        while True:
            event = await gen.next()
            if isinstance(event, Piece):
                count, last = count + 1, event
                for part in reply.feed(event):
                    if isinstance(part, ToolCall):
                        if open_text:
                            yield sse("content_block_stop", index=index)
                            open_text = False
                        index += 1
                        yield sse("content_block_start", index=index,
                                  content_block=an.tool_use_block(part, with_input=False))
                        yield sse("content_block_delta", index=index, delta={
                            "type": "input_json_delta", "partial_json": part.arguments_json})
                        yield sse("content_block_stop", index=index)
                        continue
                    if not open_text:
                        index, open_text = index + 1, True
                        yield sse("content_block_start", index=index,
                                  content_block=an.text_block(""))
                    yield sse("content_block_delta", index=index,
                              delta={"type": "text_delta", "text": part})
            elif isinstance(event, Failed):
                err = failure(event.error)
                yield sse("error", error=an.error_body(err.status, err.message)["error"])
                return
            elif isinstance(event, Done):
                if index < 0:  # an empty reply is one empty text block
                    index, open_text = 0, True
                    yield sse("content_block_start", index=0, content_block=an.text_block(""))
                if open_text:
                    yield sse("content_block_stop", index=index)
                stop_reason, stop_sequence = _stop_reason(last, reply)
                yield sse("message_delta",
                          delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                          usage=an.usage(len(plan.prompt), _cached(event), count))
                yield sse("message_stop")
                return
    except ClientGone:
        pass
    finally:
        gen.close()

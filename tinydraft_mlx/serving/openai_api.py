"""OpenAI's API on the service: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(stream and not; SSE ending with `data: [DONE]`), tool calls included.

Requests (openai_schema.py) become a `Spec` here, after the checks only OpenAI's fields need (`n`,
`echo`, `logprobs` / `top_logprobs`, content parts, the tool messages); replies are rendered from
the generation's pieces: text, `tool_calls` (parsed from the model's text in its family's format,
streamed as `delta.tool_calls` once each call is complete), logprobs, usage and our `tinydraft`
extension.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import format_sse_event

from . import openai_schema as oa
from .images import data_url
from .openai_schema import ChatCompletionRequest, CompletionRequest, error_body
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

TOOL_CHOICES = ("auto", "none", "required")


def error_response(err: APIError) -> JSONResponse:
    """An APIError in OpenAI's error body."""
    return JSONResponse(error_body(err.message, param=err.param, code=err.code, kind=err.kind),
                        status_code=err.status, headers=err.headers)


def register(app: FastAPI, service: Service) -> None:
    """Add OpenAI's routes to `app`."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": service.model_name, "object": "model",
                                            "created": oa.now(), "owned_by": "tinydraft-mlx"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        plan = await service.plan_off_loop(completion_spec(body))
        return await respond(service, request, plan, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        plan = await service.plan_off_loop(chat_spec(body))
        return await respond(service, request, plan, "chat")


# -- requests ------------------------------------------------------------------------------------


def _common(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    if req.n not in (None, 1):
        raise bad("n", f"n must be 1: one completion per request (got {req.n!r})")
    check_unicode(req.model_dump(exclude_none=True))
    return dict(
        model=req.model, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        min_p=req.min_p, seed=req.seed, stop=req.stop, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        logit_bias=req.logit_bias, num_draft_tokens=req.num_draft_tokens, draft=req.draft,
        tree=req.tree,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage))


def completion_spec(req: CompletionRequest) -> Spec:
    """A completions request as a Spec (400 for what this server cannot honour)."""
    if req.echo:
        raise bad("echo", "echo is not supported")
    if req.suffix:
        raise bad("suffix", "suffix (insertion) is not supported")
    if req.best_of not in (None, 1):
        raise bad("best_of", f"best_of must be 1 (got {req.best_of!r})")
    common = _common(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise bad("prompt", f"one prompt per request (got a list of {len(prompt)} "
                      "strings)")
        prompt = prompt[0]
    logprobs = req.logprobs
    return Spec(prompt=prompt, max_tokens=req.max_tokens, logprobs=logprobs, **common)


def chat_spec(req: ChatCompletionRequest) -> Spec:
    """A chat request as a Spec: messages as the chat template takes them, tools and
    tool_choice checked."""
    kind = (req.response_format or {}).get("type", "text")
    if kind != "text":
        raise bad("response_format", f'only {{"type": "text"}} is supported (got {kind!r})')
    common = _common(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    tools = None
    if req.tools:
        for i, tool in enumerate(req.tools):
            if tool.type != "function":
                raise bad(f"tools[{i}].type", f'only "function" tools are supported (got '
                          f"{tool.type!r})")
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
    images: list[bytes] = []
    messages = _messages(req, images)
    return Spec(messages=messages, images=images, tools=tools,
                tool_choice=_tool_choice(req.tool_choice), max_tokens=getattr(req, name),
                logprobs=logprobs,
                fields={"max_tokens": name, "logprobs": "top_logprobs"}, **common)


def _tool_choice(choice: str | oa.NamedToolChoice | None) -> str | dict[str, str] | None:
    if choice is None or isinstance(choice, str):
        if choice is not None and choice not in TOOL_CHOICES:
            raise bad("tool_choice", f"tool_choice must be one of {list(TOOL_CHOICES)} or "
                      f'{{"type": "function", "function": {{"name": ...}}}} (got {choice!r})')
        return choice
    if choice.type != "function":
        raise bad("tool_choice", f'tool_choice.type must be "function" (got {choice.type!r})')
    return {"name": choice.function.name}


def _messages(req: ChatCompletionRequest, images: list[bytes]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them; each `image_url` part's image appended to
    `images` (its place: an {"type": "image"} part)."""
    if not req.messages:
        raise bad("messages", "messages is required: a non-empty list of "
                  '{"role", "content"} objects')
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            content = _parts(content, f"messages[{i}].content", images)
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.tool_calls:
            if m.role != "assistant":
                raise bad(f"messages[{i}].tool_calls", "only assistant messages have "
                          f"tool_calls (got role {m.role!r})")
            message["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments,
                                            f"messages[{i}].tool_calls[{j}].function.arguments")}}
                for j, call in enumerate(m.tool_calls)]
        if m.role == "tool" and m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _parts(parts: list[oa.ContentPart], where: str,
           images: list[bytes]) -> str | list[dict[str, Any]]:
    """A message's content parts: their text, or with images the parts in order."""
    kinds = {part.type for part in parts}
    if kinds - {"text", "image_url"}:
        raise bad(where, "only text and image_url content parts are supported (got "
                  f"{sorted(kinds - {'text', 'image_url'})})")
    if "image_url" not in kinds:
        return "".join(part.text or "" for part in parts)
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if part.type == "text":
            out.append({"type": "text", "text": part.text or ""})
            continue
        if part.image_url is None:
            raise bad(f"{where}[{j}].image_url", "an image_url part needs image_url.url")
        images.append(data_url(part.image_url.url, f"{where}[{j}].image_url.url"))
        out.append({"type": "image"})
    return out


def _arguments(text: str, param: str) -> dict[str, Any]:
    """A call's arguments, a JSON object as text, as the object (the chat template's form)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise bad(param, f"{param} must be a JSON object as text ({err.msg} at character "
                  f"{err.pos})") from None
    if not isinstance(value, dict):
        raise bad(param, f"{param} must be a JSON object (got {type(value).__name__})")
    return value


# -- replies -------------------------------------------------------------------------------------


async def respond(service: Service, request: Request, plan: Plan, endpoint: str) -> Response:
    """Run the plan and answer: one JSON object, or an SSE stream of chunks."""
    return await service.respond(request, plan, endpoint, lambda gen: _stream(service, gen),
                                 lambda pieces, done: _whole(service, plan, pieces, done))


def _finish(piece: Piece, reply: Reply) -> str | None:
    if piece.finish_reason == "stop" and reply.calls:
        return "tool_calls"
    return piece.finish_reason


def _whole(service: Service, plan: Plan, pieces: list[Piece], done: Done) -> dict[str, Any]:
    reply = Reply(plan)
    text, calls = reply.whole(pieces)
    finish = _finish(pieces[-1], reply) if pieces else None
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None,
                              "tinydraft": oa.draft_marks(pieces)}
    if plan.chat:
        choice["message"] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            choice["message"]["tool_calls"] = [oa.tool_call(c) for c in calls]
        if plan.options.logprobs is not None:
            choice["logprobs"] = oa.chat_logprobs(service.tokenizer, pieces)
    else:
        choice["text"] = text
        if plan.options.logprobs is not None:
            choice["logprobs"] = oa.completion_logprobs(service.tokenizer, pieces, 0)
    return {
        "id": oa.new_id("chatcmpl" if plan.chat else "cmpl"),
        "object": "chat.completion" if plan.chat else "text_completion",
        "created": oa.now(),
        "model": service.model_name,
        "choices": [choice],
        "usage": oa.usage(done.stats, len(plan.prompt), len(pieces), plan.draft),
    }


async def _stream(service: Service, gen: Generation) -> AsyncIterator[bytes]:
    """SSE chunks, one per token; the usage chunk when asked; `[DONE]`. However it ends
    (including the client hanging up, which cancels this iterator), the job is cancelled,
    which stops a generation still running before its next token."""
    plan = gen.plan
    cid, created = oa.new_id("chatcmpl" if plan.chat else "cmpl"), oa.now()
    kind = "chat.completion.chunk" if plan.chat else "text_completion"
    reply = Reply(plan)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = {"id": cid, "object": kind, "created": created, "model": service.model_name,
                "choices": choices, **extra}
        return format_sse_event(data_str=json.dumps(body))

    count, offset = 0, 0
    try:
        if plan.chat:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                          "finish_reason": None, "logprobs": None}])
        while True:
            event = await gen.next()
            if isinstance(event, Piece):
                count += 1
                yield chunk([_chunk_choice(service, plan, reply, event, offset)])
                offset += len(event.text)
            elif isinstance(event, Failed):
                err = failure(event.error)
                yield format_sse_event(data_str=json.dumps(error_body(
                    err.message, param=err.param, code=err.code, kind=err.kind)))
                break
            elif isinstance(event, Done):
                if plan.include_usage:
                    yield chunk([], usage=oa.usage(event.stats, len(plan.prompt), count,
                                                   plan.draft))
                break
        yield format_sse_event(data_str="[DONE]")
    except ClientGone:
        pass
    finally:
        gen.close()


def _chunk_choice(service: Service, plan: Plan, reply: Reply, piece: Piece,
                  offset: int) -> dict[str, Any]:
    known = len(reply.calls)
    parts = reply.feed(piece)
    text = "".join(p for p in parts if isinstance(p, str))
    calls = [p for p in parts if isinstance(p, ToolCall)]
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(piece, reply),
                              "logprobs": None, "tinydraft": oa.draft_marks([piece])}
    if plan.chat:
        choice["delta"] = {"content": text} if text or not calls else {}
        if calls:
            choice["delta"]["tool_calls"] = [oa.tool_call(c, known + i)
                                             for i, c in enumerate(calls)]
        if plan.options.logprobs is not None:
            choice["logprobs"] = oa.chat_logprobs(service.tokenizer, [piece])
    else:
        choice["text"] = text
        if plan.options.logprobs is not None:
            choice["logprobs"] = oa.completion_logprobs(service.tokenizer, [piece], offset)
    return choice

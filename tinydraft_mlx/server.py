"""An OpenAI-compatible HTTP server: `python -m tinydraft_mlx.server` (console script
`tinydraft-mlx-server`), FastAPI + uvicorn.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream and not; SSE
ending with `data: [DONE]`), GET /health, and GET / (a page that streams a completion and colours
the tokens that came from the draft). Generation is exact speculative decoding through the
generation API; one generation runs at a time on the worker thread (`worker.py`), requests wait
in a bounded FIFO (503 with Retry-After beyond it), recent conversations stay in a prompt-cache
pool (`cache_pool.py`) so a second chat turn prefills only its new tokens.

Bad input is answered with HTTP 400 and OpenAI's error body naming the field, the allowed range
and the value; unknown models with 404; bodies over the limit with 413. Anything else that goes
wrong is ours: a logged 500 with the same body, and the server goes on.

Hard to wedge: prompts are tokenized off the event loop (`/health` and the streams keep
flowing), long ones one at a time, after cheap checks that bound the work (fields first; a text
longer than the context could hold is refused untokenized); a client that hangs up, streaming
or not, ends its generation within a round; connections that send no complete request within
`header_timeout` are closed, bodies must arrive within `body_timeout`, at most
`max_connections` are open at once; repeated log records are rate-limited (`limits.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any, NoReturn

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import limits
from . import openai_schema as oa
from .api import MAX_DRAFT_TOKENS, check_k
from .cli import flag_message
from .engine.cache import KEEP
from .engine.drafters import MODEL, resolve_drafter
from .engine.forward import vocab_width
from .engine.lookup import NO_DRAFT, PROMPT_LOOKUP
from .engine.sampling import ParameterError, SamplingParams, check_int
from .openai_schema import ChatCompletionRequest, CompletionRequest, error_body
from .text import chat_text, check_stop, prompt_ids, read_template
from .worker import Done, Failed, Job, Piece, QueueFull, Started, Worker, WorkerDown

DRAFT_MODEL = MODEL  # a request's `draft`: the server's draft model, prompt lookup, or none
DRAFT_CHOICES = (DRAFT_MODEL, PROMPT_LOOKUP, NO_DRAFT)
MAX_TOP_LOGPROBS = 20
MAX_BODY_BYTES = 8 << 20
BODY_TIMEOUT = 30.0  # seconds a request's body may take to arrive
LONG_PROMPT_CHARS = 1 << 16  # prompts longer than this are tokenized one at a time
DEFAULT_BATCH = 16  # --max-batch: measured with bench/server.py (README)
MAX_BATCH = 256

log = logging.getLogger("tinydraft_mlx.server")


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)
        self.headers = headers

    def response(self) -> JSONResponse:
        body = error_body(self.message, param=self.param, code=self.code, kind=self.kind)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# request field that a library parameter name comes from
_PARAMS = {"k": "num_draft_tokens", "prompt token ids": "prompt", "logit_bias token id":
           "logit_bias", "logit_bias value": "logit_bias"}


def _parameter_error(err: ParameterError, renames: dict[str, str] | None = None) -> APIError:
    param = (renames or {}).get(err.name) or _PARAMS.get(err.name, err.name)
    name = param if err.name in ("k", "max_tokens") else err.name
    return _bad(param, f"{name} must be {err.allowed} (got {err.value!r})")


@dataclass
class Defaults:
    """What a request gets for the fields it leaves out (the server's flags)."""

    k: int | str = 4
    draft: str = DRAFT_MODEL
    max_tokens: int = 512
    temperature: float = 0.0


@dataclass
class Plan:
    """A validated request: the job's inputs plus what the response needs."""

    prompt: list[int]
    draft: str
    options: dict[str, Any]
    logprobs: int | None
    stream: bool
    include_usage: bool
    chat: bool


class Service:
    """The state behind the routes: the worker, the tokenizer, the served model's name and the
    defaults."""

    def __init__(self, worker: Worker, model_name: str, defaults: Defaults) -> None:
        self.worker, self.model_name, self.defaults = worker, model_name, defaults
        self.tokenizer = worker.tokenizer
        args = getattr(worker.target, "args", None)
        self.context = getattr(args, "max_position_embeddings", None)
        self.vocab = vocab_width(worker.target)
        # the longest token, in characters (byte-level BPE: a vocabulary entry has one character
        # per byte, so none decodes to more): a text longer than limit x this cannot fit
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        self.token_chars = max(map(len, vocab), default=0) or None
        self._planning = asyncio.Semaphore(1)  # one long prompt's tokenization at a time
        self._planners = 0  # long prompts planning or waiting to

    # -- validation ------------------------------------------------------------------------------

    async def plan_off_loop(self, req: CompletionRequest | ChatCompletionRequest,
                            chat: bool) -> Plan:
        """`plan` on a worker thread. Long prompts (tokenizing 7.5 MB takes ~10 s) are planned
        one at a time, so a few of them cannot take every thread, while short ones go straight
        through; 503 when more long ones than the queue holds are already waiting."""
        if _prompt_chars(req, chat) <= LONG_PROMPT_CHARS:
            return await asyncio.to_thread(self.plan, req, chat)
        if self._planners >= self.worker.max_queue:
            raise _busy(f"{self._planners} long prompts are being tokenized or waiting to", 1)
        self._planners += 1
        try:
            async with self._planning:
                return await asyncio.to_thread(self.plan, req, chat)
        finally:
            self._planners -= 1

    def plan(self, req: CompletionRequest | ChatCompletionRequest, chat: bool) -> Plan:
        """Check every field and build the job's inputs; APIError (400/404) for bad input. The
        cheap checks come first, the prompt's tokenization last."""
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} is not served here; this server serves "
                           f"{self.model_name!r} (GET /v1/models)", param="model",
                           code="model_not_found")
        if req.n not in (None, 1):
            raise _bad("n", f"n must be 1: one completion per request (got {req.n!r})")
        _reject_unsupported(req, chat)
        _check_unicode(req.model_dump(exclude_none=True))
        draft = self._draft(req.draft)
        k = self.defaults.k if req.num_draft_tokens is None else req.num_draft_tokens
        max_name = "max_completion_tokens" if chat and req.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = getattr(req, max_name)
        options = {
            "k": k,
            "temperature": (self.defaults.temperature if req.temperature is None
                            else req.temperature),
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "top_k": 0 if req.top_k is None else req.top_k,
            "min_p": 0.0 if req.min_p is None else req.min_p,
            "seed": req.seed,
            "stop": req.stop,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty,
            "logit_bias": self._logit_bias(req.logit_bias),
        }
        try:
            SamplingParams(options["temperature"], options["top_p"], options["top_k"],
                           options["min_p"], options["seed"])
            # checked whatever the draft: a bad value is an error, never ignored
            check_k(k, self.worker.max_kv_size if draft != NO_DRAFT else None)
            if max_tokens is not None:
                check_int("max_tokens", max_tokens, 1)
            check_stop(options["stop"])
        except ParameterError as err:
            raise _parameter_error(err, {"max_tokens": max_name}) from None
        logprobs = self._logprobs(req, chat)
        ids = self._chat_prompt(req) if chat else self._text_prompt(req)
        options["max_tokens"] = self._max_tokens(len(ids), max_tokens, max_name, chat)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Plan(ids, draft, options, logprobs, req.stream, include_usage, chat)

    def _max_tokens(self, n: int, asked: int | None, name: str, chat: bool) -> int:
        """max_tokens for a prompt of n tokens: the prompt must fit the KV bound or the context,
        and prompt + max_tokens the context (the default is cut to what is left of it)."""
        limit_name, limit = self._context_limit()
        if limit is not None and n >= limit:
            raise _bad("messages" if chat else "prompt",
                       f"the prompt has {n} tokens; {limit_name} is {limit}, so it must "
                       f"have at most {limit - 1}", code="context_length_exceeded")
        if asked is None:
            default = self.defaults.max_tokens
            return default if self.context is None else max(1, min(default, self.context - n))
        if self.context is not None and n + asked > self.context:
            raise _bad(name, f"the prompt has {n} tokens and {name} is {asked}: {n + asked} in "
                       f"all, more than the model's context length {self.context}",
                       code="context_length_exceeded")
        return asked

    def _check_length(self, text: str, param: str) -> None:
        """Refuse, untokenized, a text too long for any tokenization of it to fit."""
        limit_name, limit = self._context_limit()
        if limit is None or self.token_chars is None:
            return
        most = limit * self.token_chars
        if len(text) > most:
            raise _bad(param, f"the prompt has {len(text)} characters; {limit_name} is {limit} "
                       f"tokens of at most {self.token_chars} characters, so it must have at "
                       f"most {most}", code="context_length_exceeded")

    def _text_prompt(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if prompt is None:
            raise _bad("prompt", "prompt is required: a string or a list of token ids")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise _bad("prompt", f"one prompt per request (got a list of {len(prompt)} "
                           "strings)")
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._check_length(prompt, "prompt")
        try:
            return prompt_ids(self.tokenizer, prompt, self.vocab)
        except ParameterError as err:
            raise _parameter_error(err) from None

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise _bad("messages", "messages is required: a non-empty list of "
                       '{"role", "content"} objects')
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                kinds = {part.type for part in content}
                if kinds - {"text"}:
                    raise _bad(f"messages[{i}].content", "only text content parts are "
                               f"supported (got {sorted(kinds - {'text'})})")
                content = "".join(part.text or "" for part in content)
            messages.append({"role": m.role, "content": content or ""})
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise _bad("messages", "this model's tokenizer has no chat template: use "
                       "/v1/completions, or start the server with --chat-template")
        try:
            text = chat_text(self.tokenizer, messages)
        except ParameterError as err:
            raise _parameter_error(err) from None
        except TemplateError as err:  # the template refused the messages (e.g. role order)
            raise _bad("messages", f"the chat template refused the messages: {err}") from None
        self._check_length(text, "messages")
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise _bad("messages", "the messages make an empty prompt")
        return ids

    def _context_limit(self) -> tuple[str, int | None]:
        if self.worker.max_kv_size is not None:
            return "--max-kv-size", self.worker.max_kv_size
        return "the model's context length", self.context

    def _draft(self, draft: str | None) -> str:
        draft = self.defaults.draft if draft is None else draft
        if draft not in DRAFT_CHOICES:
            raise _bad("draft", f"draft must be one of {list(DRAFT_CHOICES)} (got {draft!r})")
        if draft == DRAFT_MODEL and self.worker.draft is None:
            raise _bad("draft", 'draft "model": this server has no draft model loaded '
                       f'(use "{PROMPT_LOOKUP}" or "{NO_DRAFT}")')
        return draft

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if bias is None:
            return None
        out = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise _bad("logit_bias", f"logit_bias keys must be token ids (got {key!r})")\
                    from None
            if not 0 <= token < self.vocab:
                raise _bad("logit_bias", f"logit_bias token ids must be in [0, {self.vocab - 1}]"
                           f" (got {token})")
            out[token] = value
        return out

    def _logprobs(self, req: CompletionRequest | ChatCompletionRequest,
                  chat: bool) -> int | None:
        if chat:
            if req.top_logprobs is not None and not req.logprobs:
                raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
            if not req.logprobs:
                return None
            top, name = (0 if req.top_logprobs is None else req.top_logprobs), "top_logprobs"
        else:
            if req.logprobs is None:
                return None
            top, name = req.logprobs, "logprobs"
        try:
            return check_int(name, top, 0, MAX_TOP_LOGPROBS)
        except ParameterError as err:
            raise _parameter_error(err) from None

    # -- running ---------------------------------------------------------------------------------

    def job_draft(self, draft: str) -> Any:
        return self.worker.draft if draft == DRAFT_MODEL else draft

    async def run(self, request: Request, plan: Plan) -> Response:
        """Queue the job, wait for it to start, answer (JSON or an SSE stream). Until the SSE
        response takes over the connection, a watcher ends the job as soon as the client hangs
        up, whether tokens are flowing or not."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(event: Any) -> None:  # called on the worker thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop has closed: nobody is listening
                pass

        job = Job(plan.prompt, self.job_draft(plan.draft), plan.options, deliver, plan.logprobs)
        try:
            self.worker.submit(job)
        except QueueFull as err:
            raise _busy(f"{err}: {self.worker.waiting} requests are waiting (--max-queue)",
                        err.retry_after) from None
        except WorkerDown as err:
            raise APIError(503, str(err), code="worker_down", kind="server_error") from None
        watcher = asyncio.create_task(_watch_disconnect(request, job, events))
        try:
            first = await _next(events)
            if isinstance(first, Failed):
                raise _failure(first.error)
            if isinstance(first, Done):  # cancelled before it started (shutdown)
                raise APIError(503, "the server is shutting down", code="shutting_down",
                               kind="server_error")
            assert isinstance(first, Started)
            if plan.stream:
                watcher.cancel()  # the SSE response watches its connection from here on
                return EventSourceResponse(self._stream(events, job, plan))
            return await self._collect(events, plan)
        except _ClientGone:
            return Response(status_code=499)
        finally:
            watcher.cancel()

    async def _collect(self, events: asyncio.Queue, plan: Plan) -> Response:
        pieces: list[Piece] = []
        while True:
            event = await _next(events)
            if isinstance(event, Piece):
                pieces.append(event)
            elif isinstance(event, Failed):
                raise _failure(event.error)
            else:
                return JSONResponse(self._whole(plan, pieces, event))

    def _whole(self, plan: Plan, pieces: list[Piece], done: Done) -> dict[str, Any]:
        text = "".join(p.text for p in pieces)
        finish = pieces[-1].finish_reason if pieces else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None,
                                  "tinydraft": oa.draft_marks(pieces)}
        if plan.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if plan.logprobs is not None:
                choice["logprobs"] = oa.chat_logprobs(self.tokenizer, pieces)
        else:
            choice["text"] = text
            if plan.logprobs is not None:
                choice["logprobs"] = oa.completion_logprobs(self.tokenizer, pieces, 0)
        return {
            "id": oa.new_id("chatcmpl" if plan.chat else "cmpl"),
            "object": "chat.completion" if plan.chat else "text_completion",
            "created": oa.now(),
            "model": self.model_name,
            "choices": [choice],
            "usage": oa.usage(done.stats, len(plan.prompt), len(pieces), plan.draft),
        }

    async def _stream(self, events: asyncio.Queue, job: Job,
                      plan: Plan) -> AsyncIterator[bytes]:
        """SSE chunks, one per token; the usage chunk when asked; `[DONE]`. However it ends
        (including the client hanging up, which cancels this iterator), the job is cancelled,
        which stops a generation still running before its next token."""
        cid, created = oa.new_id("chatcmpl" if plan.chat else "cmpl"), oa.now()
        kind = "chat.completion.chunk" if plan.chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            body = {"id": cid, "object": kind, "created": created, "model": self.model_name,
                    "choices": choices, **extra}
            return format_sse_event(data_str=json.dumps(body))

        count, offset = 0, 0
        try:
            if plan.chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": None, "logprobs": None}])
            while True:
                event = await events.get()
                if isinstance(event, Piece):
                    count += 1
                    yield chunk([self._chunk_choice(plan, event, offset)])
                    offset += len(event.text)
                elif isinstance(event, Failed):
                    err = _failure(event.error)
                    yield format_sse_event(data_str=json.dumps(error_body(
                        err.message, param=err.param, code=err.code, kind=err.kind)))
                    break
                elif isinstance(event, Done):
                    if plan.include_usage:
                        yield chunk([], usage=oa.usage(event.stats, len(plan.prompt), count,
                                                       plan.draft))
                    break
            yield format_sse_event(data_str="[DONE]")
        finally:
            job.cancelled.set()

    def _chunk_choice(self, plan: Plan, piece: Piece, offset: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": piece.finish_reason,
                                  "logprobs": None, "tinydraft": oa.draft_marks([piece])}
        if plan.chat:
            choice["delta"] = {"content": piece.text}
            if plan.logprobs is not None:
                choice["logprobs"] = oa.chat_logprobs(self.tokenizer, [piece])
        else:
            choice["text"] = piece.text
            if plan.logprobs is not None:
                choice["logprobs"] = oa.completion_logprobs(self.tokenizer, [piece], offset)
        return choice

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body): 200 and status "ok" while the generation thread runs, else 503
        and status "error" (requests would not be served)."""
        w = self.worker
        entries, nbytes = w.cache_info
        alive = w.alive
        return (200 if alive else 503), {
            "status": "ok" if alive else "error", "model": self.model_name,
            "draft": self.defaults.draft, "worker": {"alive": alive, "errors": w.errors},
            "running": w.running, "batch": w.batch, "max_batch": w.max_batch,
            "waiting": w.waiting, "requests": dict(w.counts),
            "prompt_cache": {"entries": entries, "bytes": nbytes, "max_bytes": w.pool.max_bytes}}


class _ClientGone(Exception):
    pass


_GONE = object()  # put in a job's event queue when its client hangs up


async def _watch_disconnect(request: Request, job: Job, events: asyncio.Queue) -> None:
    """Wait for the client to hang up (the body has been read, so the next ASGI message is the
    disconnect); then cancel the job, which stops before its next token."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancelled.set()
            events.put_nowait(_GONE)
            return


async def _next(events: asyncio.Queue) -> Any:
    """The job's next event; _ClientGone when its client has hung up."""
    event = await events.get()
    if event is _GONE:
        raise _ClientGone
    return event


def _prompt_chars(req: CompletionRequest | ChatCompletionRequest, chat: bool) -> int:
    """Characters of text the request asks to tokenize (token-id prompts: none)."""
    if chat:
        total = 0
        for m in req.messages or []:
            parts = m.content if isinstance(m.content, list) else [m.content]
            total += sum(len(p if isinstance(p, str) else p.text or "") for p in parts if p)
        return total
    prompt = req.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str)) if isinstance(prompt, list) else 0


def _busy(message: str, retry_after: int) -> APIError:
    return APIError(503, message, code="server_busy", kind="server_error",
                    headers={"Retry-After": str(retry_after)})


def _failure(error: Exception) -> APIError:
    """A job's error as an API error: invalid options (a `ParameterError`, raised by the
    library's checks) are the client's (400); anything else, a `ValueError` from deep inside
    MLX included, is ours (500, logged)."""
    if isinstance(error, ParameterError):
        return _parameter_error(error)
    log.error("generation failed", exc_info=error)
    return APIError(500, f"generation failed: {type(error).__name__}: {error}",
                    kind="server_error", code="generation_failed")


def _check_unicode(value: Any, where: str = "") -> None:
    """400 for a string that is not valid Unicode (a lone surrogate such as "\\ud800", which
    JSON can carry but UTF-8 cannot), naming the field it is in."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise _bad(where or None, f"{where or 'the request'} is not valid Unicode: "
                       f"{err.reason} at character {err.start} "
                       f"({value[err.start:err.end]!r})") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, where)
            _check_unicode(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{where}[{i}]")


def _reject_unsupported(req: CompletionRequest | ChatCompletionRequest, chat: bool) -> None:
    """Fields whose meaning this server cannot honour: an error, never silently dropped."""
    if chat:
        if req.tools:
            raise _bad("tools", "tool calling is not supported")
        if req.tool_choice not in (None, "none"):
            raise _bad("tool_choice", "tool calling is not supported")
        kind = (req.response_format or {}).get("type", "text")
        if kind != "text":
            raise _bad("response_format", f'only {{"type": "text"}} is supported (got {kind!r})')
        return
    if req.echo:
        raise _bad("echo", "echo is not supported")
    if req.suffix:
        raise _bad("suffix", "suffix (insertion) is not supported")
    if req.best_of not in (None, 1):
        raise _bad("best_of", f"best_of must be 1 (got {req.best_of!r})")


# -- the app -------------------------------------------------------------------------------------


def create_app(worker: Worker, model_name: str, defaults: Defaults | None = None, *,
               max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout: float = BODY_TIMEOUT) -> FastAPI:
    """The FastAPI app serving `worker`'s models as `model_name`. The worker thread starts with
    the app and stops (waiting jobs cancelled) when it shuts down."""
    service = Service(worker, model_name, defaults or Defaults())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="tinydraft-mlx", lifespan=lifespan)
    app.add_middleware(RequestLimits, max_bytes=max_body_bytes, body_timeout=body_timeout)
    app.state.service = service

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return _validation_error(err).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=err)
        return APIError(500, f"internal error: {type(err).__name__}: {err}", kind="server_error",
                        code="internal_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed",
                408: "request_timeout"}.get(err.status_code)
        return APIError(err.status_code, str(err.detail), code=code, kind=kind,
                        headers=getattr(err, "headers", None)).response()

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(resources.files("tinydraft_mlx").joinpath(
            "static/index.html").read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = service.health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": oa.now(), "owned_by": "tinydraft-mlx"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await service.run(request, await service.plan_off_loop(body, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await service.run(request, await service.plan_off_loop(body, chat=True))

    return app


class RequestLimits:
    """ASGI middleware: a request body over `max_bytes` gets 413 with OpenAI's error body, whether
    its Content-Length says so up front or a chunked body grows past it while being read; a body
    that has not fully arrived within `body_timeout` seconds gets 408. A body sent without a
    Content-Type is read as JSON (the only format the API takes)."""

    def __init__(self, app: Any, max_bytes: int, body_timeout: float = BODY_TIMEOUT) -> None:
        self.app, self.max_bytes, self.body_timeout = app, max_bytes, body_timeout

    def _too_large(self) -> StarletteHTTPException:
        return StarletteHTTPException(413, f"the request body is larger than {self.max_bytes} "
                                           "bytes")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        if b"content-type" not in headers and scope.get("method") == "POST":
            scope = {**scope, "headers": [*scope.get("headers", []),
                                          (b"content-type", b"application/json")]}
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            err = self._too_large()
            return await APIError(413, err.detail, code="request_too_large").response()(
                scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        seen, complete = 0, False

        async def limited() -> dict:
            nonlocal seen, complete
            if complete:  # the body is in: what follows is the disconnect, whenever it comes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise StarletteHTTPException(408, f"the request body did not arrive within "
                                                  f"{self.body_timeout:g} s") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, limited, send)


# a union member pydantic names in an error location (prompt.list[int][0]): not a field
_UNION_TAG = re.compile(r"str|int|float|bool|none|[a-z-]+\[.*\]")


def _validation_error(err: RequestValidationError) -> APIError:
    """pydantic's first complaint as one sentence naming the field and the value."""
    first = err.errors()[0]
    if first.get("type") == "json_invalid":
        return _bad(None, f"the request body is not valid JSON: {first.get('msg')}",
                    code="invalid_json")
    if tuple(first.get("loc", ())) == ("body",) and isinstance(first.get("input"), bytes):
        return _bad(None, "the request body must be a JSON object, sent as application/json",
                    code="invalid_json")
    param = ""  # e.g. messages[0].role
    for part in first.get("loc", ()):
        if isinstance(part, int):
            param += f"[{part}]"
        elif part != "body" and not _UNION_TAG.fullmatch(part):
            param += f".{part}" if param else str(part)
    param = param or None
    value = first.get("input")
    got = "" if first.get("type") == "missing" else f" (got {value!r})"
    where = f"{param}: " if param else ""
    return _bad(param, f"{where}{first.get('msg')}{got}")


# -- command line --------------------------------------------------------------------------------


def setup_arg_parser() -> argparse.ArgumentParser:
    """The server's flags: the CLI's model flags plus host, port, queue and cache sizes."""
    p = argparse.ArgumentParser(prog="tinydraft-mlx-server",
                                description="OpenAI-compatible server with exact speculative "
                                            "decoding on MLX.")
    p.add_argument("--target", "--model", default=None,
                   help="target model: hub id or directory (default: the bundled demo target)")
    p.add_argument("--draft", "--draft-model", default=None,
                   help="draft model, 'prompt-lookup' or 'none' (default: as the CLI)")
    p.add_argument("-k", "--num-draft-tokens", default="4", dest="k",
                   help=f"default draft tokens per round, 1..{MAX_DRAFT_TOKENS} or 'auto' (4); "
                        "requests may set num_draft_tokens")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="keep only the draft's N most frequent tokens in its LM head")
    p.add_argument("--draft-vocab-counts", default=None, metavar="FILE",
                   help="token counts for --draft-vocab (default: the demo pair's)")
    p.add_argument("--max-kv-size", type=int, default=None,
                   help="bound each KV cache to this many positions; prompts must be shorter")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="weight dtype (default: float32 on the CPU, the checkpoint's on a GPU)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (8080)")
    p.add_argument("--prompt-cache-bytes", type=int, default=1 << 30,
                   help="bytes of KV caches kept for recent conversations (1 GiB)")
    p.add_argument("--max-queue", type=int, default=32,
                   help="requests that may wait for the model; beyond, 503 (32)")
    p.add_argument("--max-batch", type=int, default=DEFAULT_BATCH,
                   help="requests generated together, as one batch of speculative rounds; 1: "
                        f"one at a time ({DEFAULT_BATCH})")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="default max_tokens of a request (512)")
    p.add_argument("--temp", type=float, default=0.0,
                   help="default temperature of a request (0 = greedy, as mlx_lm.server)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (text or a file) for a tokenizer without one")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: --target, or 'tinydraft-demo')")
    p.add_argument("--max-connections", type=int, default=limits.MAX_CONNECTIONS,
                   help="open connections at most; more are closed at once "
                        f"({limits.MAX_CONNECTIONS})")
    p.add_argument("--header-timeout", type=float, default=limits.HEADER_TIMEOUT,
                   help="seconds a connection may take to send a request's headers; then it is "
                        f"closed ({limits.HEADER_TIMEOUT:g})")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    return p


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    k = args.k if args.k == "auto" else (int(args.k) if args.k.lstrip("-").isdigit() else args.k)
    args.k = k
    try:
        check_k(k)
        check_int("--port", args.port, 0, 65535)
        check_int("--max-queue", args.max_queue, 1)
        check_int("--max-batch", args.max_batch, 1, MAX_BATCH)
        check_int("--prompt-cache-bytes", args.prompt_cache_bytes, 0)
        check_int("--max-tokens", args.max_tokens, 1)
        check_int("--max-connections", args.max_connections, 1)
        if not args.header_timeout > 0:
            raise ParameterError("--header-timeout", "> 0", args.header_timeout)
        if args.max_kv_size is not None:
            check_int("--max-kv-size", args.max_kv_size, KEEP + 2)
            if (args.draft or "").lower() != NO_DRAFT:
                check_k(k, args.max_kv_size)
        SamplingParams(args.temp, 1.0, 0, 0.0, None)
    except ParameterError as err:
        _fail(parser, flag_message(err))


def build_app(args: argparse.Namespace) -> FastAPI:
    """Load the models named by the flags and make the app (ModelLoadError, ValueError)."""

    from .loading import load_models, no_draft_notice

    target, draft, tokenizer = load_models(args.target, args.draft, dtype=args.dtype,
                                           draft_vocab=args.draft_vocab,
                                           draft_vocab_counts=args.draft_vocab_counts)
    if args.draft is None and draft is None:
        print(no_draft_notice(args.target), file=sys.stderr)
    if args.chat_template is not None:
        tokenizer.chat_template = read_template(args.chat_template)
    drafter = resolve_drafter(draft)
    model, default_draft = drafter.model, drafter.name
    worker = Worker(target, model, tokenizer, max_kv_size=args.max_kv_size,
                    cache_bytes=args.prompt_cache_bytes, max_queue=args.max_queue,
                    max_batch=args.max_batch)
    name = args.model_name or args.target or "tinydraft-demo"
    defaults = Defaults(k=args.k, draft=default_draft, max_tokens=args.max_tokens,
                        temperature=args.temp)
    return create_app(worker, name, defaults)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until Ctrl-C / SIGTERM (in-flight requests finish; exit status 0). Run as
    a program (argv None: the command line), the process then ends without the interpreter's
    teardown (see the end of this function); with an explicit argv it returns 0."""
    import uvicorn

    from .loading import ModelLoadError

    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    _check_flags(parser, args)
    try:
        app = build_app(args)
    except ParameterError as err:
        _fail(parser, flag_message(err))
    except (ModelLoadError, ValueError) as err:
        _fail(parser, str(err))
    service: Service = app.state.service
    print(f"tinydraft-mlx server: {service.model_name} (draft: {service.defaults.draft}, "
          f"k={service.defaults.k}) on http://{args.host}:{args.port}", file=sys.stderr,
          flush=True)
    # uvicorn handles SIGINT/SIGTERM (stop accepting, let in-flight requests finish, shut the
    # worker down) and then re-raises the signal to the handler it found: a no-op one, so that a
    # clean stop exits with status 0 rather than dying by the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    limits.raise_fd_limit()
    config = limits.config(app, host=args.host, port=args.port, log_level=args.log_level,
                           header_timeout=args.header_timeout,
                           max_connections=args.max_connections, timeout_graceful_shutdown=30)
    limits.limit_logs()  # after uvicorn's Config has set its loggers up
    uvicorn.Server(config).run()
    if argv is None:
        # Everything is stopped and flushed by now. A process whose generation thread ran
        # compiled MLX steps aborts now and then in MLX's C++ teardown at exit ("terminate
        # called without an active exception": ~1 run in 10-20 here, MLX 0.32.4; never with the
        # eager forward, never when the main thread generated), so leave without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What every HTTP API of the server shares: a request checked once, whichever API it came
through, into the worker's job (`Spec` -> `Plan`), the started job's events as the API layers
read them (`Generation`, which also feeds the metrics), the reply's text and tool calls
(`Reply`), and `/health`.

An API module (openai_api.py, anthropic_api.py) turns its wire format into a `Spec`, names its own
fields in `Spec.fields` so that every error speaks the client's language, and renders the events.
Bad input raises `APIError` (rendered in the API's own error body); a prompt is tokenized off the
event loop, long ones one at a time, after cheap checks that bound the work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from jinja2 import TemplateError

from ..engine.drafters import MODEL, drafter_names, resolve_drafter
from ..engine.drafters.lookup import NO_DRAFT
from ..engine.drafters.mtp import MTP
from ..engine.forward import vocab_width
from ..engine.policy import DEFAULT_K
from ..engine.sampling import ParameterError
from ..generation.api import check_tree
from ..generation.options import Options, check_k, make_options
from ..generation.text import chat_text, prompt_ids
from .errors import APIError, bad
from .images import check_reads_images, vision_prompt_of
from .metrics import Metrics
from .tokenizers import PerThread
from .tool_calls import ToolFormat, function_spec, tool_format
from .worker import (
    Done,
    Failed,
    Job,
    Piece,
    QueueFull,
    ShuttingDown,
    Started,
    Worker,
    WorkerDown,
)

INTERNAL = "the server failed to generate this reply (the error is in its log)"
LONG_PROMPT_CHARS = 1 << 16  # prompts longer than this are tokenized one at a time

log = logging.getLogger("tinydraft_mlx.server")


# request field that a library parameter name comes from
_PARAMS = {"k": "num_draft_tokens", "prompt token ids": "prompt", "logit_bias token id":
           "logit_bias", "logit_bias value": "logit_bias"}


def parameter_error(err: ParameterError, renames: dict[str, str] | None = None) -> APIError:
    """A library `ParameterError` as a 400 naming the request's field."""
    renames = renames or {}
    param = renames.get(err.name) or renames.get(_PARAMS.get(err.name, "")) or _PARAMS.get(
        err.name, err.name)
    name = param if err.name in ("k", "max_tokens", "stop", "logprobs") else err.name
    return bad(param, f"{name} must be {err.allowed} (got {err.value!r})")


@dataclass
class Defaults:
    """What a request gets for the fields it leaves out (the server's flags)."""

    k: int | str = DEFAULT_K
    draft: str = MODEL
    max_tokens: int = 512
    temperature: float = 0.0
    tree: int | None = None  # applied to the requests that can verify trees


@dataclass
class Spec:
    """A request in the server's terms, from whichever API. Either `prompt` (text or token ids)
    or `messages` (dicts as the chat template takes them, assistant `tool_calls` with arguments
    as objects); `tools`: function tools in OpenAI's shape ({"type": "function", "function":
    {"name", "description", "parameters"}}); `tool_choice`: None, "auto", "none", "required" or
    a function's name given as {"name": ...}. `prefill`: the start of the reply, written by the
    client (not part of the reply). `fields`: the request's names for ours (e.g.
    {"max_tokens": "max_completion_tokens", "stop": "stop_sequences"}), used in errors."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, str] | None = None
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
    num_draft_tokens: int | str | None = None
    draft: str | None = None
    tree: int | None = None
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    prefill: str = ""
    fields: dict[str, str] = field(default_factory=dict)
    images: list[bytes] = field(default_factory=list)  # each {"type": "image"} part's, in order

    def name(self, ours: str) -> str:
        return self.fields.get(ours, ours)

    def chars(self) -> int:
        """Characters of text the request asks to tokenize (token-id prompts: none)."""
        if self.messages is not None:
            return sum(len(c) if isinstance(c := m.get("content") or "", str) else
                       sum(len(p.get("text") or "") for p in c) for m in self.messages)
        return len(self.prompt) if isinstance(self.prompt, str) else 0


@dataclass
class Plan:
    """A checked request: the job's inputs plus what the reply needs. tool_format: set when the
    reply is parsed for tool calls (of `tools`); forced: text the prompt ends with, as the start
    of the reply (a required tool call's start marker)."""

    prompt: list[int]
    draft: str
    options: Options
    stream: bool
    include_usage: bool
    chat: bool
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_format: ToolFormat | None = None
    forced: str = ""
    vision: Any = None  # a prompt with images: its `VisionPrefill` (prompt: its ids)


class Service:
    """The state behind the routes: the worker, the tokenizer (each thread's own copy:
    tokenizers.py), the served model's name, the defaults and the metrics."""

    def __init__(self, worker: Worker, model_name: str, defaults: Defaults) -> None:
        self.worker, self.model_name, self.defaults = worker, model_name, defaults
        self._tokenizers = PerThread(worker.tokenizer)
        args = getattr(worker.target, "args", None)
        self.context = getattr(args, "max_position_embeddings", None)
        self.vocab = vocab_width(worker.target)
        # the longest token, in characters (byte-level BPE: a vocabulary entry has one character
        # per byte, so none decodes to more): a text longer than limit x this cannot fit
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        self.token_chars = max(map(len, vocab), default=0) or None
        self.metrics = Metrics(worker)
        self._planning = asyncio.Semaphore(1)  # one long prompt's tokenization at a time
        self._planners = 0  # long prompts planning or waiting to

    @property
    def tokenizer(self) -> Any:
        """The calling thread's own tokenizer (never the generation thread's)."""
        return self._tokenizers.get()

    # -- checking --------------------------------------------------------------------------------

    async def plan_off_loop(self, spec: Spec, tokenize: Callable[[Spec], Any] | None = None
                            ) -> Any:
        """`plan(spec)` (or `tokenize(spec)`) on a worker thread. Long prompts (tokenizing 7.5 MB
        takes ~10 s) are planned one at a time, so a few of them cannot take every thread, while
        short ones go straight through; 503 when more long ones than the queue holds are already
        waiting."""
        work = tokenize or self.plan
        if spec.chars() <= LONG_PROMPT_CHARS:
            return await asyncio.to_thread(work, spec)
        if self._planners >= self.worker.max_queue:
            raise busy(f"{self._planners} long prompts are being tokenized or waiting to", 1)
        self._planners += 1
        try:
            async with self._planning:
                return await asyncio.to_thread(work, spec)
        finally:
            self._planners -= 1

    def check_model(self, spec: Spec) -> None:
        if spec.model is not None and spec.model != self.model_name:
            raise APIError(404, f"model {spec.model!r} is not served here; this server serves "
                           f"{self.model_name!r} (GET /v1/models)", param="model",
                           code="model_not_found")

    def plan(self, spec: Spec) -> Plan:
        """Check every field and build the job's inputs; APIError (400/404) for bad input. The
        cheap checks come first, the prompt's tokenization last. (The API layer has checked its
        own fields and the request's strings, `check_unicode`.)"""
        self.check_model(spec)
        draft = self._draft(spec.draft)
        d = self.defaults
        try:
            options = make_options(
                vocab_size=self.vocab,
                k=d.k if spec.num_draft_tokens is None else spec.num_draft_tokens,
                max_tokens=spec.max_tokens,
                temperature=d.temperature if spec.temperature is None else spec.temperature,
                top_p=spec.top_p, top_k=spec.top_k, min_p=spec.min_p, seed=spec.seed,
                stop=spec.stop, presence_penalty=spec.presence_penalty,
                frequency_penalty=spec.frequency_penalty,
                repetition_penalty=spec.repetition_penalty,
                logit_bias=self._logit_bias(spec), logprobs=spec.logprobs,
                bitwise=self.worker.bitwise, tree=spec.tree)
            # checked whatever the draft: a bad value is an error, never ignored
            check_k(options.k, self.worker.max_kv_size if draft != NO_DRAFT else None)
            options = self._tree(spec, draft, options)
        except ParameterError as err:
            raise parameter_error(err, spec.fields) from None
        chat = spec.messages is not None
        tools, fmt, forced = self.tools_for(spec) if chat else ([], None, "")
        ids, own = (self.chat_inputs(spec, tools, spec.prefill + forced) if chat
                    else (self._text_prompt(spec), None))
        options = replace(options, max_tokens=self._max_tokens(len(ids), spec))
        return Plan(ids, draft, options, spec.stream, spec.include_usage, chat, tools, fmt,
                    forced, own)

    def _tree(self, spec: Spec, draft: str, options: Options) -> Options:
        """The request's tree (ParameterError where it cannot verify one), else the server's
        default where the request can verify one (a plain request stays plain)."""
        worker = self.worker
        if spec.tree is None:
            if self.defaults.tree is None:
                return options
            options = replace(options, tree=self.defaults.tree)
        drafter = resolve_drafter(draft, worker.draft, worker.target)
        try:
            check_tree(worker.target, drafter, options, worker.max_kv_size)
        except ParameterError:
            if spec.tree is not None:
                raise
            return replace(options, tree=None)
        return options

    def tools_for(self, spec: Spec) -> tuple[list[dict[str, Any]], ToolFormat | None, str]:
        """(tools shown to the model, the format its calls are parsed with, forced text)."""
        tools, choice = spec.tools or [], spec.tool_choice
        name = spec.name("tool_choice")
        if not tools:
            if choice not in (None, "none", "auto"):
                raise bad(name, f"{name} {choice!r} needs tools")
            return [], None, ""
        if choice == "none":  # the model is not told about them and nothing is parsed
            return [], None, ""
        fmt = tool_format(self.tokenizer)
        if fmt is None:
            raise bad(spec.name("tools"), "this model's chat template has no tool-call format "
                      "(start the server with a --chat-template that renders tools, such as "
                      "the model family's own)")
        names = [function_spec(t).get("name") for t in tools]
        if isinstance(choice, dict):
            wanted = choice.get("name")
            if wanted not in names:
                raise bad(name, f"{name} names the tool {wanted!r}, which is not among the "
                          f"tools ({names})")
            return [tools[names.index(wanted)]], fmt, fmt.start
        return tools, fmt, (fmt.start if choice == "required" else "")

    def chat_prompt(self, spec: Spec, tools: list[dict[str, Any]], after: str = "") -> list[int]:
        """The messages through the chat template (with the tools), then `after`, encoded."""
        return self.chat_inputs(spec, tools, after)[0]

    def chat_inputs(self, spec: Spec, tools: list[dict[str, Any]],
                    after: str = "") -> tuple[list[int], Any]:
        """(`chat_prompt`'s ids, and with images the prompt's `VisionPrefill`, else None)."""
        param = spec.name("messages")
        if spec.images:
            check_reads_images(self.worker.target, param)
        if not spec.messages:
            raise bad(param, f"{param} is required: a non-empty list of messages")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad(param, "this model's tokenizer has no chat template: use "
                      "/v1/completions, or start the server with --chat-template")
        try:
            text = chat_text(self.tokenizer, spec.messages, tools=tools or None)
            if tools and text == chat_text(self.tokenizer, spec.messages):
                name = spec.name("tools")
                raise bad(name, f"this model's chat template does not render tools, so the "
                          f"model would never see them: drop {name}, or start the server "
                          "with a --chat-template that renders them")
            text += after
        except ParameterError as err:
            raise parameter_error(err, spec.fields) from None
        except TemplateError as err:  # the template refused the messages (e.g. role order)
            raise bad(param, f"the chat template refused the messages: {err}") from None
        self._check_length(text, param)
        if spec.images:
            own = vision_prompt_of(self.worker.target, text, spec.images, param)
            return own.prompt.ids, own
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise bad(param, f"the {param} make an empty prompt")
        return ids, None

    def _text_prompt(self, spec: Spec) -> list[int]:
        prompt = spec.prompt
        if prompt is None:
            raise bad("prompt", "prompt is required: a string or a list of token ids")
        if isinstance(prompt, str):
            self._check_length(prompt, "prompt")
        try:
            return prompt_ids(self.tokenizer, prompt, self.vocab)
        except ParameterError as err:
            raise parameter_error(err) from None

    def _max_tokens(self, n: int, spec: Spec) -> int:
        """max_tokens for a prompt of n tokens: the prompt must fit the KV bound or the context,
        and prompt + max_tokens the context (the default is cut to what is left of it)."""
        name, asked = spec.name("max_tokens"), spec.max_tokens
        limit_name, limit = self._context_limit()
        if limit is not None and n >= limit:
            raise bad(spec.name("messages" if spec.messages is not None else "prompt"),
                      f"the prompt has {n} tokens; {limit_name} is {limit}, so it must "
                      f"have at most {limit - 1}", code="context_length_exceeded")
        if asked is None:
            default = self.defaults.max_tokens
            return default if self.context is None else max(1, min(default, self.context - n))
        if self.context is not None and n + asked > self.context:
            raise bad(name, f"the prompt has {n} tokens and {name} is {asked}: {n + asked} in "
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
            raise bad(param, f"the prompt has {len(text)} characters; {limit_name} is {limit} "
                      f"tokens of at most {self.token_chars} characters, so it must have at "
                      f"most {most}", code="context_length_exceeded")

    def _context_limit(self) -> tuple[str, int | None]:
        if self.worker.max_kv_size is not None:
            return "--max-kv-size", self.worker.max_kv_size
        return "the model's context length", self.context

    def draft_choices(self) -> list[str]:
        """The names a request's `draft` may take: every registered drafter these models can
        draft with (engine/drafters/registry.py: "model", "hybrid", "mtp", "eagle3",
        "prompt-lookup", "none", plug-ins), the server's own drafter's first."""
        names = drafter_names(self.worker.draft, self.worker.target)
        own = self.defaults.draft
        return [own] + [n for n in names if n != own] if own in names else names

    def _draft(self, draft: str | None) -> str:
        draft = self.defaults.draft if draft is None else draft
        choices = self.draft_choices()
        if draft not in choices:
            loaded = ("" if MODEL in choices else "; no draft model is loaded") + (
                "" if MTP in choices else f"; the target's MTP layer is not loaded (start the "
                f"server with --draft {MTP} or --mtp)")
            raise bad("draft", f"draft must be one of {choices} (got {draft!r}){loaded}")
        return draft

    def _logit_bias(self, spec: Spec) -> dict[int, float] | None:
        if spec.logit_bias is None:
            return None
        out = {}
        for key, value in spec.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise bad("logit_bias", f"logit_bias keys must be token ids (got {key!r})")\
                    from None
            out[token] = value  # its range and value: `make_options`
        return out

    # -- running ---------------------------------------------------------------------------------

    async def start(self, request: Request, plan: Plan, endpoint: str) -> Generation:
        """Queue the job and wait for it to start. Until the caller stops it (`stop_watching`,
        when an SSE response takes over the connection), a watcher ends the job as soon as the
        client hangs up, whether tokens are flowing or not. APIError when it cannot start;
        ClientGone when the client left first."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(event: Any) -> None:  # called on the worker thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop has closed: nobody is listening
                pass

        job = Job(plan.prompt, plan.draft, plan.options, deliver,  # the engine resolves it
                  prefill=plan.vision)
        try:
            self.worker.submit(job)
        except QueueFull as err:
            raise busy(f"{err}: {self.worker.waiting} requests are waiting (--max-queue)",
                       err.retry_after) from None
        except WorkerDown as err:
            raise APIError(503, str(err), code="worker_down", kind="server_error") from None
        except ShuttingDown:
            raise shutting_down() from None
        watcher = asyncio.create_task(_watch_disconnect(request, job, events))
        gen = Generation(self.metrics, endpoint, plan, job, events, watcher)
        try:
            first = await gen.next()
            if isinstance(first, Failed):
                raise failure(first.error)
            if isinstance(first, Done):  # cancelled before it started (shutdown)
                raise shutting_down()
            assert isinstance(first, Started)
            return gen
        except BaseException:
            gen.close()
            raise

    async def respond(self, request: Request, plan: Plan, endpoint: str,
                      stream: Callable[[Generation], AsyncIterator[bytes]],
                      whole: Callable[[list[Piece], Done], dict[str, Any]]) -> Response:
        """Run the plan and answer in the API's format: `stream(generation)` as server-sent
        events, or `whole(pieces, done)` as one JSON object; 499 when the client left first."""
        try:
            gen = await self.start(request, plan, endpoint)
        except ClientGone:
            return Response(status_code=499)
        if plan.stream:
            gen.stop_watching()  # the SSE response watches its connection from here on
            return EventSourceResponse(stream(gen))
        try:
            pieces, done = await gen.collect()
        except ClientGone:
            return Response(status_code=499)
        finally:
            gen.close()
        return JSONResponse(whole(pieces, done))

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


class ClientGone(Exception):
    """The client hung up before its reply was complete."""


_GONE = object()  # put in a job's event queue when its client hangs up


class Generation:
    """A started job's events, in order, as the API layers read them (`next`, `collect`);
    records the request's metrics as they pass. `close()` whenever the reply ends: it cancels
    the job if it still runs."""

    def __init__(self, metrics: Metrics, endpoint: str, plan: Plan, job: Job,
                 events: asyncio.Queue, watcher: asyncio.Task) -> None:
        self.metrics, self.endpoint, self.plan = metrics, endpoint, plan
        self.job, self.events, self.watcher = job, events, watcher
        self.started = time.perf_counter()
        self._last: float | None = None  # when the latest token came
        self._ended = False

    async def next(self) -> Started | Piece | Done | Failed:
        """The job's next event; ClientGone when its client has hung up."""
        event = await self.events.get()
        if event is _GONE:
            self._end("cancelled")
            raise ClientGone
        now = time.perf_counter()
        if isinstance(event, Piece):
            self.metrics.token(now - (self.started if self._last is None else self._last),
                               first=self._last is None)
            self._last = now
        elif isinstance(event, Done):
            self._end("cancelled" if event.cancelled else "completed", event)
        elif isinstance(event, Failed):
            self._end("failed")
        return event

    async def collect(self) -> tuple[list[Piece], Done]:
        """Every piece, then the Done; APIError when the job failed."""
        pieces: list[Piece] = []
        while True:
            event = await self.next()
            if isinstance(event, Piece):
                pieces.append(event)
            elif isinstance(event, Failed):
                raise failure(event.error)
            elif isinstance(event, Done):
                return pieces, event

    def stop_watching(self) -> None:
        """The SSE response watches its connection from here on."""
        self.watcher.cancel()

    def close(self) -> None:
        self.job.cancelled.set()
        self.watcher.cancel()
        self._end("cancelled")

    def _end(self, outcome: str, done: Done | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        self.metrics.finished(self.endpoint, outcome, len(self.plan.prompt), self.plan.draft,
                              done.stats if done is not None else None)


async def _watch_disconnect(request: Request, job: Job, events: asyncio.Queue) -> None:
    """Wait for the client to hang up (the body has been read, so the next ASGI message is the
    disconnect); then cancel the job, which stops before its next token."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancelled.set()
            events.put_nowait(_GONE)
            return


def busy(message: str, retry_after: int) -> APIError:
    return APIError(503, message, code="server_busy", kind="server_error",
                    headers={"Retry-After": str(retry_after)})


def shutting_down(counted: bool = False) -> APIError:
    return APIError(503, "the server is shutting down", code="shutting_down",
                    kind="server_error", counted=counted)


def failure(error: Exception) -> APIError:
    """The error of a job that ran (its outcome, "failed", is counted already): invalid options
    (a `ParameterError`) are the client's (400); anything else, a `ValueError` from deep inside
    MLX included, is ours: a 500 whose body says nothing of the exception (it is logged)."""
    if isinstance(error, ParameterError):
        err = parameter_error(error)
        err.counted = True
        return err
    if isinstance(error, ShuttingDown):
        return shutting_down(counted=True)
    log.error("generation failed", exc_info=error)
    return APIError(500, INTERNAL, kind="server_error", code="generation_failed", counted=True)


def check_unicode(value: Any, where: str = "") -> None:
    """400 for a string that is not valid Unicode (a lone surrogate such as "\\ud800", which
    JSON can carry but UTF-8 cannot), naming the field it is in."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise bad(where or None, f"{where or 'the request'} is not valid Unicode: "
                      f"{err.reason} at character {err.start} "
                      f"({value[err.start:err.end]!r})") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, where)
            check_unicode(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{where}[{i}]")

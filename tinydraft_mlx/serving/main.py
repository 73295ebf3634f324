"""The server's entry point (`python -m tinydraft_mlx.server`, console script
`tinydraft-mlx-server`; `tinydraft_mlx.server` re-exports it): flags, loading the models, and
uvicorn with the guards of `serving/limits.py`. The app itself (OpenAI's and Anthropic's APIs,
/health, /metrics, the page) is `serving/app.py`.

Generation is exact speculative decoding through the generation API, on one worker thread
(`serving/worker.py`): up to --max-batch requests decode together as one batch of speculative
rounds, more wait in a bounded FIFO (503 with Retry-After beyond it), and recent conversations stay
in a prompt-cache pool (`serving/cache_pool.py`) so a second chat turn prefills only its new
tokens.

Hard to wedge: prompts are tokenized off the event loop (`/health` and the streams keep
flowing), long ones one at a time, after cheap checks that bound the work (fields first; a text
longer than the context could hold is refused untokenized); a client that hangs up, streaming
or not, ends its generation within a round; connections that send no complete request within
`header_timeout` are closed, bodies must arrive within `body_timeout`, at most
`max_connections` are open at once; repeated log records are rate-limited.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import uvicorn
from fastapi import FastAPI

from ..engine.bitwise import refusal as bitwise_refusal
from ..engine.cache import KEEP
from ..engine.drafters import HYBRID, MODEL, resolve_drafter
from ..engine.drafters.lookup import NO_DRAFT
from ..engine.drafters.mtp import head_of
from ..engine.policy import DEFAULT_K
from ..engine.rounds import unbatchable
from ..engine.sampling import ParameterError, SamplingParams, check_int
from ..engine.trees import MAX_TREE
from ..generation.options import MAX_DRAFT_TOKENS, check_k, flag_message
from ..generation.text import read_template
from . import limits
from .app import create_app
from .service import Defaults, Service
from .worker import Worker

__all__ = ["Defaults", "build_app", "create_app", "main", "setup_arg_parser"]

GRACE = 30.0  # seconds running requests may take to finish once the server is told to stop
BACKSTOP = 5  # seconds uvicorn waits beyond GRACE before it cuts connections itself

DEFAULT_BATCH = 16  # --max-batch: measured with bench/server.py (results/README.md)
MAX_BATCH = 256


def setup_arg_parser() -> argparse.ArgumentParser:
    """The server's flags: the CLI's model flags plus host, port, queue and cache sizes."""
    p = argparse.ArgumentParser(prog="tinydraft-mlx-server",
                                description="OpenAI-compatible server with exact speculative "
                                            "decoding on MLX.")
    p.add_argument("--target", "--model", default=None,
                   help="target model: hub id or directory (default: the bundled demo target)")
    p.add_argument("--draft", "--draft-model", default=None,
                   help="draft model, 'mtp' (the target's own MTP layer), 'prompt-lookup' or "
                        "'none' (default: as the CLI)")
    p.add_argument("--mtp", action="store_true",
                   help="also load the target's MTP layer (from its original checkpoint's mtp.* "
                        "tensors), so that requests may send draft \"mtp\" beside the draft model")
    p.add_argument("-k", "--num-draft-tokens", default=DEFAULT_K, dest="k", type=_k_flag,
                   help=f"default draft tokens per round, 1..{MAX_DRAFT_TOKENS} or 'auto' "
                        f"({DEFAULT_K}); requests may set num_draft_tokens")
    p.add_argument("--tree", type=int, default=None, metavar="N",
                   help=f"verify candidate trees of at most N tokens (1..{MAX_TREE}) instead of "
                        "chains, for the requests that can (a drafter, no penalties); requests "
                        "may set tree")
    p.add_argument("--hybrid", action=argparse.BooleanOptionalAction, default=True,
                   help="with a draft model, requests that leave out `draft` draft with it and "
                        "prompt lookup together, each round from whichever has recently given "
                        "more tokens per second (default); --no-hybrid: the model alone")
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
    p.add_argument("--bitwise", action="store_true",
                   help="every target forward carries the same number of positions: greedy "
                        "output is plain greedy decoding's bit for bit on any device; requests "
                        "run one at a time, k <= 8")
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
    p.add_argument("--timeout-graceful-shutdown", type=float, default=GRACE,
                   help="seconds running requests may take to finish after SIGTERM / Ctrl-C; "
                        "waiting ones get a 503 at once, running ones past it an error event "
                        f"({GRACE:g})")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    return p


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _k_flag(value: str) -> int | str:
    """-k as the engine takes it: an int where it is one (checked in `_check_flags`)."""
    return int(value) if value.lstrip("-").isdigit() else value


def _check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    k = args.k
    try:
        check_k(k, bitwise=args.bitwise)
        check_int("--port", args.port, 0, 65535)
        check_int("--max-queue", args.max_queue, 1)
        check_int("--max-batch", args.max_batch, 1, MAX_BATCH)
        check_int("--prompt-cache-bytes", args.prompt_cache_bytes, 0)
        check_int("--max-tokens", args.max_tokens, 1)
        check_int("--max-connections", args.max_connections, 1)
        if args.tree is not None:
            check_int("--tree", args.tree, 1, MAX_TREE)
        if not args.header_timeout > 0:
            raise ParameterError("--header-timeout", "> 0", args.header_timeout)
        if not args.timeout_graceful_shutdown > 0:
            raise ParameterError("--timeout-graceful-shutdown", "> 0",
                                 args.timeout_graceful_shutdown)
        if args.max_kv_size is not None:
            check_int("--max-kv-size", args.max_kv_size, KEEP + 2)
            if (args.draft or "").lower() != NO_DRAFT:
                check_k(k, args.max_kv_size)
        SamplingParams(args.temp, 1.0, 0, 0.0, None)
    except ParameterError as err:
        _fail(parser, flag_message(err))


def build_app(args: argparse.Namespace) -> FastAPI:
    """Load the models named by the flags and make the app (ModelLoadError, ValueError)."""

    from ..generation.loading import DEMO_DIR, load_head, load_models, no_draft_notice

    target, draft, tokenizer = load_models(args.target, args.draft, dtype=args.dtype,
                                           draft_vocab=args.draft_vocab,
                                           draft_vocab_counts=args.draft_vocab_counts)
    if args.draft is None and draft is None:
        print(no_draft_notice(args.target), file=sys.stderr)
    if args.chat_template is not None:
        tokenizer.chat_template = read_template(args.chat_template)
    if args.mtp and head_of(target) is None:  # the target's MTP layer beside the draft
        load_head(target, args.target or DEMO_DIR / "target")
    drafter = resolve_drafter(draft, target=target)
    model, default_draft = drafter.model, drafter.name  # a head is the server's draft too
    if isinstance(args.k, int) and drafter.max_k is not None and args.k > drafter.max_k:
        raise ParameterError("--num-draft-tokens", f"at most {drafter.max_k} with the "
                             f"{drafter.name} drafter", args.k)
    drafter.row_cache(None, args.max_kv_size, 1)  # a drafter that refuses bounded caches says so
    if drafter.name == MODEL and args.hybrid:
        default_draft = HYBRID  # measured with bench/hybrid.py (results/README.md)
    max_batch = args.max_batch
    if args.bitwise:
        if (why := bitwise_refusal(target, args.max_kv_size)) is not None:
            raise ParameterError("--bitwise", why, True)
        if max_batch > 1:
            print("--bitwise: requests run one at a time (--max-batch 1)", file=sys.stderr)
        max_batch = 1
    if max_batch > 1 and (which := unbatchable(target, model)) is not None:
        print(f"the {which} model's layers cannot share a batch (a tensor-parallel target, or "
              "caches of a kind batches do not hold): requests run one at a time "
              "(--max-batch 1)", file=sys.stderr)
        max_batch = 1
    worker = Worker(target, model, tokenizer, max_kv_size=args.max_kv_size,
                    cache_bytes=args.prompt_cache_bytes, max_queue=args.max_queue,
                    max_batch=max_batch, bitwise=args.bitwise)
    name = args.model_name or args.target or "tinydraft-demo"
    defaults = Defaults(k=args.k, draft=default_draft, max_tokens=args.max_tokens,
                        temperature=args.temp, tree=args.tree)
    return create_app(worker, name, defaults)


class Draining(uvicorn.Server):
    """uvicorn's Server, whose stop (SIGINT / SIGTERM) first tells the worker: waiting requests
    get a 503 at once and running ones may finish within `grace` seconds, then end with an
    error event; uvicorn's own grace, a backstop, is BACKSTOP seconds longer (a round in flight
    and the error event's delivery fit in it on a loaded machine), so it never cuts a stream
    itself."""

    def __init__(self, config: uvicorn.Config, worker: Worker, grace: float) -> None:
        super().__init__(config)
        self.worker, self.grace = worker, grace

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.worker.shutdown(self.grace)
        super().handle_exit(sig, frame)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until Ctrl-C / SIGTERM (in-flight requests finish; exit status 0). Run as
    a program (argv None: the command line), the process then ends without the interpreter's
    teardown (see the end of this function); with an explicit argv it returns 0."""
    from ..generation.loading import ModelLoadError

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
    grace = args.timeout_graceful_shutdown
    config = limits.config(app, host=args.host, port=args.port, log_level=args.log_level,
                           header_timeout=args.header_timeout,
                           max_connections=args.max_connections,
                           timeout_graceful_shutdown=math.ceil(grace) + BACKSTOP)
    limits.limit_logs()  # after uvicorn's Config has set its loggers up
    Draining(config, service.worker, grace).run()
    if argv is None:
        # Everything is stopped and flushed by now. A process whose generation thread ran
        # compiled MLX steps aborts now and then in MLX's C++ teardown at exit ("terminate
        # called without an active exception": ~1 run in 10-20 here, MLX 0.32.4; never with the
        # eager forward, never when the main thread generated), so leave without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0

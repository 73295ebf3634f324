"""One model, one generation thread: a bounded FIFO of jobs and the thread that runs them.

MLX evaluates one stream at a time, so a server runs its generations on a single thread, off the
event loop (which keeps serving `/health` and accepting connections). The thread runs up to
`max_batch` jobs at once as the sequences of one `BatchDecoder` (engine/rounds.py), the engine
every generation runs on; with `max_batch` 1 that is its batch of one, on the sequence's own
cache layout (also where the models cannot be batched). A job joins between rounds (its prompt's
prefill chunked between rounds) and leaves when it finishes, is cancelled or fails. A job is a
prompt (token ids), its checked `Options` and a `deliver` callback; the thread sends it a
`Started`, then a `Piece` per token, then `Done` (or `Failed`). Setting `job.cancelled` (a client
hung up) stops the generation before its next token or prefill chunk, i.e. within one round; the
caches keep exactly prompt + the tokens emitted and go back to the prompt-cache pool.

Nothing a job does ends the thread: every error is reported to that job (and logged), and the
thread takes the next one. `alive` says whether the thread runs; `submit` refuses jobs
(`WorkerDown`) when it does not, so no request waits for a thread that is gone.

Knows nothing about HTTP.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..engine.forward import PREFILL_STEP
from ..engine.rounds import BatchDecoder, Token
from ..engine.stats import GenerationStats
from ..generation.api import prepare
from ..generation.batching import drain, record_caches
from ..generation.options import Options
from ..generation.prompt_cache import MARGIN, PromptCache
from ..generation.text import GenerationResponse, responses
from .cache_pool import PromptCachePool

log = logging.getLogger("tinydraft_mlx.worker")
# prompt tokens a joining request prefills between two rounds of the running batch, which bounds
# the pause it puts in the others' streams: demo pair, a 3.9k-token prompt joining, longest gap
# between another stream's chunks 746-765 ms with 512, 217 ms with 128, 159 ms with 64 (which
# costs the joiner twice the rounds of 128)
JOIN_PREFILL_STEP = 128


@dataclass
class Started:
    """The options were valid and generation has begun."""


@dataclass
class Piece:
    """One generated token in plain Python values. logprob: the target's log-probability of
    `token`; top_logprobs: the n most likely (token id, log-probability), most likely first; both
    None unless the job asked for logprobs; stop_string: the stop string that ended the
    generation at this token."""

    text: str
    token: int
    from_draft: bool
    finish_reason: str | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    stop_string: str | None = None


@dataclass
class Done:
    """The generation ended: finished, or cancelled (`cancelled`, stats of what ran; None when it
    never started)."""

    stats: GenerationStats | None
    cancelled: bool = False


@dataclass
class Failed:
    """The job failed: a `ParameterError`/`ValueError` for invalid options, anything else is a
    server error."""

    error: Exception


Event = Started | Piece | Done | Failed


@dataclass
class Job:
    """A generation request. prompt: token ids; draft: as `stream_generate` takes it; options:
    the checked `Options` (their `logprobs`: None, or how many top alternatives to report with
    each token's log-probability, 0 = only the token's)."""

    prompt: list[int]
    draft: Any
    options: Options
    deliver: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    prefill: Any = None  # a prompt with images: its `VisionPrefill` (prompt: its ids)


class QueueFull(Exception):
    """The queue of waiting jobs is full; `retry_after` estimates when to try again (seconds)."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy; retry in {retry_after} s")
        self.retry_after = retry_after


class WorkerDown(Exception):
    """The generation thread is not running: nothing submitted now would be served."""


class ShuttingDown(Exception):
    """The server is stopping: a job that had not started (or ran past the grace) ends so."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down")


class Worker:
    """The generation thread, its bounded queue (`max_queue` waiting jobs) and its prompt-cache
    pool (`cache_bytes`; caches bounded by `max_kv_size` when given). `bitwise`: every
    generation in the bit-for-bit mode (engine/bitwise.py; one at a time, max_batch 1)."""

    def __init__(self, target: nn.Module, draft: nn.Module | None, tokenizer: Any, *,
                 max_kv_size: int | None = None, cache_bytes: int = 1 << 30,
                 max_queue: int = 32, max_batch: int = 1, bitwise: bool = False) -> None:
        for name, value in (("max_queue", max_queue), ("max_batch", max_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        if bitwise and max_batch != 1:
            raise ValueError(f"max_batch must be 1 with bitwise (got {max_batch})")
        self.max_batch, self.bitwise = max_batch, bitwise
        self.live: dict[int, _Live] = {}  # uid -> the batch's jobs
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.max_kv_size = max_kv_size
        self.pool = PromptCachePool(
            lambda: PromptCache(target, draft, max_kv_size=max_kv_size), cache_bytes)
        self.max_queue = max_queue
        self.counts: Counter[str] = Counter()  # completed, cancelled, failed
        self.errors = 0  # errors the thread caught outside a job's generation (logged)
        self.running = False
        self.cache_info = (0, 0)  # (caches, bytes) in the pool after the latest job
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._seconds = 1.0  # running mean of a job's duration, for Retry-After
        self._stopping = False
        self._deadline: float | None = None  # shutting down: running jobs end by then
        self._thread = threading.Thread(target=self._run, name="tinydraft-generation",
                                        daemon=True)

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def batch(self) -> int:
        """Generations running now."""
        return len(self.live)

    @property
    def alive(self) -> bool:
        """Whether the generation thread is running."""
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job` (FIFO); QueueFull when `max_queue` jobs are already waiting, WorkerDown
        when the generation thread is not running, ShuttingDown once `shutdown` began."""
        if not self.alive:
            raise WorkerDown("the generation thread is not running; restart the server")
        if self._deadline is not None:
            raise ShuttingDown()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            wait = self._seconds * (self._queue.qsize() + 1)
            raise QueueFull(max(1, round(wait))) from None

    def shutdown(self, grace: float) -> None:
        """Begin stopping (from any thread): new jobs are refused, waiting ones end at once with
        `Failed(ShuttingDown())`, running ones may finish within `grace` seconds and then end
        the same way (a stream gets its error event instead of being cut)."""
        self._deadline = time.monotonic() + max(0.0, grace)
        for job in self._waiting():
            self._turn_away(job)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Cancel the waiting jobs and the running ones (each gets its `Done(cancelled=True)`
        within a round), end the thread."""
        self._stopping = True
        for job in self._waiting():
            job.cancelled.set()
            job.deliver(Done(None, cancelled=True))
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _turn_away(self, job: Job) -> None:
        """A waiting job that will not start: the server is shutting down."""
        self.counts["cancelled"] += 1
        _deliver(job, Failed(ShuttingDown()))

    def _waiting(self) -> list[Job]:
        """The waiting jobs, taken out of the queue."""
        jobs = []
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return jobs
            if job is not None:
                jobs.append(job)

    def _run(self) -> None:
        """Up to max_batch jobs as one batch: admit waiting jobs between rounds, run a round,
        hand every job its tokens, let finished, cancelled and failed jobs leave."""
        decoder = self._decoder()
        while True:
            try:
                stop = self._stopping or self._admit_waiting(decoder)
                if stop:
                    for uid in list(self.live):
                        self._leave(decoder, uid, Done(self.live[uid].stats, cancelled=True),
                                    "cancelled")
                    return
                if not self.live:
                    continue
                self.running = True
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    for uid in list(self.live):
                        self._leave(decoder, uid, Failed(ShuttingDown()), "cancelled")
                    continue
                for uid in [u for u, live in self.live.items() if live.job.cancelled.is_set()]:
                    self._leave(decoder, uid, Done(self.live[uid].stats, cancelled=True),
                                "cancelled")
                if not self.live:
                    continue
                try:
                    out = decoder.step()
                except Exception as err:  # inside the batched round: every job in it fails
                    log.error("a batched round failed; its jobs fail", exc_info=err)
                    self.errors += 1
                    for uid in list(self.live):
                        self._leave(decoder, uid, Failed(err), "failed", pool=False)
                    decoder = self._decoder()  # a fresh batch: nothing half-updated is reused
                    continue
                for uid, tokens in out.items():
                    self._hand(decoder, uid, tokens)
            except Exception as err:  # a bug outside the jobs: logged, the thread goes on
                self.errors += 1
                log.error("the generation thread caught an error", exc_info=err)
            finally:
                self.running = bool(self.live)
                self.cache_info = (len(self.pool), self.pool.nbytes)

    def _decoder(self) -> BatchDecoder:
        single = self.max_batch == 1  # one sequence at a time, on its prompt cache's own layout
        return BatchDecoder(self.target, self.draft, max_kv_size=self.max_kv_size,
                            max_k=MARGIN - 1,  # the row layout of the pool's bounded caches
                            prefill_step=PREFILL_STEP if single else JOIN_PREFILL_STEP,
                            single=single, bitwise=self.bitwise)

    def _admit_waiting(self, decoder: BatchDecoder) -> bool:
        """Take waiting jobs into the batch (blocking while it is empty); True on stop."""
        while len(self.live) < self.max_batch:
            try:
                job = self._queue.get(block=not self.live)
            except queue.Empty:
                return False
            if job is None:
                return True
            try:
                self._join(decoder, job)
            except Exception as err:  # this job fails, not the batch
                self.counts["failed"] += 1
                _deliver(job, Failed(err))
        return False

    def _join(self, decoder: BatchDecoder, job: Job) -> None:
        if job.cancelled.is_set():  # its client left while it waited
            job.deliver(Done(None, cancelled=True))
            self.counts["cancelled"] += 1
            return
        if self._deadline is not None:  # taken from the queue as the shutdown began
            self._turn_away(job)
            return
        plan = prepare(self.target, job.draft, self.tokenizer, job.prompt, job.options,
                       model=self.draft, own=job.prefill)
        pc = self.pool.take(plan.cache_key, plan.reusable)
        pc.check_free()
        pc.in_use = True
        try:
            pc.reuse(plan.cache_key, plan.reusable)
            uid = decoder.insert(plan.ids, draft=plan.drafter, k=plan.options.k,
                                 max_tokens=plan.options.max_tokens,
                                 sampling=plan.sampling, eos_token_ids=plan.eos,
                                 logits_processors=plan.processors,
                                 target_cache=pc.target_cache,
                                 draft_cache=pc.draft_cache if pc.drafts_for(plan.drafter)
                                 else None,
                                 logprobs=job.options.logprobs is not None, keep_caches=True,
                                 tree=plan.options.tree, prefill=plan.prefill)
        except Exception:
            pc.in_use = False
            raise
        try:
            feed: deque[Token] = deque()
            text = responses(drain(feed), self.tokenizer, plan.options.stop, plan.eos)
            self.live[uid] = _Live(job, plan, pc, feed, text, time.perf_counter())
            job.deliver(Started())
        except Exception:  # in the decoder but not served: out again, its cache free
            self.live.pop(uid, None)
            decoder.remove(uid)
            pc.in_use = False
            raise

    def _hand(self, decoder: BatchDecoder, uid: int, tokens: list[Token]) -> None:
        """A job's new tokens through its text layer (detokenizer, stop strings) to its client;
        its end, or a failure of its own, takes it out of the batch."""
        live = self.live.get(uid)
        if live is None:  # a sequence no job owns (an invariant broken): out of the batch
            log.error("tokens for a sequence no job owns; it leaves the batch")
            decoder.remove(uid)
            return
        try:
            live.feed.extend(tokens)
            for _ in tokens:
                response = next(live.text)
                live.emitted.append(response.token)
                live.stats = response.stats
                live.job.deliver(_piece(response, live.job.options.logprobs))
                if response.finish_reason is not None:
                    self._leave(decoder, uid, Done(response.stats), "completed")
                    return
        except Exception as err:  # this job's failure: the others go on
            log.error("a job failed during its generation", exc_info=err)
            self._leave(decoder, uid, Failed(err), "failed")

    def _leave(self, decoder: BatchDecoder, uid: int, event: Event, outcome: str,
               pool: bool = True) -> None:
        """Take a job out of the batch: its caches cut to what was emitted and back in the
        pool (unless the batch itself failed), its last event delivered, counted."""
        live = self.live.pop(uid)
        pc = live.pc
        try:
            done = decoder.remove(uid, keep=len(live.emitted)) if pool else None
            pool = record_caches(pc, done, live.plan.cache_key, live.emitted,
                                 live.plan.drafter)
        except Exception as err:
            self.errors += 1
            log.error("taking a job out of the batch failed; its cache is dropped",
                      exc_info=err)
            pool = False
        finally:
            pc.in_use = False
        if pool:
            self.pool.put(pc)
        if isinstance(event, Done) and event.stats is None:
            event.stats = live.stats
        _deliver(live.job, event)
        self.counts[outcome] += 1
        self._seconds = 0.8 * self._seconds + 0.2 * (time.perf_counter() - live.start)


@dataclass
class _Live:
    """A job in the batch: its checked plan, prompt cache, token feed and text layer."""

    job: Job
    plan: Any
    pc: PromptCache
    feed: deque
    text: Any
    start: float
    emitted: list[int] = field(default_factory=list)
    stats: GenerationStats | None = None


def _deliver(job: Job, event: Event) -> None:
    try:
        job.deliver(event)
    except Exception as err:  # the listener is broken; nothing more to tell it
        log.error("delivering an event failed", exc_info=err)


def _piece(response: GenerationResponse, logprobs: int | None) -> Piece:
    piece = Piece(response.text, response.token, response.from_draft, response.finish_reason,
                  stop_string=response.stop_string)
    if logprobs is not None and response.logprobs is not None:
        row = response.logprobs.astype(mx.float32)  # (vocab,)
        piece.logprob = row[response.token].item()
        if logprobs > 0:
            top = mx.argpartition(-row, kth=logprobs - 1)[:logprobs]
            values = row[top].tolist()
            piece.top_logprobs = sorted(zip(top.tolist(), values), key=lambda p: -p[1])
    return piece

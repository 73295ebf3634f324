"""The server under abuse, through HTTP: a broken generation thread, errors from deep inside,
text that is not Unicode, clients that hang up, huge prompts, half-open connections, log storms.
Each test failed on the server as it was before its fix (see the hardening issue's list).

Servers run in this process on 127.0.0.1 (`Served`, with the real uvicorn settings from
`tinydraft_mlx.serving.limits`); every request loop is bounded.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest

from tests.test_server import TEMPLATE, Served
from tinydraft_mlx import load_models, stream_generate
from tinydraft_mlx.server import Defaults, create_app
from tinydraft_mlx.serving import worker as worker_module
from tinydraft_mlx.serving.limits import RepeatFilter
from tinydraft_mlx.serving.worker import Worker

# several tests bound how long the server takes to answer or to close: run alone
pytestmark = pytest.mark.serial

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def models():
    target, draft, tokenizer = load_models()
    tokenizer.chat_template = TEMPLATE
    return target, draft, tokenizer


def _serve(models, **kwargs) -> tuple[Served, Worker]:
    target, draft, tokenizer = models
    worker = Worker(target, draft, tokenizer, cache_bytes=32 << 20, max_queue=4)
    app_kwargs = {k: kwargs.pop(k) for k in ("max_body_bytes", "body_timeout") if k in kwargs}
    return Served(create_app(worker, "demo", Defaults(k=3, max_tokens=16), **app_kwargs),
                  **kwargs), worker


@pytest.fixture(scope="module")
def served(models):
    s, _ = _serve(models)
    yield s
    s.close()


def _plain(models, prompt: str, n: int) -> str:
    target, _, tokenizer = models
    return "".join(r.text for r in stream_generate(target, None, tokenizer, prompt,
                                                   max_tokens=n))


def test_an_error_outside_the_generation_fails_that_request_only(models, monkeypatch):
    """`pool.take` raising used to kill the generation thread: every later request hung while
    /health said ok. Now that request gets a 500, the thread goes on, the next one is exact."""
    s, worker = _serve(models)
    try:
        original = worker.pool.take
        calls = {"n": 0}

        def take(prompt, cap=None):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("pool exploded")
            return original(prompt, cap)

        monkeypatch.setattr(worker.pool, "take", take)
        r = httpx.post(s.url + COMPLETIONS, json={"prompt": "def main():\n"}, timeout=30)
        assert r.status_code == 500 and "pool exploded" not in r.text
        assert r.json()["error"]["type"] == "server_error"
        r = httpx.post(s.url + COMPLETIONS, json={"prompt": "def main():\n", "max_tokens": 16},
                       timeout=30)
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == _plain(models, "def main():\n", 16)
        health = s.health()
        assert health["worker"]["alive"] and health["requests"]["failed"] == 1
    finally:
        s.close()


def test_a_job_that_fails_after_joining_the_batch_leaves_it(models, monkeypatch):
    """A job whose sequence went into the batch but whose text layer then failed used to stay
    in the decoder without its job: every later round raised KeyError, the batch counted it
    against max_batch, and its prompt cache stayed in use. Now that request gets a 500, the
    decoder holds nothing of it, no cache stays in use, and the next requests are exact."""
    s, worker = _serve(models)
    try:
        original = worker_module.responses
        calls = {"n": 0}

        def responses(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("text layer exploded")
            return original(*args, **kwargs)

        monkeypatch.setattr(worker_module, "responses", responses)
        r = httpx.post(s.url + COMPLETIONS, json={"prompt": "def main():\n"}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        for _ in range(2):
            r = httpx.post(s.url + COMPLETIONS, json={"prompt": "def main():\n",
                                                      "max_tokens": 16}, timeout=30)
            assert r.status_code == 200
            assert r.json()["choices"][0]["text"] == _plain(models, "def main():\n", 16)
        assert worker.errors == 0 and not worker.live
        assert not any(pc.in_use for pc in worker.pool)
    finally:
        s.close()


class _OneThreadAtATime:
    """A tokenizer that fails as a fast tokenizer's borrow checker may ("Already borrowed") when
    a second thread calls it while one is inside it; each call holds it a millisecond."""

    GUARDED = ("encode", "decode", "apply_chat_template")

    def __init__(self, inner) -> None:
        self._inner, self._inside, self._lock = inner, 0, threading.Lock()

    def __deepcopy__(self, memo):
        import copy

        return _OneThreadAtATime(copy.deepcopy(self._inner, memo))

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if name not in self.GUARDED:
            return value

        def guarded(*args, **kwargs):
            with self._lock:
                if self._inside:
                    raise RuntimeError("Already borrowed")
                self._inside += 1
            try:
                time.sleep(0.001)
                return value(*args, **kwargs)
            finally:
                with self._lock:
                    self._inside -= 1

        return guarded


def test_requests_are_tokenized_while_streams_are_detokenized(models):
    """Requests are tokenized on the event loop's threads (several at once) while the generation
    thread detokenizes the running streams: with a tokenizer that fails when two threads are
    inside it at once, 24 concurrent requests (8 at a time, batched) all complete with plain
    decoding's text."""
    from concurrent.futures import ThreadPoolExecutor

    target, draft, tokenizer = models
    worker = Worker(target, draft, _OneThreadAtATime(tokenizer), cache_bytes=32 << 20,
                    max_queue=32, max_batch=8)
    s = Served(create_app(worker, "demo", Defaults(k=3, max_tokens=12)))
    prompts = [f"def f{i}(x):\n    return x + {i}\n" * 3 for i in range(24)]
    try:
        def ask(prompt):
            r = httpx.post(s.url + COMPLETIONS, json={"prompt": prompt, "max_tokens": 12},
                           timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(ask, prompts))
        assert texts[:3] == [_plain(models, p, 12) for p in prompts[:3]]
        assert worker.counts["completed"] == 24
    finally:
        s.close()


def test_health_says_when_the_generation_thread_is_gone(models):
    """A dead generation thread: /health answers 503 with status "error", and a request gets a
    503 at once instead of waiting forever."""
    s, worker = _serve(models)
    try:
        worker._queue.put(None)  # the thread's stop signal: it ends
        worker._thread.join(10)
        r = httpx.get(s.url + "/health", timeout=10)
        assert r.status_code == 503
        assert r.json()["status"] == "error" and r.json()["worker"]["alive"] is False
        start = time.monotonic()
        r = httpx.post(s.url + COMPLETIONS, json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_down"
        assert time.monotonic() - start < 2
    finally:
        s.close()


def test_a_value_error_from_inside_is_a_logged_500(served, monkeypatch, caplog):
    """MLX raises ValueError for internal shape errors: that is the server's failure (500,
    logged), not the client's (it was a 400 invalid_request_error, unlogged); its body does not
    carry the exception's text (it did)."""
    def broken(*args, **kwargs):
        raise ValueError("[matmul] Last dimension of first input with shape (1,3,64) must match")

    monkeypatch.setattr(worker_module, "prepare", broken)
    with caplog.at_level(logging.ERROR, logger="tinydraft_mlx.server"):
        r = httpx.post(served.url + COMPLETIONS, json={"prompt": "x"}, timeout=30)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "server_error"
    assert r.json()["error"]["code"] == "generation_failed"
    assert "matmul" not in r.text and "ValueError" not in r.text
    assert any("generation failed" in rec.getMessage() and rec.exc_info for rec in caplog.records)


@pytest.mark.parametrize("endpoint,body,param", [
    (COMPLETIONS, '{"prompt": "abc\\ud800def"}', "prompt"),
    (COMPLETIONS, '{"prompt": "abc", "stop": ["\\udfff"]}', "stop[0]"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', "messages[0].content"),
    (CHAT, '{"messages": [{"role": "us\\ud800er", "content": "hi"}]}', "messages[0].role"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(served, endpoint, body, param):
    """JSON may carry a lone surrogate, UTF-8 cannot: it was a 500 with a plain-text body (the
    tokenizer's TypeError escaped)."""
    r = httpx.post(served.url + endpoint, content=body.encode(),
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "not valid Unicode" in error["message"]


def test_bad_json_without_a_content_type_is_invalid_json(served, models):
    r = httpx.post(served.url + COMPLETIONS, content=b'{"prompt": ', timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(served.url + COMPLETIONS, content=b"prompt=x", timeout=10,
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(served.url + COMPLETIONS, content=b'{"prompt": "import os\\n", '
                   b'"max_tokens": 8}', timeout=30)  # no Content-Type: read as JSON
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == _plain(models, "import os\n", 8)


def _wait(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, what
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_non_streaming_client_that_hangs_up_ends_its_generation(served, models):
    """3000 tokens asked (~10 s), the client leaves after 0.5 s: the generation stops within a
    round (it ran to max_tokens and was counted "completed", 6 of 6 tries), and the next request
    on the same prompt is exact."""
    served.wait_idle()
    before = served.health()["requests"].get("cancelled", 0)
    body = json.dumps({"prompt": "def parse_args(", "max_tokens": 3000}).encode()
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        _wait(lambda: served.health()["running"], 10, "the generation did not start")
        time.sleep(0.5)
    gone = time.monotonic()
    served.wait_idle(timeout=3.0)
    assert time.monotonic() - gone < 3.0
    assert served.health()["requests"]["cancelled"] == before + 1
    r = httpx.post(served.url + COMPLETIONS, json={"prompt": "def parse_args(",
                                                   "max_tokens": 16}, timeout=30)
    assert r.json()["choices"][0]["text"] == _plain(models, "def parse_args(", 16)


def test_a_long_tokenization_does_not_stall_the_event_loop(served, models, monkeypatch):
    """Tokenizing a 7.5 MB prompt took ~10 s on the event loop: /health and every stream
    stalled. Tokenization (here a long prompt's made to take 2 s) now runs on a thread: /health
    answers, and a short request is served, in under a second or two meanwhile."""
    _, _, tokenizer = models
    kind = type(tokenizer._tokenizer)  # what the wrapper delegates to, in every thread's copy
    original = kind.encode
    slow = threading.Event()

    def encode(self, text, *args, **kwargs):
        if text.startswith("SLOW"):
            slow.set()
            time.sleep(2.0)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(kind, "encode", encode)
    result = {}
    long_prompt = "SLOW " + "def f(x):\n    return x\n" * 3000  # 69k characters: a long one
    thread = threading.Thread(target=lambda: result.update(r=httpx.post(
        served.url + COMPLETIONS, json={"prompt": long_prompt, "max_tokens": 4}, timeout=30)))
    thread.start()
    assert slow.wait(10)
    start = time.monotonic()
    r = httpx.get(served.url + "/health", timeout=10)
    assert r.status_code == 200 and time.monotonic() - start < 1.0
    # a short prompt is not held up behind the long one's tokenization
    r = httpx.post(served.url + COMPLETIONS, json={"prompt": "import os\n", "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 200 and time.monotonic() - start < 1.5
    thread.join(30)
    assert result["r"].status_code == 400  # 4096 positions cannot hold it: refused, after 2 s
    assert result["r"].json()["error"]["code"] == "context_length_exceeded"


def test_a_prompt_too_long_for_the_context_is_refused_untokenized(models):
    """A 7.5 MB text cannot fit 4096 tokens of at most 40 characters: refused at once, before
    any tokenization (the body limit raised to let it in)."""
    s, _ = _serve(models, max_body_bytes=16 << 20)
    try:
        start = time.monotonic()
        r = httpx.post(s.url + COMPLETIONS, json={"prompt": "def f(x):\n" * 750_000},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "7500000 characters" in r.json()["error"]["message"]
        assert time.monotonic() - start < 3  # tokenizing it alone takes ~10 s
    finally:
        s.close()


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""  # an orderly close
    except ConnectionResetError:  # closed with our unread request bytes still in its buffer
        return True
    except TimeoutError:
        return False


def test_half_open_connections_are_closed_and_capped(models):
    """Connections that never finish their headers used to be kept forever (2200 exhausted the
    file descriptors). Here: the ones beyond the cap (8) are closed at once, the rest after the
    header timeout (0.5 s); then the server answers as before."""
    s, _ = _serve(models, header_timeout=0.5, max_connections=8)
    socks = []
    try:
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", s.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            sock.settimeout(3.0)
            socks.append(sock)
        start = time.monotonic()
        closed = [_closed_by_server(sock) for sock in socks]
        assert all(closed) and time.monotonic() - start < 2.5
        assert s.health()["status"] == "ok"
    finally:
        for sock in socks:
            sock.close()
        s.close()


def test_a_body_that_does_not_arrive_in_time_is_a_408(models):
    s, _ = _serve(models, body_timeout=0.5)
    try:
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
            sock.settimeout(5.0)
            reply = b""
            while b"request_timeout" not in reply:  # the head and the body may come apart
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply
    finally:
        s.close()


def test_repeated_log_records_are_rate_limited():
    """The same error a thousand times: `burst` of them are logged, the rest counted and said
    once when the window has passed (a storm of tracebacks wrote 208 MB in 30 s)."""
    logger = logging.getLogger("tests.repeat")
    logger.propagate = False
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger.addHandler(Keep())
    rate = RepeatFilter(burst=5, window=0.3)
    logger.addFilter(rate)
    for _ in range(1000):
        logger.error("accept failed: %s", "Too many open files")
    logger.error("something else")
    assert len(records) == 6
    time.sleep(0.35)
    logger.error("accept failed: %s", "Too many open files")
    assert records[-1] == ("accept failed: Too many open files (995 more like this were not "
                           "logged)")


HOSTILE = [  # (field, value): each can never succeed, whatever the server's load
    ("repetition_penalty", 0), ("repetition_penalty", -1), ("presence_penalty", 1e300),
    ("frequency_penalty", -1e300), ("logit_bias", {"5": 1e39}), ("logit_bias", {"5": 1e12}),
]


def test_hostile_options_are_refused_before_the_queue_and_counted_once(models, monkeypatch):
    """Penalties and logit_bias values out of range used to be checked on the generation thread:
    the request waited for a slot before its 400, got a 503 with Retry-After when the queue was
    full, and was counted "failed" and "rejected". Now: a 400 naming the field and the range,
    nothing submitted, one "rejected", nothing "failed", /health's counts unchanged."""
    from tests.test_server_agents import scrape

    s, worker = _serve(models)
    try:
        submitted = []
        monkeypatch.setattr(worker, "submit", lambda job: submitted.append(job) or (
            _ for _ in ()).throw(AssertionError("a hostile request reached the queue")))
        before = scrape(s)
        for field, value in HOSTILE:
            r = httpx.post(s.url + COMPLETIONS, timeout=30,
                           json={"prompt": "def f(", "max_tokens": 4, field: value})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == field, (field, r.text)
            assert "must be a number in [" in error["message"], error
            assert repr(value if not isinstance(value, dict) else value["5"]) in error["message"]
        after = scrape(s)
        key = ("tinydraft_requests_total", (("endpoint", "completions"), ("outcome", "rejected")))
        assert after[key] - before.get(key, 0) == len(HOSTILE)
        failed = ("tinydraft_requests_total", (("endpoint", "completions"), ("outcome", "failed")))
        assert after.get(failed, 0) == before.get(failed, 0)
        assert not submitted
        assert httpx.get(s.url + "/health", timeout=10).json()["requests"].get("failed", 0) == 0
    finally:
        s.close()


def test_anthropic_temperature_and_tool_use_input_are_checked_as_anthropic_says(served):
    """Anthropic's temperature is in [0, 1] (2.5 used to pass); a tool_use block whose input is
    not an object used to be refused with pydantic's words about the string branch of a union."""
    url = served.url + "/v1/messages"
    r = httpx.post(url, timeout=30, json={"model": "demo", "max_tokens": 4, "temperature": 2.5,
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "temperature must be a number in [0, 1] (got 2.5)" in r.json()["error"]["message"]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                   "name": "f", "input": "not an object"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": "ok"}]}]
    r = httpx.post(url, timeout=30, json={"model": "demo", "max_tokens": 4,
                                          "messages": messages})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "messages[1].content[0].input" in message and "must be an object" in message
    assert "valid string" not in message


def _job(prompt: list[int], draft, max_tokens: int) -> tuple:
    from tinydraft_mlx import make_options
    from tinydraft_mlx.serving.worker import Job

    events, started = [], threading.Event()

    def deliver(event) -> None:
        events.append(event)
        if not isinstance(event, worker_module.Started):
            started.set()

    return Job(prompt, draft, make_options(k=2, max_tokens=max_tokens), deliver), events, started


@pytest.mark.parametrize("max_batch", [1, 2])
def test_stop_cancels_the_running_jobs(models, max_batch):
    """`Worker.stop` said it cancels running jobs, but with one job at a time the running one
    went on to its end (here: a million tokens). Now it ends within a round with
    Done(cancelled=True), and the thread ends."""
    target, draft, tokenizer = models
    worker = Worker(target, draft, tokenizer, cache_bytes=32 << 20, max_batch=max_batch)
    worker.start()
    job, events, going = _job(tokenizer.encode("def main():"), draft, 10**6)
    worker.submit(job)
    assert going.wait(60)  # it has produced its first token
    start = time.perf_counter()
    worker.stop(timeout=20)
    assert not worker.alive and time.perf_counter() - start < 20
    assert isinstance(events[-1], worker_module.Done) and events[-1].cancelled
    assert len([e for e in events if isinstance(e, worker_module.Piece)]) < 10**4


def test_a_long_prefill_is_cancelled_between_chunks_one_at_a_time(models, monkeypatch):
    """With one job at a time a client that hung up during a long prompt's prefill was only
    noticed after the whole prefill (minutes for a long prompt on a CPU). Now the prefill runs
    in chunks between rounds and stops at the first chunk after the cancel."""
    from tinydraft_mlx.engine import rounds

    target, draft, tokenizer = models
    worker = Worker(target, draft, tokenizer, cache_bytes=32 << 20, max_batch=1)
    worker.start()
    chunks = []
    real = rounds.prefill
    prompt = list(range(5, 5 + 4 * rounds.PREFILL_STEP + 10))  # five target chunks
    job, events, _ = _job(prompt, draft, 4)

    def counted(model, cache, tokens, **kwargs):
        if model is target:
            chunks.append(len(tokens))
            job.cancelled.set()  # the client hangs up during the first chunk
        return real(model, cache, tokens, **kwargs)

    monkeypatch.setattr(rounds, "prefill", counted)
    try:
        worker.submit(job)
        deadline = time.monotonic() + 60
        while not (events and isinstance(events[-1], worker_module.Done)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert events[-1].cancelled
        assert not any(isinstance(e, worker_module.Piece) for e in events)
        assert len(chunks) == 1 and chunks[0] <= rounds.PREFILL_STEP
    finally:
        worker.stop()

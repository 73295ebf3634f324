"""The server command, `python -m tinydraft_mlx.server`: a subprocess on the bundled demo pair
starts, serves a stream and stops cleanly on SIGTERM; its flags pick the draft and are checked
(a one-line error, exit 2) before the models load where they can be."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

# the shutdown tests bound how long a signal takes to be answered: run alone
pytestmark = pytest.mark.serial

COMPLETIONS = "/v1/completions"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(*flags: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "tinydraft_mlx.server", "--port", str(port),
                             "--log-level", "warning", *flags], env=env,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def test_server_command_serves_and_stops_cleanly_on_sigterm():
    """`python -m tinydraft_mlx.server` starts on the demo pair; SIGTERM while a stream is in
    flight: the stream completes with [DONE] and the process exits 0."""
    proc, url = _start_server()
    try:
        body = {"prompt": "def parse_args(", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        chunks = [json.loads(x[6:]) for x in [first] + rest if x != "data: [DONE]"]
        assert rest[-1] == "data: [DONE]" and len(chunks) == 200
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_with_a_full_queue_answers_every_request():
    """SIGTERM while one stream runs (one at a time) and two requests wait: the waiting ones
    get the API's JSON 503 ("shutting_down") at once, the stream that outlasts the grace (2 s)
    ends with an error event and [DONE] instead of being cut, and the process exits 0 with no
    traceback in its log."""
    from concurrent.futures import ThreadPoolExecutor

    proc, url = _start_server("--max-batch", "1", "--max-queue", "4",
                              "--timeout-graceful-shutdown", "2", "--draft", "none")
    try:
        # EOS (id 0) forbidden and a budget near the context: the stream can only end by the
        # grace, whatever the sample or the machine's speed.
        body = {"prompt": "def parse_args(", "max_tokens": 4000, "stream": True,
                "temperature": 0.8, "logit_bias": {"0": -100}}
        with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=60) as r, \
                ThreadPoolExecutor(2) as pool:
            lines = r.iter_lines()
            next(lines)
            waiting = [pool.submit(httpx.post, url + COMPLETIONS, timeout=60,
                                   json={"prompt": f"x{i}", "max_tokens": 8}) for i in range(2)]
            deadline = time.monotonic() + 30
            while httpx.get(url + "/health", timeout=5).json()["waiting"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            for future in waiting:
                answer = future.result()
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "shutting_down"
            assert time.monotonic() - sent < 1.5
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])
        assert error.get("error", {}).get("code") == "shutting_down", rest[-2]
        assert proc.wait(30) == 0
        log = proc.stderr.read()
        assert "Traceback" not in log and "CancelledError" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_server_drafts_hybrid_by_default_with_a_draft_model():
    from tinydraft_mlx.server import build_app, setup_arg_parser

    for argv, draft in [([], "hybrid"), (["--no-hybrid"], "model"),
                        (["--draft", "prompt-lookup"], "prompt-lookup"),
                        (["--draft", "none"], "none")]:
        app = build_app(setup_arg_parser().parse_args(argv))
        assert app.state.service.defaults.draft == draft, argv


@pytest.mark.parametrize("argv, draft", [
    ([], "hybrid"), (["--no-hybrid"], "model"), (["--draft", "mtp"], "mtp"),
    (["--draft", "tinydraft_mlx/demo/eagle3"], "eagle3"), (["--mtp", "--no-hybrid"], "model"),
    (["--draft", "tinydraft_mlx/demo/dflash"], "dflash"),
    (["--draft", "prompt-lookup"], "prompt-lookup"), (["--draft", "none"], "none")])
def test_the_servers_default_drafter_serves_requests_that_name_none(argv, draft):
    """Whatever kind the server's drafter is (a draft model, the target's MTP layer, an EAGLE-3
    head, prompt lookup, none), a plain OpenAI request (no `draft`) is drafted by it; a request
    may name it, and a name the server cannot serve is a 400 that lists the ones it can."""
    from fastapi.testclient import TestClient

    from tinydraft_mlx.server import build_app, setup_arg_parser

    app = build_app(setup_arg_parser().parse_args(argv + ["-k", "3"]))
    body = {"prompt": "def parse_args(", "max_tokens": 8, "temperature": 0}
    with TestClient(app) as client:
        assert client.get("/health").json()["draft"] == draft
        plain = client.post(COMPLETIONS, json=body)
        assert plain.status_code == 200, plain.text
        assert plain.json()["usage"]["completion_tokens"] == 8
        named = client.post(COMPLETIONS, json=body | {"draft": draft})
        assert named.status_code == 200, named.text
        assert named.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        wrong = client.post(COMPLETIONS, json=body | {"draft": "medusa"})
        assert wrong.status_code == 400 and repr(draft) in wrong.json()["error"]["message"]


def test_server_flags_are_checked_before_loading(capsys):
    from tinydraft_mlx.server import main

    for argv, message in [(["-k", "0"], "--num-draft-tokens must be"),
                          (["--max-queue", "0"], "--max-queue must be an integer >= 1 (got 0)"),
                          (["--max-kv-size", "3"], "--max-kv-size must be"),
                          (["--max-kv-size", "10", "-k", "6"], "--num-draft-tokens must be an "
                           "integer in [1, 5] with max_kv_size 10 (got 6)"),
                          (["--temp", "-1"], "--temp must be"),
                          (["--bitwise", "-k", "9"], '--num-draft-tokens must be an integer in '
                           '[1, 8] or "auto" with bitwise (got 9)'),
                          (["--bitwise", "--max-kv-size", "64"],  # after loading the models
                           "--bitwise must be False with max_kv_size 64")]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err

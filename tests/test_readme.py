"""The README's offline snippets run as written, so they cannot go stale.

Every fenced block preceded by `<!-- run: KIND -->` is run, each in a fresh process from an empty
working directory, offline (HF_HUB_OFFLINE=1), with this environment's Python first on PATH:
`shell` blocks with bash (-e: every command must succeed), `python` blocks with the interpreter;
a `server` block is started (on a free port instead of 8080) and the `client` blocks after it
run against it (their 8080 replaced by that port), then the server is stopped with SIGINT and
must exit 0. Each block must exit 0 and print something; the curl block's output must be a
completion.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- run: (\w+) -->\n```(\w+)\n(.*?)\n```", re.S)
TIMEOUT = 300


def _blocks() -> list[tuple[str, str, str]]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def _run(lang: str, body: str, cwd: Path) -> str:
    command = ["bash", "-eo", "pipefail", "-c", body] if lang == "bash" else \
        [sys.executable, "-c", body]
    done = subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, f"{body}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.stdout.strip(), f"{body} printed nothing\n{done.stderr}"
    return done.stdout


def test_the_readme_marks_its_offline_snippets():
    kinds = [kind for kind, _, _ in _blocks()]
    assert kinds.count("shell") >= 1 and kinds.count("python") >= 2
    assert kinds.count("server") == 1 and kinds.count("client") >= 2


@pytest.mark.parametrize("index", [i for i, (kind, _, _) in enumerate(_blocks())
                                   if kind in ("shell", "python")])
def test_a_readme_snippet_runs_as_written(index, tmp_path):
    _, lang, body = _blocks()[index]
    _run(lang, body, tmp_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stderr.read()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.loads(r.read())["status"] == "ok":
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the README's server did not become healthy")


def test_the_readme_server_and_its_clients(tmp_path):
    blocks = _blocks()
    (_, _, command), = [b for b in blocks if b[0] == "server"]
    clients = [(lang, body) for kind, lang, body in blocks if kind == "client"]
    port = _free_port()
    server = subprocess.Popen(["bash", "-c", f"exec {command} --port {port}"], cwd=tmp_path,
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        _wait_healthy(port, server)
        for lang, body in clients:
            out = _run(lang, body.replace("8080", str(port)), tmp_path)
            if lang == "bash":
                assert json.loads(out)["choices"][0]["text"]
    finally:
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=60)
    assert code == 0, server.stderr.read()

"""A real headless browser (Debian's chromium) driven over the DevTools protocol, to load the
server's page, wait until its streamed completion has finished, and read the page or screenshot it.

`chromium --dump-dom` dumps the DOM when the page has loaded, before a streamed response ends,
so this waits on the page's own `data-state` instead.

    python -m tests.browser "http://127.0.0.1:8080/?autorun=1" docs/server-page.png
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from itertools import count

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    return next((path for name in CANDIDATES if (path := shutil.which(name))), None)


# resolves with the page's final state once its generation has ended. Until chromium has
# navigated to the url, this may run in the first about:blank document, which has no state: it
# keeps polling there (the navigation then destroys that context and `evaluate` retries), instead
# of resolving with `undefined` (a race seen in CI on a loaded machine).
_WAIT = """new Promise((resolve) => {
  const t = setInterval(() => {
    const s = document.body?.dataset.state;
    if (s == null || s === "idle" || s === "running") return;
    clearInterval(t); resolve(s);
  }, 50);
})"""

# what the page shows: its spans (class, text) and the stats boxes
_READ = """JSON.stringify({
  spans: [...document.querySelectorAll("#out span")].map((s) => [s.className, s.textContent]),
  tokens: document.getElementById("s_tokens").textContent,
  from_draft: document.getElementById("s_accept").textContent,
  tps: document.getElementById("s_tps").textContent,
  acceptance: document.getElementById("s_rate").textContent,
  error: document.getElementById("error").textContent,
})"""


class Page:
    """One headless chromium showing `url`; use as a context manager."""

    def __init__(self, url: str, *, width: int = 1000, height: int = 900,
                 timeout: float = 60.0) -> None:
        self.url, self.size, self.timeout = url, (width, height), timeout
        self._ids = count(1)

    def __enter__(self) -> Page:
        from websockets.sync.client import connect

        exe = find_chromium()
        if exe is None:
            raise RuntimeError("chromium is not installed")
        self._profile = tempfile.mkdtemp(prefix="tinydraft-chromium-")
        self._proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-port=0", f"--user-data-dir={self._profile}",
             f"--window-size={self.size[0]},{self.size[1]}", "--hide-scrollbars", self.url],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)  # its own group: __exit__ ends its helpers too
        port = self._devtools_port()
        deadline = time.monotonic() + self.timeout
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            if pages or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self._stack = ExitStack()
        self._ws = self._stack.enter_context(connect(pages[0]["webSocketDebuggerUrl"],
                                                     max_size=None, open_timeout=self.timeout))
        return self

    def _devtools_port(self) -> int:
        deadline = time.monotonic() + self.timeout
        assert self._proc.stderr is not None
        while time.monotonic() < deadline:
            line = self._proc.stderr.readline()
            if not line and self._proc.poll() is not None:
                break
            match = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if match:
                return int(match.group(1))
        raise RuntimeError("chromium did not start its DevTools endpoint")

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._signal(signal.SIGTERM)
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self._proc.wait(10)
        # chromium's helpers (crashpad, zygote) may still write into the profile for a moment
        # after the browser has exited: one CI run failed removing it ("Directory not empty")
        for attempt in range(20):
            try:
                shutil.rmtree(self._profile)
                break
            except FileNotFoundError:
                break
            except OSError:
                if attempt == 19:
                    raise
                self._signal(signal.SIGKILL)
                time.sleep(0.25)

    def _signal(self, sig: int) -> None:
        """Send `sig` to chromium and every helper it started (its process group)."""
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass

    def _call(self, method: str, **params: object) -> dict:
        ident = next(self._ids)
        self._ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv(timeout=self.timeout))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str) -> object:
        """The value of `expression` (awaited); retried while the page is still navigating from
        about:blank to the url (its first execution context is then destroyed)."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                result = self._call("Runtime.evaluate", expression=expression,
                                    awaitPromise=True, returnByValue=True)
                if not self.evaluate_ready(result):
                    raise RuntimeError("the page has not loaded yet")
                return result["result"].get("value")
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    @staticmethod
    def evaluate_ready(result: dict) -> bool:
        return "exceptionDetails" not in result

    def wait_done(self) -> str:
        """Wait for the page's generation to end; returns its state ("done", "error", ...)."""
        return self.evaluate(_WAIT)

    def read(self) -> dict:
        return json.loads(self.evaluate(_READ))

    def screenshot(self, path: str) -> None:
        data = self._call("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))


if __name__ == "__main__":
    with Page(sys.argv[1]) as page:
        print(page.wait_done(), page.read()["tokens"], "tokens")
        page.screenshot(sys.argv[2])

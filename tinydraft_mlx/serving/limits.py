"""What keeps the HTTP server from being wedged by its connections: a header timeout and a cap on
open connections (uvicorn's h11 protocol, extended), a file-descriptor limit raised to what the
system allows, and log records rate-limited so that a storm of one error cannot fill the disk.

uvicorn closes idle keep-alive connections and answers 503 beyond `limit_concurrency`, but it
waits forever for a request that never completes: 2200 connections that sent nothing kept their
file descriptors, the accept loop then failed on every try, and the log grew by 208 MB in 30 s.
Here a connection that has not sent a complete request line and headers within `header_timeout`
seconds (of opening, or of its previous response) is closed, and one opened beyond
`max_connections` is closed at once. The body's own deadline is the app's (`RequestLimits` in
`server.py`). Knows nothing about models.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT = 10.0
MAX_CONNECTIONS = 512
LOGGERS = ("uvicorn.error", "uvicorn.access", "asyncio", "tinydraft_mlx.server",
           "tinydraft_mlx.worker")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and a connection cap (class attributes, set
    per server by `config`)."""

    header_timeout = HEADER_TIMEOUT
    max_connections = MAX_CONNECTIONS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            transport.close()  # nothing read yet: the cheapest refusal
            return
        self._arm()

    def _arm(self) -> None:
        """Expect a new request within header_timeout (none has started since now)."""
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._armed_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout, self._expire)

    def _expire(self) -> None:
        self._header_timer = None
        if self.cycle is self._armed_cycle and not self.transport.is_closing():
            self.transport.close()  # no complete request line and headers in time

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)


class RepeatFilter(logging.Filter):
    """Lets through at most `burst` records of one kind (logger, message template, exception
    type) per `window` seconds; the first record of a kind after a quiet spell says how many of
    it were dropped."""

    def __init__(self, burst: int = 10, window: float = 60.0) -> None:
        super().__init__()
        self.burst, self.window = burst, window
        self._seen: dict[tuple, list[float | int]] = {}  # kind -> [window start, count, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        key = (record.name, str(record.msg), exc)
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.window:
            dropped = entry[2] if entry is not None else 0
            self._seen[key] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.msg} ({dropped} more like this were not logged)"
            if len(self._seen) > 1000:  # forget old kinds: the filter itself stays bounded
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window}
            return True
        entry[1] += 1
        if entry[1] <= self.burst:
            return True
        entry[2] += 1
        return False


def limit_logs(burst: int = 10, window: float = 60.0) -> RepeatFilter:
    """Rate-limit the server's loggers (uvicorn's, asyncio's, ours) with one `RepeatFilter`."""
    rate = RepeatFilter(burst, window)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, RepeatFilter)]:
            logger.removeFilter(old)
        logger.addFilter(rate)
    return rate


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def config(app: Any, *, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info",
           header_timeout: float = HEADER_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
           **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config for `app` with the guarded protocol: at most `max_connections` open,
    `header_timeout` seconds to send a request's headers; other keyword arguments go to
    uvicorn.Config."""
    protocol = type("Guarded", (GuardedH11Protocol,), {"header_timeout": header_timeout,
                                                       "max_connections": max_connections})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol, **kwargs)

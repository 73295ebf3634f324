"""The server's Prometheus metrics (`GET /metrics`), with `prometheus-client`, in a registry of
the app's own (two apps in one process never share counters).

Requests by endpoint and outcome (completed, cancelled, failed, rejected: refused before they ran,
4xx or 503), prompt and generated tokens, time to first token and inter-token latency, tokens
drafted and accepted and the acceptance rate per draft kind (a candidate tree's nodes count as
drafted, those on its accepted path as accepted; the tree nodes also apart), prompt-cache hits
and the tokens they saved; gauges read from the worker when scraped: waiting requests, the
batch, the prompt cache's entries and bytes.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ..engine.stats import GenerationStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   30.0)
OUTCOMES = ("completed", "cancelled", "failed", "rejected")


class Metrics:
    """The counters, histograms and gauges of one server; `render()` is the scrape's body."""

    def __init__(self, worker: Any) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tinydraft_requests", "Requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("tinydraft_prompt_tokens",
                                     "Prompt tokens of the requests that ran", registry=r)
        self.generation_tokens = Counter("tinydraft_generation_tokens", "Tokens generated",
                                         registry=r)
        self.ttft = Histogram("tinydraft_time_to_first_token_seconds",
                              "From the request's start to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tinydraft_inter_token_latency_seconds",
                             "Between two tokens of one request", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.drafted = Counter("tinydraft_draft_tokens", "Draft tokens proposed, by draft kind",
                               ["draft"], registry=r)
        self.accepted = Counter("tinydraft_accepted_tokens",
                                "Draft tokens the target accepted, by draft kind", ["draft"],
                                registry=r)
        self.tree_nodes = Counter("tinydraft_tree_nodes",
                                  "Candidate tree nodes verified, by draft kind", ["draft"],
                                  registry=r)
        self.tree_accepted = Counter("tinydraft_tree_accepted_nodes",
                                     "Candidate tree nodes on accepted paths, by draft kind",
                                     ["draft"], registry=r)
        self.acceptance = Gauge("tinydraft_acceptance_rate",
                                "Accepted / drafted tokens so far, by draft kind", ["draft"],
                                registry=r)
        self.cache_hits = Counter("tinydraft_prompt_cache_hits",
                                  "Requests that reused a cached prompt prefix", registry=r)
        self.cached_tokens = Counter("tinydraft_prompt_cache_tokens",
                                     "Prompt tokens reused from the prompt cache", registry=r)
        gauges = {
            "tinydraft_queue_depth": ("Requests waiting for the model", lambda: worker.waiting),
            "tinydraft_batch_size": ("Generations running now", lambda: worker.batch),
            "tinydraft_prompt_cache_entries": ("Caches in the prompt-cache pool",
                                               lambda: worker.cache_info[0]),
            "tinydraft_prompt_cache_bytes": ("Bytes in the prompt-cache pool",
                                             lambda: worker.cache_info[1]),
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=r).set_function(read)
        self._sums: dict[str, list[int]] = {}  # draft kind -> [drafted, accepted]

    def token(self, seconds: float, first: bool) -> None:
        """A token reached its request: `seconds` since the request started (first) or since
        its previous token."""
        (self.ttft if first else self.itl).observe(seconds)
        self.generation_tokens.inc()

    def rejected(self, endpoint: str) -> None:
        self.requests.labels(endpoint, "rejected").inc()

    def finished(self, endpoint: str, outcome: str, prompt_tokens: int, draft: str,
                 stats: GenerationStats | None) -> None:
        """A request that ran has ended (`outcome` in OUTCOMES)."""
        self.requests.labels(endpoint, outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        if stats is None:
            return
        if stats.cached_tokens:
            self.cache_hits.inc()
            self.cached_tokens.inc(stats.cached_tokens)
        if stats.drafted:
            self.drafted.labels(draft).inc(stats.drafted)
            self.accepted.labels(draft).inc(stats.accepted)
            sums = self._sums.setdefault(draft, [0, 0])
            sums[0] += stats.drafted
            sums[1] += stats.accepted
            self.acceptance.labels(draft).set(sums[1] / sums[0])
        if stats.drafted and stats.tree:
            self.tree_nodes.labels(draft).inc(stats.drafted)
            self.tree_accepted.labels(draft).inc(stats.accepted)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of a scrape."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

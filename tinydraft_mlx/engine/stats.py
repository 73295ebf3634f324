"""Acceptance and timing statistics of one generation, the same object for plain decoding."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .backend import active_blas


@dataclass
class GenerationStats:
    """Counts and timings; filled in by the decode loop as it runs.

    acceptance_rate is accepted / drafted. per_position_acceptance[i] is the fraction of rounds that
    reached draft position i (every earlier draft accepted) in which position i was accepted too, so
    it estimates the per-position acceptance probability. With no draft both are empty/zero. With
    candidate trees, drafted counts the nodes verified, accepted those on the walked path, and
    position i is depth i + 1.
    """

    k: int | str = 0  # draft tokens per round as requested: an int, or "auto"
    tree: int | None = None  # a candidate tree's node budget (then k is its depth limit)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from a prompt cache (not prefilled)
    generated: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    position_reached: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    # index n: how many rounds accepted exactly n draft tokens
    accepted_length_counts: list[int] = field(default_factory=list)
    # k -> rounds that drafted k tokens (k="auto" choices; prompt lookup may find fewer than k)
    k_histogram: dict[int, int] = field(default_factory=dict)
    # the target's prefill and the draft's (with k="auto" the draft starts empty: its first
    # catch-up, which fills it, is part of the rounds' time, `decode_seconds`)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    # k="auto": the draft's catch-ups on plain rounds it missed (looks, whether or not drafting
    # followed; the first also feeds it the prompt) and their time, part of `decode_seconds`
    # (in a batch, `BatchDecoder`, the catch-up runs in the round's graph: counted, not timed)
    catch_ups: int = 0
    catch_up_seconds: float = 0.0
    peak_memory: float = 0.0  # GB, mx.get_peak_memory() after the latest round (as mlx-lm)
    finish_reason: str | None = None  # "length", "eos", "stop" (a stop string) or "closed"
    blas: str = field(default_factory=active_blas)  # which BLAS MLX's CPU backend used
    policy: Any = field(default=None, repr=False, compare=False)  # the k="auto" policy, if any

    def record_round(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """Book one verify round: `drafted` proposals of which the first `accepted` were kept
        (a candidate tree: `drafted` nodes `depth` deep, `accepted` of them on the walked path;
        its positions are its depths)."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        depth = drafted if depth is None else depth
        _grow(self.position_reached, depth)
        _grow(self.position_accepted, depth)
        _grow(self.accepted_length_counts, accepted + 1)
        for i in range(min(accepted + 1, depth)):
            self.position_reached[i] += 1
        for i in range(accepted):
            self.position_accepted[i] += 1
        self.accepted_length_counts[accepted] += 1
        self.k_histogram[drafted] = self.k_histogram.get(drafted, 0) + 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.position_accepted, self.position_reached)]

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens accepted per round (each round also emits one target token)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def summary(self) -> str:
        """One readable line."""
        speed = (
            f"{_count(self.generated, 'token')} in {self.decode_seconds:.2f}s "
            f"({self.tokens_per_second:.1f} tok/s), prompt {_count(self.prompt_tokens, 'token')} "
            f"in {self.prefill_seconds:.2f}s"
            + (f" ({self.cached_tokens} cached)" if self.cached_tokens else "")
            + f", peak memory {self.peak_memory:.3f} GB"
        )
        if not self.drafted:
            return f"plain decoding: {speed}" + ("" if self.k == 0 else f" (k={self.k}: no drafts)")
        # a position no round reached (k="auto" drafted that far only after a rejection) has no
        # estimate: "-", not 0.00
        positions = " ".join(f"{a:.2f}" if r else "-" for a, r in
                             zip(self.per_position_acceptance, self.position_reached))
        shape = f"tree={self.tree} k={self.k}" if self.tree else f"k={self.k}"
        return (
            f"speculative {shape}: {speed}; acceptance {self.acceptance_rate:.1%} "
            f"({self.accepted}/{self.drafted}), {self.mean_accepted_length:.2f} accepted + 1 per "
            f"round over {_count(self.rounds, 'round')}, per position [{positions}]"
            # the choices of k="auto"; a fixed k's rounds only shorten where max_tokens is near
            + (f", rounds by k {dict(sorted(self.k_histogram.items()))}"
               if self.k == "auto" and len(self.k_histogram) > 1 else "")
            + (f", {_count(self.catch_ups, 'catch-up')}" if self.catch_ups else "")
            + (f" in {self.catch_up_seconds:.3f}s" if self.catch_up_seconds else "")
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _grow(counts: list[int], size: int) -> None:
    counts.extend([0] * (size - len(counts)))

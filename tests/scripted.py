"""A stand-in for `k="auto"`'s choice that plays a fixed schedule of k, cycling, so that a test
does not depend on this machine's timings: `scripted(monkeypatch, schedule)` replaces the
engine's `choose(costs, rows, limit)` and returns the list of (limit, k) it answered."""

from __future__ import annotations


def scripted(monkeypatch, schedule: tuple[int, ...]) -> list[tuple[int, int]]:
    import tinydraft_mlx.engine.rounds as rounds

    calls: list[tuple[int, int]] = []

    def choose(costs, rows, limit: int) -> int:
        k = min(schedule[len(calls) % len(schedule)], limit)
        calls.append((limit, k))
        return k

    monkeypatch.setattr(rounds, "choose", choose)
    return calls

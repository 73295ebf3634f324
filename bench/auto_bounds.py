"""What a fresh k="auto" generation could reach on the fresh T = 0 bar's prompt, and what its own
first rounds can tell: the bounds behind issue 22's last bar.

    python bench/auto_bounds.py [--rounds 20]              # about 2 minutes

In one process (policy file off; demo pair, greedy, the bar's prompt, 128 tokens), every round
runs each contender once, in shuffled order: plain decoding, fixed k = 1 and 2, k="auto" with a
fresh policy, and k="auto" with its choices forced (the policy's `choose` replaced for that
generation; the loop, its looks and catch-ups as in any auto generation):
- "auto, plain": every round plain (the loop's own price for k="auto");
- "auto, k=2": k = 2 from the first round that may draft (a perfect choice where k = 2 is best);
- "prescient": plain until token PRESCIENT, then k = 2 (what knowing the text ahead would buy);
- "first rounds": plain for nine rounds, k = 2 for FIRST_ROUNDS rounds, then plain: from those
  rounds alone, k = 2's gain as a fresh generation could estimate it (their mean tokens a round
  times R(0) / R(2), medians of their timings as the policy books them).
Beside: the draft's first-position acceptance along the prompt's greedy text, per 16 tokens.
Tokens/s from the call to the last token; ratios of means with 95% bootstrap intervals (rounds
resampled; bench/auto.py's `_auto_ratios`). The forcing uses the policy's private methods: a
diagnostic, not an API.

Writes results/auto_bounds.json and results/auto_bounds.png.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import os
import random
import statistics
import time
from pathlib import Path

from auto import FRESH_TOKENS, _auto_ratios, cold, trace_shapes
from auto_replay import record
from common import machine, model_dtype, pyplot, save

from bench import PROMPTS, ours
from tinydraft_mlx import active_blas, load_models
from tinydraft_mlx.engine import policy as policy_module

PRESCIENT = 64  # tokens decoded plainly before "prescient" drafts k = 2
FIRST_PLAIN = policy_module.FIRST_LOOK + 1  # plain rounds before "first rounds" drafts (as a
# fresh policy's first look falls)
FIRST_ROUNDS = policy_module.RECENT  # its rounds of k = 2: a full window of a k's timings
WINDOW = 16  # tokens per acceptance window
NAMES = ("plain", "k=1", "k=2", "auto", "auto, plain", "auto, k=2", "prescient", "first rounds")


class Forced:
    """Replace `DraftLengthPolicy.choose` and wrap `update` while a forced contender runs: the
    choice a schedule gives per generated token and round, and the rounds it booked."""

    def __init__(self) -> None:
        self.schedule = None  # (tokens generated, rounds so far) -> k, or None: the policy's own
        self.tokens = self.rounds = 0
        self.booked: list[tuple[int, int, float]] = []  # (k, accepted, seconds) as booked
        self._choose = policy_module.DraftLengthPolicy.choose
        self._update = policy_module.DraftLengthPolicy.update
        forced = self

        def choose(policy, limit: int, caught_up: bool = False) -> int:
            if forced.schedule is None:
                return forced._choose(policy, limit, caught_up)
            policy.held = 0
            return min(limit, forced.schedule(forced.tokens, forced.rounds))

        def update(policy, k: int, accepted: int, seconds: float, catch_up: float = 0.0,
                   filled: bool = False) -> None:
            if forced.schedule is not None:
                forced.booked.append((k, accepted, seconds))
                forced.tokens += accepted + 1
                forced.rounds += 1
            return forced._update(policy, k, accepted, seconds, catch_up=catch_up,
                                  filled=filled)

        policy_module.DraftLengthPolicy.choose = choose
        policy_module.DraftLengthPolicy.update = update

    def start(self, schedule) -> None:
        self.schedule, self.tokens, self.rounds, self.booked = schedule, 0, 0, []

    def restore(self) -> None:
        policy_module.DraftLengthPolicy.choose = self._choose
        policy_module.DraftLengthPolicy.update = self._update


SCHEDULES = {
    "auto, plain": lambda tokens, rounds: 0,
    "auto, k=2": lambda tokens, rounds: 2,
    "prescient": lambda tokens, rounds: 0 if tokens < PRESCIENT else 2,
    "first rounds": lambda tokens, rounds: 2 if FIRST_PLAIN <= rounds < FIRST_PLAIN
    + FIRST_ROUNDS else 0,
}


def first_rounds_gain(booked: list[tuple[int, int, float]]) -> float | None:
    """k = 2's gain over plain decoding estimated from a "first rounds" generation's booked
    rounds: mean tokens a k = 2 round, times R(0) / R(2) (medians of the timed rounds)."""
    seen = booked[:FIRST_PLAIN + FIRST_ROUNDS + 1]  # up to the verdict a policy would make
    plain = [s for k, _, s in seen if k == 0 and s > 0]
    drafting = [(a, s) for k, a, s in seen if k == 2]
    timed = [s for _, s in drafting if s > 0]
    if not plain or not timed:
        return None
    tokens = 1 + statistics.fmean(a for a, _ in drafting)
    return tokens * statistics.median(plain) / statistics.median(timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    os.environ["TINYDRAFT_POLICY_FILE"] = "off"  # the policies of this process alone
    target, draft, tok = load_models()
    ids = tok.encode(PROMPTS[0])
    matches = record(target, draft, tok, PROMPTS[0], FRESH_TOKENS, 1)["matches"]
    windows = [statistics.fmean(matches[i:i + WINDOW]) for i in range(0, len(matches), WINDOW)]
    trace_shapes(target, draft, tok, ids, 0.0)
    forced = Forced()
    runs: dict[str, list[float]] = {name: [] for name in NAMES}
    gains: list[float] = []
    try:
        for r in range(args.rounds):
            order = list(NAMES)
            random.Random(r).shuffle(order)
            for name in order:
                cold()
                forced.start(SCHEDULES.get(name))
                k = 1 if name == "plain" else int(name[2:]) if name.startswith("k=") else "auto"
                start = time.perf_counter()
                out = ours(target, None if name == "plain" else draft, tok, ids, k=k,
                           max_tokens=FRESH_TOKENS, temp=0.0, seed=0)[0]
                runs[name].append(len(out) / (time.perf_counter() - start))
                if name == "first rounds" and (gain := first_rounds_gain(forced.booked)):
                    gains.append(gain)
                forced.start(None)
    finally:
        forced.restore()
    cells = {}
    for name in NAMES[1:]:
        (vs_plain, vs_k2), (plain_95, k2_95) = _auto_ratios(runs, ["k=2"], args.rounds, name)
        cells[name] = {"vs_plain": vs_plain, "vs_plain_95": plain_95, "vs_k2": vs_k2,
                       "vs_k2_95": k2_95}
    report = {
        "settings": {"prompt": PROMPTS[0], "max_tokens": FRESH_TOKENS, "rounds": args.rounds,
                     "temp": 0.0, "prescient": PRESCIENT, "first_plain": FIRST_PLAIN,
                     "first_rounds": FIRST_ROUNDS, "window": WINDOW,
                     "dtype": model_dtype(target), "blas": active_blas(),
                     "tokens_per_s": "from the call to the last token"},
        "machine": machine(),
        "tok_s": {name: statistics.fmean(v) for name, v in runs.items()},
        "cells": cells,
        "acceptance_windows": windows,
        "first_rounds_gain": {"median": statistics.median(gains),
                              "sd": statistics.stdev(gains) if len(gains) > 1 else 0.0,
                              "below_1": sum(g < 1.0 for g in gains) / len(gains),
                              "values": gains} if gains else None,
        "runs": runs,
    }
    print({k: v for k, v in report.items() if k not in ("runs", "machine")}, flush=True)
    save(report, "auto_bounds", plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    s, cells = report["settings"], report["cells"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5),
                                      gridspec_kw={"width_ratios": [2, 1]})
    names = list(cells)
    values = [cells[n]["vs_plain"] for n in names]
    low = [v - cells[n]["vs_plain_95"][0] for v, n in zip(values, names)]
    high = [cells[n]["vs_plain_95"][1] - v for v, n in zip(values, names)]
    colors = ["grey" if n.startswith("k=") else "black" if n == "auto" else "tab:blue"
              for n in names]
    left.bar(range(len(names)), values, color=colors, yerr=[low, high], capsize=3, ecolor="red")
    for x, n in enumerate(names):
        left.text(x, values[x] + 0.02, f"{values[x]:.2f}\n({cells[n]['vs_k2']:.2f} of k=2)",
                  ha="center", fontsize=7)
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_xticks(range(len(names)), names, fontsize=8, rotation=15)
    left.set_ylim(0, 1.3)
    left.set(ylabel=f"tokens/s over plain (mean of {s['rounds']} rounds, 95% interval)",
             title=f"fresh k='auto' and forced choices (demo pair, {s['dtype']}, T=0, "
                   f"{s['max_tokens']} tokens)")
    windows = report["acceptance_windows"]
    right.bar(range(len(windows)), windows, color="tab:green")
    right.set_xticks(range(len(windows)), [f"{i * s['window']}" for i in range(len(windows))],
                     fontsize=8)
    right.set_ylim(0, 1)
    gain = report.get("first_rounds_gain")
    right.set(xlabel="generated token (window start)", ylabel="draft's first-position acceptance",
              title="acceptance along the text")
    if gain:
        right.text(0.03, 0.97, f"k=2's gain estimated from its first\n{s['first_rounds']} "
                   f"rounds: {gain['median']:.2f}x plain (median),\nbelow 1 in "
                   f"{gain['below_1']:.0%} of generations", transform=right.transAxes,
                   va="top", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

"""Where a round's time goes on the host: the gap between rounds in which the device has nothing
queued, measured inside the real loop.

    python bench/host_gap.py                         # demo pair, T=0 and T=1, k = 1..4

The loop queues device work in two places per round: the draft chain (`_propose`, each step
`async_eval`ed) and the verify pass (`_verify`, which ends in the round's one host sync). Both are
wrapped with timers here (the loop itself is unchanged). Per round:
- propose: time in `_propose` (graph building of the draft steps; the device runs them as they
  are queued);
- verify: time in `_verify` (graph building + waiting at the sync for the device);
- gap: from the end of `_verify` to the start of the next round's `_propose`: rollback,
  statistics, the policy, yielding tokens to the consumer (here: the text layer). Nothing is
  queued then, so the device idles: this is the host overhead proper.
Greedy and T=1, demo pair, the held-out prompts, median of the per-generation fractions. Writes
results/host_gap.json and .png.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import statistics
import time
from pathlib import Path

from common import machine, model_dtype, pyplot, save
from demo_quality import held_out_prompts

import tinydraft_mlx.engine.speculative as spec
from tinydraft_mlx import load_models, stream_generate


class Timers:
    """Wraps `_propose` and `_verify` of the loop and books their times and the gaps."""

    def __init__(self) -> None:
        self.propose = self.verify = self.gap = 0.0
        self.last_verify_end: float | None = None
        self.real_propose, self.real_verify = spec._propose, spec._verify

    def install(self) -> None:
        def propose(*args, **kwargs):
            start = time.perf_counter()
            if self.last_verify_end is not None:
                self.gap += start - self.last_verify_end
            try:
                return self.real_propose(*args, **kwargs)
            finally:
                self.propose += time.perf_counter() - start

        def verify(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.real_verify(*args, **kwargs)
            finally:
                self.last_verify_end = time.perf_counter()
                self.verify += self.last_verify_end - start

        spec._propose, spec._verify = propose, verify

    def reset(self) -> None:
        self.propose = self.verify = self.gap = 0.0
        self.last_verify_end = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    target, draft, tok = load_models()
    prompts = held_out_prompts(args.prompts, seed=0)
    timers = Timers()
    timers.install()
    for _ in stream_generate(target, draft, tok, prompts[0], k=2, max_tokens=8):  # warm-up
        pass
    cells = []
    for temperature in (0.0, 1.0):
        for k in args.ks:
            fractions = {"propose": [], "verify": [], "gap": []}
            for i, p in enumerate(prompts):
                timers.reset()
                start = time.perf_counter()
                stream = stream_generate(target, draft, tok, p, k=k, max_tokens=args.max_tokens,
                                         temperature=temperature, seed=i)
                r = None
                for r in stream:  # noqa: B007  (the last response's stats are read below)
                    pass
                timers.gap += time.perf_counter() - timers.last_verify_end  # the last tokens
                total = timers.propose + timers.verify + timers.gap
                rounds = r.stats.rounds
                for name in fractions:
                    fractions[name].append(getattr(timers, name) / total)
                wall = time.perf_counter() - start
            cell = {"temperature": temperature, "k": k,
                    **{f"{n}_fraction": statistics.median(v) for n, v in fractions.items()},
                    "round_ms": 1000 * wall / rounds}
            print(f"T={temperature} k={k}: gap {cell['gap_fraction']:.1%} of a round, propose "
                  f"{cell['propose_fraction']:.1%}, verify {cell['verify_fraction']:.1%} "
                  f"(round {cell['round_ms']:.2f} ms)", flush=True)
            cells.append(cell)
    report = {"settings": {**vars(args), "dtype": model_dtype(target)}, "machine": machine(),
              "cells": cells}
    save(report, "host_gap", plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    cells = report["cells"]
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"T={c['temperature']:g}\nk={c['k']}" for c in cells]
    bottom = [0.0] * len(cells)
    for name, colour in (("verify", "tab:blue"), ("propose", "tab:green"), ("gap", "tab:red")):
        values = [100 * c[f"{name}_fraction"] for c in cells]
        ax.bar(labels, values, bottom=bottom, color=colour, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(97, color="black", lw=0.8, ls="--", label="3% gap budget")
    ax.set(ylabel="% of a round", ylim=(0, 100),
           title="Demo pair: where a round goes (gap = device idle between rounds)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

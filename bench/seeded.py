"""What a seed's coupling costs in acceptance: seeded rows (Gumbel-max coupling,
engine/sampling/seeded.py) against unseeded rows (min(1, p/q) rejection sampling), same pair,
prompts and k.

    python -m bench.seeded                     # demo pair, T = 0.7 (top-p 0.8, top-k 20) and 1.0

For each temperature and fixed k (1 and 3), every prompt of bench.py's PROMPTS is generated
SAMPLES times with a seed (seeds 0..SAMPLES-1) and SAMPLES times without; the figures are the
acceptance rate (accepted / drafted draft tokens, summed over all runs) and tokens per round.
Rejection sampling accepts a draft with probability sum_x min(p, q), the most any coupling of
the two draws can; Gumbel-max coupling accepts with P(argmax(log p + G) = argmax(log q + G)),
less. Writes results/seeded.json and results/seeded.png.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
from pathlib import Path

from bench.common import machine, model_dtype, pyplot, save
from bench.speed import PROMPTS
from tinydraft_mlx import active_blas, generate, load_models

SETTINGS = {0.7: {"top_p": 0.8, "top_k": 20}, 1.0: {}}


def measure(target, draft, tok, prompts, temp: float, k: int, seeded: bool, samples: int,
            max_tokens: int) -> dict:
    drafted = accepted = rounds = tokens = 0
    for ids in prompts:
        for s in range(samples):
            out, stats = generate(target, draft, tok, ids, k=k, max_tokens=max_tokens,
                                  temperature=temp, seed=s if seeded else None,
                                  **SETTINGS[temp])
            drafted += stats.drafted
            accepted += stats.accepted
            rounds += stats.rounds
            tokens += len(out)
    return {"acceptance": accepted / max(drafted, 1), "tokens_per_round": tokens / rounds,
            "drafted": drafted, "accepted": accepted, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=12, help="runs per prompt and contender")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--temps", type=float, nargs="+", default=[0.7, 1.0])
    args = ap.parse_args()
    target, draft, tok = load_models()
    prompts = [tok.encode(p) for p in PROMPTS]
    cells = []
    for temp in args.temps:
        for k in args.ks:
            row = {"temp": temp, "k": k, **{
                name: measure(target, draft, tok, prompts, temp, k, name == "seeded",
                              args.samples, args.max_tokens)
                for name in ("rejection", "seeded")}}
            row["ratio"] = row["seeded"]["acceptance"] / row["rejection"]["acceptance"]
            cells.append(row)
            print(f"T={temp} k={k}: acceptance rejection {row['rejection']['acceptance']:.3f}, "
                  f"seeded {row['seeded']['acceptance']:.3f} ({row['ratio']:.2f}x); tokens a "
                  f"round {row['rejection']['tokens_per_round']:.2f} / "
                  f"{row['seeded']['tokens_per_round']:.2f}", flush=True)
    report = {"settings": {**vars(args), "prompts": len(prompts), "sampling": {
        str(t): SETTINGS[t] for t in args.temps}, "dtype": model_dtype(target),
        "blas": active_blas()}, "machine": machine(), "cells": cells}
    save(report, "seeded", plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    cells = report["cells"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = range(len(cells))
    for j, name in enumerate(("rejection", "seeded")):
        values = [c[name]["acceptance"] for c in cells]
        ax.bar([x + (j - 0.5) * 0.38 for x in xs], values, width=0.38,
               label={"rejection": "unseeded: min(1, p/q) rejection sampling",
                      "seeded": "seeded: Gumbel-max coupling"}[name])
        for x, v in zip(xs, values):
            ax.text(x + (j - 0.5) * 0.38, v + 0.01, f"{v:.2f}", ha="center", fontsize=8)
    ax.set_xticks(list(xs), [f"T={c['temp']:g}, k={c['k']}" for c in cells])
    ax.set_ylim(0, 1)
    s = report["settings"]
    ax.set(ylabel="draft tokens accepted / drafted",
           title=f"Acceptance with and without a seed (demo pair, {s['dtype']}, {s['prompts']} "
                 f"prompts x {s['samples']} runs x {s['max_tokens']} tokens)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

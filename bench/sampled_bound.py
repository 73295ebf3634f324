"""What bounds sampled speculation on the demo pair: the draft's quality or our overhead?

    python -m bench.sampled_bound                    # demo pair, about 2 minutes

A one-token draft is accepted with probability sum_x min(p(x), q(x)) (p, q: the target's and
the draft's warped distributions after the same text), so a k = 1 round yields 1 + a tokens for
R(1) seconds where plain decoding yields one per R(0): it can pay only if a > R(1) / R(0) - 1,
whatever the sampling overhead. Per temperature (0: greedy, where a is whether the two argmaxes
agree; 0.7 with top-p 0.8 and top-k 20, Qwen2.5-Instruct's shipped defaults):
- a: the mean of sum min(p, q) over the positions of text the target sampled itself (one
  forward of each model over prompt + text, independent of the loop), per prompt and seed;
- R(0), R(1): the measured decode time per round of plain and k = 1 generations of that setting
  in this process (the same prompts and seeds, each contender in turn, which goes first
  alternating; medians), and the acceptance k = 1 reached there;
- the bound: the k = 1 / plain ratio that a would give at these round costs, (1 + a) R(0) / R(1).

Writes results/sampled_bound.json and .png.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import statistics
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.common import machine, model_dtype, pyplot, save
from bench.speed import PROMPTS, decode_rate
from tinydraft_mlx import active_blas, generate, load_models, stream_generate
from tinydraft_mlx.engine.cache import make_cache
from tinydraft_mlx.engine.sampling import SamplingParams, warp

SETTINGS = {0.0: {}, 0.7: {"top_p": 0.8, "top_k": 20}}


def acceptance_on_own_text(target, draft, ids: list[int], out: list[int],
                           params: SamplingParams) -> list[float]:
    """sum min(p, q) (greedy: argmax agreement) at each position of `out` after `ids`."""
    x = mx.array(ids + out, dtype=mx.int32)[None]
    start = len(ids) - 1
    p_logits = target(x, cache=make_cache(target))[0, start:-1]
    q_logits = draft(x, cache=make_cache(draft))[0, start:-1, : p_logits.shape[-1]]
    if params.greedy:
        return (np.array(p_logits).argmax(-1) == np.array(q_logits).argmax(-1)).tolist()
    p, q = np.array(warp(p_logits, params)), np.array(warp(q_logits, params))
    return np.minimum(p, q).sum(-1).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    target, draft, tok = load_models(dtype="float32")
    prompts = [tok.encode(p) for p in PROMPTS[: args.prompts]]
    for k in (None, 1):  # trace the compiled shapes first
        for temp, extra in SETTINGS.items():
            generate(target, draft if k else None, tok, prompts[0], k=k or 1, max_tokens=8,
                     temperature=temp, seed=0, **extra)
    cells = []
    for temp, extra in SETTINGS.items():
        params = SamplingParams(temp, **extra)
        accept, rates, ks = [], {"plain": [], "k=1": []}, []
        for ids in prompts:  # the acceptance first, untimed: its eager forwards stay apart
            for seed in range(args.seeds):
                out, _ = generate(target, None, tok, ids, max_tokens=args.max_tokens,
                                  temperature=temp, seed=seed, **extra)
                accept += acceptance_on_own_text(target, draft, ids, out, params)
        turn = 0
        for ids in prompts:
            for seed in range(args.seeds):
                turn += 1  # plain first every other time: neither always follows the other
                for name, d in (("plain", None), ("k=1", draft))[:: 1 if turn % 2 else -1]:
                    steps = stream_generate(target, d, tok, ids, k=1, max_tokens=args.max_tokens,
                                            temperature=temp, seed=seed, **extra)
                    _, rate, extras = decode_rate((r.token, r) for r in steps)
                    stats = extras[-1].stats
                    rates[name].append((rate, stats.rounds, stats.generated))
                    if d is not None:
                        ks.append((stats.accepted, stats.drafted))
        # seconds per round from decode tokens/s: (generated - 1) tokens over the rounds after
        # the first (the decode rate starts at the first token)
        r0 = statistics.median(1.0 / rate for rate, _, _ in rates["plain"])
        r1 = statistics.median((g - 1) / rate / max(1, rounds - 1)
                               for rate, rounds, g in rates["k=1"])
        a = float(np.mean(accept))
        loop_accept = sum(x for x, _ in ks) / max(1, sum(n for _, n in ks))
        cells.append({
            "temp": temp, **extra, "positions": len(accept),
            "acceptance_own_text": a, "acceptance_k1_loop": loop_accept,
            "plain_tok_s": statistics.median(r for r, _, _ in rates["plain"]),
            "k1_tok_s": statistics.median(r for r, _, _ in rates["k=1"]),
            "round_ms": {"0": r0 * 1e3, "1": r1 * 1e3},
            "break_even_acceptance": r1 / r0 - 1.0,
            "k1_bound_vs_plain": (1.0 + a) * r0 / r1,
        })
        print(cells[-1], flush=True)
    report = {"settings": {**vars(args), "dtype": model_dtype(target), "blas": active_blas()},
              "machine": machine(), "cells": cells}
    save(report, "sampled_bound", plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    cells = report["cells"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(cells))
    labels = [f"T = {c['temp']:g}" + (f"\n(top-p {c['top_p']}, top-k {c['top_k']})"
                                      if c["temp"] else "\n(greedy)") for c in cells]
    ax.bar([x - 0.2 for x in xs], [c["acceptance_own_text"] for c in cells], 0.4,
           label="acceptance a one-token draft can reach (sum min(p, q) on the target's text)")
    ax.bar([x + 0.2 for x in xs], [c["break_even_acceptance"] for c in cells], 0.4,
           label="acceptance k = 1 needs to pay here (R(1) / R(0) - 1)")
    ax.set_xticks(list(xs), labels)
    ax.set_ylim(0, 1)
    ax.set_ylabel("acceptance")
    ax.set_title("Demo pair: acceptance the draft reaches vs acceptance k = 1 needs", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

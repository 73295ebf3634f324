"""Quality bars of the bundled demo pair: held-out acceptance (greedy, T=0.7, T=1.0, k=4), the
per-position acceptance curve, plain vs speculative tokens/s side by side, and greedy samples.

    python -m bench.demo_quality     # ~5 min; writes results/demo_quality.{json,png}
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import json
import random
import sysconfig
import time
from pathlib import Path

from bench.common import machine, model_dtype
from tinydraft_mlx import generate, load_models

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ["def parse_args(", "class Stack:\n    def __init__(self):",
           "import os\n\n\ndef read_lines(path):"]


def held_out_prompts(n: int, seed: int, max_chars: int = 600) -> list[str]:
    """Up to `n` prompts from held-out stdlib files: the text before a `def` line, plus the line."""
    training = json.loads((ROOT / "results" / "demo_training.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rng = random.Random(seed)
    prompts = []
    for name in training["corpus"]["held_out_files"]:
        lines = (stdlib / name).read_text(errors="replace").splitlines(keepends=True)
        defs = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and i > 3]
        if defs:
            i = rng.choice(defs)
            prompts.append("".join(lines[: i + 1])[-max_chars:])
    rng.shuffle(prompts)
    return prompts[:n]


def run(target, draft, tok, prompts, *, k, temperature, max_tokens, seed):
    totals = dict(drafted=0, accepted=0, generated=0, seconds=0.0, reached=[0] * k,
                  accepted_at=[0] * k)
    for i, prompt in enumerate(prompts):
        _, stats = generate(target, draft, tok, prompt, k=k, max_tokens=max_tokens,
                            temperature=temperature, seed=seed + i)
        totals["drafted"] += stats.drafted
        totals["accepted"] += stats.accepted
        totals["generated"] += stats.generated
        totals["seconds"] += stats.decode_seconds
        for j, (a, r) in enumerate(zip(stats.position_accepted, stats.position_reached)):
            totals["accepted_at"][j] += a
            totals["reached"][j] += r
    totals["acceptance"] = totals["accepted"] / totals["drafted"] if totals["drafted"] else None
    totals["per_position"] = [a / r if r else None
                              for a, r in zip(totals["accepted_at"], totals["reached"])]
    totals["tokens_per_second"] = totals["generated"] / totals["seconds"]
    return totals


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, res in report["speculative"].items():
        curve = res["per_position"]
        left.plot(range(1, len(curve) + 1), curve, marker="o",
                  label=f"{name}: overall {res['acceptance']:.2f}")
    left.axhline(0.55, color="grey", ls="--", lw=1, label="bar for greedy overall: 0.55")
    left.set_xticks(range(1, report["settings"]["k"] + 1))
    left.set(xlabel="draft position in a round", ylabel="P(accept | reached)", ylim=(0, 1),
             title=f"Demo pair acceptance, k={report['settings']['k']}, "
                   f"{report['settings']['prompts']} held-out prompts")
    left.legend(fontsize=8)
    names = ["plain"] + list(report["speculative"])
    speeds = [report["plain"]["tokens_per_second"]] + [
        r["tokens_per_second"] for r in report["speculative"].values()]
    ratios = [s / speeds[0] for s in speeds]
    right.bar(names, ratios, color=["grey"] + ["tab:blue"] * (len(names) - 1))
    right.axhline(1.0, color="black", lw=0.8)
    right.set(ylabel="tokens/s relative to plain greedy", title="Same prompts, same run")
    for x, r in enumerate(ratios):
        right.text(x, r, f"{r:.2f}x", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    target, draft, tok = load_models()
    prompts = held_out_prompts(args.prompts, args.seed)
    generate(target, draft, tok, prompts[0], k=args.k, max_tokens=8)  # warm-up
    report = {
        "settings": {"k": args.k, "prompts": len(prompts), "max_tokens": args.max_tokens,
                     "seed": args.seed, "dtype": model_dtype(target), "pair": "bundled demo pair"},
        "machine": machine(),
        "plain": run(target, None, tok, prompts, k=args.k, temperature=0.0,
                     max_tokens=args.max_tokens, seed=args.seed),
        "speculative": {},
    }
    for temp in (0.0, 0.7, 1.0):
        report["speculative"][f"T={temp}"] = run(
            target, draft, tok, prompts, k=args.k, temperature=temp,
            max_tokens=args.max_tokens, seed=args.seed)
    report["samples"] = {}
    for text in SAMPLES:
        out, _ = generate(target, draft, tok, text, k=args.k, max_tokens=48)
        report["samples"][text] = tok.decode(out)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    out = ROOT / "results" / "demo_quality.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    for name, res in report["speculative"].items():
        print(f"{name}: acceptance {res['acceptance']:.3f}, per position "
              f"{[round(x, 3) for x in res['per_position'] if x is not None]}, "
              f"{res['tokens_per_second'] / report['plain']['tokens_per_second']:.2f}x plain")


if __name__ == "__main__":
    main()

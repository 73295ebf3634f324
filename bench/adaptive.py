"""k="auto" against every fixed k, and prompt-lookup drafting against plain decoding.

    S=~/.cache/tinydraft-mlx/shapes
    python -m bench.adaptive --target $S/1.5B --draft $S/0.5B --alphas 0 0.3 0.5 0.7 0.9 \\
        --ks 1 2 3 --prompts 1 --max-tokens 40

Part 1 (needs the Qwen2.5-shaped checkpoints, bench/qwen_shapes.py): the oracle-acceptance draft
(bench/oracle_draft.py) at each alpha; plain decoding, each fixed k and k="auto", ours, same
prompts, contenders interleaved prompt by prompt so that machine drift hits all of them alike.
Part 2 (the bundled demo target): prompt lookup on an editing workload (prompts that repeat or
lightly change code they contain) and on a workload without repetition; plain decoding, lookup
with k=4 and with k="auto", and the demo draft model with k=4 and k="auto" for reference.

Writes results/adaptive.json and results/adaptive.png. Tokens/s are decode-only (first generated
token to last).
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import json
import statistics
from pathlib import Path

from bench.common import ROOT, machine, pyplot, save
from bench.oracle_draft import OracleDraft
from bench.speed import PROMPTS, ours
from tinydraft_mlx import active_blas, load_models
from tinydraft_mlx.engine.backend import default_dtype

EDITING = [
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n\n"
    "class Vector:\n    def __init__(self, x, y):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"
    "    parser.add_argument('--input')\n    parser.add_argument('--output')\n"
    "    args = parser.parse_args(argv)\n\n\ndef run(argv):\n"
    "    parser = argparse.ArgumentParser()\n",
    "    for key, value in sorted(mapping.items()):\n        if value is None:\n"
    "            continue\n"
    "        result[key] = value\n    for key, value in sorted(other.items()):\n",
    "def area(width, height):\n    return width * height\n\n\ndef volume(width, height, depth):\n",
]


def contenders(ks: list[int]) -> list[tuple[str, object]]:
    return [("plain", None)] + [(f"k={k}", k) for k in ks] + [("auto", "auto")]


def run_set(target, tok, prompts, draft_for, configs, max_tokens, temp=0.0) -> dict:
    """Mean decode tokens/s per configuration; draft_for(name, prompt index) gives the draft.
    Configurations take turns on each prompt."""
    rates = {name: [] for name, _ in configs}
    extra = {name: [] for name, _ in configs}
    for i, ids in enumerate(prompts):
        for name, k in configs:
            draft = draft_for(name, i)
            _, rate, stats = ours(target, draft, tok, ids, k=k or 1, max_tokens=max_tokens,
                                  temp=temp, seed=i)
            rates[name].append(rate)
            extra[name].append({"acceptance": stats.acceptance_rate,
                                "k_histogram": stats.k_histogram,
                                "drafting_rounds": 1 - stats.k_histogram.get(0, 0) / stats.rounds})
    return {name: {"tok_s": statistics.mean(r), "runs": rates[name], "stats": extra[name]}
            for name, r in rates.items()}


def part_oracle(args) -> list[dict]:
    target, draft, tok = load_models(args.target, args.draft)
    prompts = [tok.encode(p) for p in PROMPTS[: args.prompts]]
    ours(target, draft, tok, prompts[0], k=2, max_tokens=8, temp=0.0, seed=0)  # warm-up
    refs = [ids + ours(target, None, tok, ids, k=1, max_tokens=args.max_tokens, temp=0.0,
                       seed=0)[0] for ids in prompts]
    rows = []
    for alpha in args.alphas:
        def draft_for(name, i, alpha=alpha):
            return None if name == "plain" else OracleDraft(draft, refs[i], alpha, args.seed)

        result = run_set(target, tok, prompts, draft_for, contenders(args.ks), args.max_tokens)
        plain = result["plain"]["tok_s"]
        fixed = {n: r["tok_s"] for n, r in result.items() if n.startswith("k=")}
        best = max(fixed, key=fixed.get)
        row = {"alpha": alpha, "results": result,
               "speedup": {n: r["tok_s"] / plain for n, r in result.items()},
               "best_fixed": best,
               "auto_vs_best_fixed": result["auto"]["tok_s"] / fixed[best],
               "auto_vs_best_of_plain_and_fixed": result["auto"]["tok_s"] / max(plain, fixed[best]),
               "auto_vs_plain": result["auto"]["tok_s"] / plain}
        rows.append(row)
        print(f"alpha={alpha}: " + ", ".join(f"{n} {s:.2f}x" for n, s in row["speedup"].items())
              + f"; auto/best fixed ({best}) {row['auto_vs_best_fixed']:.2f}, auto/plain "
              f"{row['auto_vs_plain']:.2f}", flush=True)
    return rows


def part_lookup(args) -> list[dict]:
    target, demo_draft, tok = load_models()
    configs = [("plain", None), ("lookup k=4", 4), ("lookup auto", "auto"),
               ("draft model k=4", 4), ("draft model auto", "auto")]

    def draft_for(name, i):
        return None if name == "plain" else "prompt-lookup" if "lookup" in name else demo_draft

    ours(target, "prompt-lookup", tok, tok.encode(EDITING[0]), k=4, max_tokens=8, temp=0.0,
         seed=0)  # warm-up
    rows = []
    # greedy code continuations repeat themselves even when the prompt does not (the demo
    # target loops); sampling at T=1 is the workload where lookup rarely finds anything
    for workload, texts, temp in [("editing, greedy", EDITING, 0.0),
                                  ("code, greedy", PROMPTS, 0.0),
                                  ("code, sampled T=1 (little repetition)", PROMPTS, 1.0)]:
        prompts = [tok.encode(t) for t in texts]
        result = run_set(target, tok, prompts, draft_for, configs, args.lookup_tokens, temp)
        plain = result["plain"]["tok_s"]
        lookup = result["lookup k=4"]["stats"]
        row = {"workload": workload, "temp": temp, "results": result,
               "speedup": {n: r["tok_s"] / plain for n, r in result.items()},
               "lookup_drafting_rounds": statistics.mean(s["drafting_rounds"] for s in lookup),
               "lookup_acceptance": statistics.mean(s["acceptance"] for s in lookup)}
        rows.append(row)
        print(f"{workload}: " + ", ".join(f"{n} {s:.2f}x" for n, s in row["speedup"].items())
              + f"; lookup k=4 drafts in {row['lookup_drafting_rounds']:.0%} of rounds, "
              f"acceptance {row['lookup_acceptance']:.2f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--lookup-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="adaptive")
    ap.add_argument("--reuse-oracle", action="store_true",
                    help="keep part 1 from the existing results/<name>.json, rerun part 2")
    args = ap.parse_args()
    dtype = default_dtype()  # what both parts' load_models() cast to (None: kept as stored)
    report = {"settings": {**vars(args), "dtype": str(dtype or "checkpoint's own"),
                           "blas": active_blas()},
              "machine": machine()}
    report["lookup"] = part_lookup(args)
    if args.reuse_oracle:
        old = json.loads((ROOT / "results" / f"{args.name}.json").read_text())
        report["oracle"], report["oracle_settings"] = old["oracle"], old["settings"]
    else:
        report["oracle"] = part_oracle(args) if args.target else []
    save(report, args.name, plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = report["oracle"]
    if rows:
        alphas = [r["alpha"] for r in rows]
        for name in rows[0]["speedup"]:
            style = dict(lw=2.5, color="black") if name == "auto" else dict(ls="--")
            left.plot(alphas, [r["speedup"][name] for r in rows], marker="o", label=name, **style)
        left.axhline(1.0, color="grey", lw=0.8)
        left.set(xlabel="oracle acceptance alpha", ylabel="decode tokens/s vs plain",
                 title="0.5B -> 1.5B shapes: fixed k vs k=auto")
        left.legend(fontsize=8)
    workloads = report["lookup"]
    names = list(workloads[0]["speedup"])
    width = 0.8 / len(workloads)
    for j, w in enumerate(workloads):
        xs = [i + (j - (len(workloads) - 1) / 2) * width for i in range(len(names))]
        bars = right.bar(xs, [w["speedup"][n] for n in names], width=width, label=w["workload"])
        right.bar_label(bars, fmt="%.2fx", fontsize=7)
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    right.set_ylim(0, max(max(w["speedup"].values()) for w in workloads) * 1.2)
    right.set(ylabel="decode tokens/s vs plain", title="demo target: prompt lookup")
    right.legend(fontsize=8)
    fig.suptitle(f"BLAS {report['settings']['blas'].split(' (')[0]}, fp32, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

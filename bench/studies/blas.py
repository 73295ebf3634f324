"""Which BLAS MLX's CPU backend runs on, and what it costs: stock (the wheel's reference BLAS) vs
OpenBLAS vs MKL, plain decode and prefill tokens/s on Qwen2.5-shaped checkpoints.

    S=~/.cache/tinydraft-mlx/shapes; python -m bench.studies.blas --models $S/0.5B $S/1.5B

Each (BLAS, model) runs in a fresh process (the BLAS is chosen before mlx.core loads, through
TINYDRAFT_BLAS). Writes results/blas.json and results/blas.png. Linux only (macOS uses Accelerate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, module_of, pyplot, save

CHOICES = ["off", "openblas", "mkl"]


def child(model_path: str, prefill_tokens: int, decode_tokens: int, repeats: int) -> dict:
    import tinydraft_mlx  # isort: skip  (the preload reads TINYDRAFT_BLAS)
    from bench.common import machine, model_dtype
    from tinydraft_mlx import load_models, stream_generate
    from tinydraft_mlx.engine.cache import make_cache
    from tinydraft_mlx.engine.speculative import prefill

    target, _, tok = load_models(model_path, "none")
    ids = [(7 * i + 11) % 5000 + 100 for i in range(prefill_tokens)]  # fixed, non-repeating
    prefill(target, make_cache(target), ids[:16])  # warm-up
    prefill_s = []
    for _ in range(repeats):
        cache = make_cache(target)
        start = time.perf_counter()
        prefill(target, cache, ids)
        prefill_s.append(time.perf_counter() - start)
    rates = []
    for _ in range(repeats):
        first = None
        for n, _token in enumerate(stream_generate(target, None, tok, ids[:16],
                                                   max_tokens=decode_tokens + 1)):
            if n == 0:
                first = time.perf_counter()
        rates.append(decode_tokens / (time.perf_counter() - first))
    return {
        "blas": tinydraft_mlx.active_blas(),
        "machine": machine(),
        "dtype": model_dtype(target),
        "prefill_tok_s": prefill_tokens / statistics.median(prefill_s),
        "decode_tok_s": statistics.median(rates),
        "prefill_s": prefill_s,
        "decode_rates": rates,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--blas", nargs="+", default=CHOICES, choices=CHOICES)
    ap.add_argument("--prefill-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--name", default="blas")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.prefill_tokens, args.decode_tokens, args.repeats)))
        return

    runs = []
    for model in args.models:
        for choice in args.blas:
            cmd = [sys.executable, "-m", module_of(__file__), "--models", model, "--child", model,
                   "--prefill-tokens", str(args.prefill_tokens),
                   "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats)]
            env = {**os.environ, "TINYDRAFT_BLAS": choice}
            done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                                  check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row.update(model=Path(model).name, choice=choice)
            runs.append(row)
            print(f"{row['model']} {choice:8s} ({row['blas'][:40]}): decode "
                  f"{row['decode_tok_s']:.2f} tok/s, prefill {row['prefill_tok_s']:.1f} tok/s",
                  flush=True)
    for row in runs:
        stock = next(r for r in runs if r["model"] == row["model"] and r["choice"] == "off")
        row["decode_vs_stock"] = row["decode_tok_s"] / stock["decode_tok_s"]
        row["prefill_vs_stock"] = row["prefill_tok_s"] / stock["prefill_tok_s"]
    report = {
        "settings": {k: v for k, v in vars(args).items() if k != "child"},
        "machine": runs[0]["machine"],
        "runs": runs,
    }
    save(report, args.name, plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    models = list(dict.fromkeys(r["model"] for r in report["runs"]))
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, metric, title in [(axes[0], "decode_vs_stock", "plain decode"),
                              (axes[1], "prefill_vs_stock", "prefill")]:
        for j, choice in enumerate(CHOICES):
            rows = [r for r in report["runs"] if r["choice"] == choice]
            if not rows:
                continue
            xs = [models.index(r["model"]) + 0.27 * (j - 1) for r in rows]
            bars = ax.bar(xs, [r[metric] for r in rows], width=0.25,
                          label={"off": "stock (reference)"}.get(choice, choice))
            ax.bar_label(bars, fmt="%.1fx", fontsize=8)
        ax.set_xticks(range(len(models)), [f"{m} shapes" for m in models])
        ax.set(title=f"{title}: tokens/s vs stock wheel", ylabel="x stock")
        ax.legend(fontsize=8)
    fig.suptitle("MLX CPU backend, fp32, 2 cores: which BLAS")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

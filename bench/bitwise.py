"""What the bit-for-bit mode costs and what it buys (engine/bitwise.py): greedy decoding of the
demo target, plain and with the draft model (fixed k and k="auto"), in the default mode and with
bitwise=True, each contender in a process of its own.

    python -m bench.bitwise                 # ~2 min here

Per contender: decode tokens/s (median over prompts), and against plain decoding in the same
mode: prompts whose tokens are equal, and the largest |log-probability difference| at any
position (0: bit for bit). Writes results/bitwise.json and .png.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from bench.common import in_fresh_process, machine, model_dtype, pyplot, save
from bench.demo_quality import held_out_prompts
from tinydraft_mlx import load_models, stream_generate
from tinydraft_mlx.engine.bitwise import ROWS

CONTENDERS = [("plain", None), ("k = 3", 3), ("k = auto", "auto")]
MODES = ["default", "bitwise"]


def worker(mode: str, k: str, prompts: int, max_tokens: int, out: str) -> dict:
    """One contender in this process: per prompt its tokens/s; its ids and log-probabilities
    saved to `out` (.npz) for the comparison."""
    target, draft, tok = load_models(dtype="float32")
    kk = None if k == "none" else (k if k == "auto" else int(k))
    rates, arrays = [], {}
    texts = held_out_prompts(prompts, seed=0)
    settings = dict(k=kk or 1, bitwise=mode == "bitwise")
    list(stream_generate(target, draft if kk else None, tok, texts[0], max_tokens=16,
                         **settings))  # warm up: the compiled steps' traces
    for i, text in enumerate(texts):
        steps = stream_generate(target, draft if kk else None, tok, text,
                                max_tokens=max_tokens, **settings)
        stamps, ids, logprobs = [], [], []
        for r in steps:
            stamps.append(time.perf_counter())
            ids.append(r.token)
            logprobs.append(r.logprobs)
        rates.append((len(ids) - 1) / (stamps[-1] - stamps[0]))
        arrays[f"ids{i}"] = mx.array(ids)
        arrays[f"logprobs{i}"] = mx.stack(logprobs)
    mx.savez(out, **arrays)
    return {"tps": statistics.median(rates), "rates": rates, "dtype": model_dtype(target)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--worker", nargs=5, metavar=("MODE", "K", "PROMPTS", "TOKENS", "OUT"))
    args = ap.parse_args()
    if args.worker:
        mode, k, prompts, tokens, out = args.worker
        print(json.dumps(worker(mode, k, int(prompts), int(tokens), out)))
        return
    runs, tmp = [], Path("/tmp/tinydraft-bitwise")
    tmp.mkdir(exist_ok=True)
    for mode in MODES:
        for name, k in CONTENDERS:
            path = tmp / f"{mode}-{k}.npz"
            run = in_fresh_process(__file__, mode, k or "none", args.prompts, args.max_tokens,
                                   path)
            runs.append({"mode": mode, "contender": name, "k": k, "path": str(path), **run})
            print(mode, name, f"{run['tps']:.1f} tok/s", flush=True)
    loaded = {id(r): mx.load(r.pop("path")) for r in runs}
    for run in runs:
        plain = loaded[next(id(r) for r in runs if r["mode"] == run["mode"] and r["k"] is None)]
        mine = loaded[id(run)]
        n = args.prompts
        run["prompts_equal_plain"] = sum(
            mine[f"ids{i}"].tolist() == plain[f"ids{i}"].tolist() for i in range(n))
        run["max_logprob_difference_vs_plain"] = max(
            float(mx.abs(mine[f"logprobs{i}"][:m] - plain[f"logprobs{i}"][:m]).max())
            for i in range(n) if (m := min(len(mine[f"ids{i}"]), len(plain[f"ids{i}"]))))
        same = next(r for r in runs if r["mode"] == "default" and r["k"] == run["k"])
        run["vs_default"] = run["tps"] / same["tps"]
    settings = {**vars(args), "dtype": runs[0]["dtype"], "rows": ROWS, "pair": "demo"}
    settings.pop("worker")
    save({"settings": settings, "machine": machine(), "runs": runs}, "bitwise", plot)


def plot(report: dict, path: Path) -> None:
    from bench.common import finish_figure

    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [name for name, _ in CONTENDERS]
    for j, mode in enumerate(MODES):
        rows = [next(r for r in report["runs"] if r["mode"] == mode and r["contender"] == n)
                for n in names]
        xs = [i + 0.4 * j for i in range(len(names))]
        ax.bar(xs, [r["tps"] for r in rows], width=0.4, label=mode)
        bx.bar(xs, [max(r["max_logprob_difference_vs_plain"], 1e-9) for r in rows], width=0.4,
               label=mode)
    for axis in (ax, bx):
        axis.set_xticks([i + 0.2 for i in range(len(names))], names)
        axis.legend()
    ax.set(ylabel="decode tokens/s (median over prompts)", title="speed, greedy")
    bx.set(yscale="log", ylabel="max |log-prob difference| vs plain (1e-9: 0)",
           title="distance from plain decoding")
    finish_figure(plt, fig, path, report, "Bit-for-bit mode on the demo pair",
                  f"{report['settings']['rows']} positions per forward")


if __name__ == "__main__":
    main()

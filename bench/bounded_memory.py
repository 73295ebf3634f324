"""Bounded vs unbounded KV cache over a long generation on the demo pair: cache bytes, process
peak memory and tokens/s along the run, speculative and plain.

    python -m bench.bounded_memory     # ~6 min on 2 CPU cores; writes results/bounded_memory.*
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from bench.common import machine, model_dtype
from tinydraft_mlx import load_models
from tinydraft_mlx.engine.cache import make_cache
from tinydraft_mlx.engine.speculative import decode

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "import os\nimport sys\n\n\ndef main(argv=None):\n"


def run(target, draft, ids, *, tokens, window, k, every):
    """Generate `tokens` tokens (EOS ignored) and sample the figures every `every` tokens."""
    margin = (k if draft is not None else 0) + 1
    tc = make_cache(target, window, margin) if window else make_cache(target)
    dc = None
    if draft is not None:
        dc = make_cache(draft, window, margin) if window else make_cache(draft)
    mx.reset_peak_memory()
    points, last_t, last_n = [], time.perf_counter(), 0
    for token in decode(target, draft, ids, k=k, max_tokens=tokens, target_cache=tc,
                        draft_cache=dc):
        n = token.stats.generated
        if n % every == 0:
            now = time.perf_counter()
            cache_bytes = sum(c.nbytes for c in tc) + sum(c.nbytes for c in dc or [])
            points.append({"tokens": n, "cache_bytes": cache_bytes,
                           "peak_memory_bytes": mx.get_peak_memory(),
                           "tokens_per_second": (n - last_n) / (now - last_t)})
            last_t, last_n = now, n
    stats = token.stats
    return {"points": points, "tokens_per_second": stats.tokens_per_second,
            "acceptance": stats.acceptance_rate, "peak_memory_bytes": mx.get_peak_memory(),
            "final_cache_bytes": points[-1]["cache_bytes"]}


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, speed) = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in report["runs"].items():
        xs = [p["tokens"] for p in res["points"]]
        mem.plot(xs, [p["cache_bytes"] / 2**20 for p in res["points"]], label=name)
        speed.plot(xs, [p["tokens_per_second"] for p in res["points"]], label=name)
    w = report["settings"]["max_kv_size"]
    mem.set(xlabel="generated tokens", ylabel="KV cache, MiB (target + draft)",
            title=f"Cache memory: max_kv_size={w} vs unbounded")
    speed.set(xlabel="generated tokens", ylabel=f"tokens/s over the last "
              f"{report['settings']['every']}", title="Throughput along the run (same machine)")
    for ax in (mem, speed):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--max-kv-size", type=int, default=256)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--every", type=int, default=256)
    args = ap.parse_args()
    target, draft, tok = load_models()
    ids = tok.encode(PROMPT)
    run(target, draft, ids, tokens=64, window=args.max_kv_size, k=args.k, every=64)  # warm-up
    runs = {}
    for name, d, window in [("speculative, bounded", draft, args.max_kv_size),
                            ("speculative, unbounded", draft, None),
                            ("plain, bounded", None, args.max_kv_size),
                            ("plain, unbounded", None, None)]:
        runs[name] = run(target, d, ids, tokens=args.tokens, window=window, k=args.k,
                         every=args.every)
        print(f"{name}: {runs[name]['tokens_per_second']:.1f} tok/s, cache "
              f"{runs[name]['final_cache_bytes'] / 2**20:.2f} MiB, peak "
              f"{runs[name]['peak_memory_bytes'] / 2**20:.1f} MiB", flush=True)
    report = {"settings": {"tokens": args.tokens, "max_kv_size": args.max_kv_size, "k": args.k,
                           "every": args.every, "prompt": PROMPT, "dtype": model_dtype(target),
                           "pair": "bundled demo pair", "eos": "ignored"},
              "machine": machine(), "runs": runs}
    out = ROOT / "results" / "bounded_memory.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))


if __name__ == "__main__":
    main()

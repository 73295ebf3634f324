"""How far greedy speculative decoding can be from plain greedy decoding: the largest difference
between the logits of a one-row forward pass (plain decoding) and of the same positions scored
together in a (k+1)-row pass (a verify), on the demo target, per dtype and k+1; and between a
sequence's 4-row verify alone and the same verify as one row of a batch of B sequences of
different lengths (`BatchCache`, batch_cache.py), per dtype and B.

    python -m bench.studies.row_consistency

Writes results/row_consistency.json and .png. Only a top-2 logit gap below these figures can flip
a greedy choice; the oracle tests compare on paths whose gaps are far above them (> 1e-3).
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
from pathlib import Path

import mlx.core as mx

from bench.common import machine, model_dtype, pyplot, save
from tinydraft_mlx import generate, load_models
from tinydraft_mlx.engine.cache import make_cache
from tinydraft_mlx.engine.cache.batch import BatchCache
from tinydraft_mlx.engine.forward import forward_batch
from tinydraft_mlx.engine.speculative import prefill

PROMPTS = [
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "import os\n\n\ndef read_lines(path):\n    with open(path) as f:",
    "    for key, value in sorted(mapping.items()):\n        if",
]


def max_difference(model, seq: list[int], start: int, rows: int) -> float:
    """max |logits| difference at positions start..start+rows-1: one pass vs one row at a time."""
    together, apart = make_cache(model), make_cache(model)
    prefill(model, together, seq[:start])
    prefill(model, apart, seq[:start])
    multi = model(mx.array([seq[start : start + rows]]), cache=together)[0]
    single = mx.concatenate([model(mx.array([[t]]), cache=apart)[0] for t in
                             seq[start : start + rows]])
    return float(mx.abs(multi.astype(mx.float32) - single.astype(mx.float32)).max())


def batch_difference(model, seqs: list[list[int]], batch: int, rows: int, shift: int) -> float:
    """max |logits| difference of every row's `rows`-token verify: in a batch of `batch`
    sequences (prefixes of different lengths) vs each sequence's verify alone."""
    starts = [min(len(s) - rows, 6 + 5 * i + shift) for i, s in
              enumerate(seqs[i % len(seqs)] for i in range(batch))]
    picked = [seqs[i % len(seqs)] for i in range(batch)]
    together = BatchCache(len(model.layers))
    together.add([_prefilled(model, s[:start]) for s, start in zip(picked, starts)])
    x = mx.array([s[start : start + rows] for s, start in zip(picked, starts)])
    multi = forward_batch(model, x, together)
    worst = 0.0
    for i, (s, start) in enumerate(zip(picked, starts)):
        alone = model(x[i : i + 1], cache=_prefilled(model, s[:start]))[0]
        worst = max(worst, float(mx.abs(multi[i].astype(mx.float32)
                                        - alone.astype(mx.float32)).max()))
    return worst


def _prefilled(model, tokens: list[int]):
    cache = make_cache(model)
    prefill(model, cache, tokens)
    return cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 3, 5, 9])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 8, 32])
    args = ap.parse_args()
    runs = []
    for dtype in args.dtypes:
        target, _, tok = load_models(draft="none", dtype=dtype)
        worst = {rows: 0.0 for rows in args.rows}
        scale, seqs = 0.0, []
        for text in PROMPTS:
            ids = tok.encode(text)
            seq = ids + generate(target, None, tok, ids, max_tokens=args.tokens)[0]
            seqs.append(seq)
            scale = max(scale, float(mx.abs(target(mx.array([seq]))).max()))
            for rows in args.rows:
                for start in range(len(ids), len(seq) - rows, 7):
                    worst[rows] = max(worst[rows], max_difference(target, seq, start, rows))
        batched = {b: max(batch_difference(target, seqs, b, 4, shift) for shift in range(0, 30, 6))
                   for b in args.batches}
        runs.append({"dtype": model_dtype(target), "max_abs_logit": scale,
                     "max_difference_by_rows": worst, "max_difference_batched_by_b": batched})
        print(dtype, worst, batched, f"(logits up to {scale:.1f})", flush=True)
    save({"settings": vars(args), "machine": machine(), "runs": runs}, "row_consistency", plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    for run in report["runs"]:
        rows = [int(r) for r in run["max_difference_by_rows"]]
        values = [max(v, 1e-9) for v in run["max_difference_by_rows"].values()]
        ax.plot(rows, values, marker="o", label=run["dtype"])
        batched = run.get("max_difference_batched_by_b", {})
        bx.plot([int(b) for b in batched], [max(v, 1e-9) for v in batched.values()], marker="o",
                label=run["dtype"])
    title = (f"demo target, {report['machine']['device']}, BLAS "
             f"{report['machine']['blas'].split(' (')[0]}")
    ax.set(yscale="log", xlabel="rows scored together (k + 1)",
           ylabel="max |logit difference| vs one row at a time (1e-9 = exactly 0)", title=title)
    bx.set(xscale="log", yscale="log", xlabel="sequences in the batch (B), 4-row verify each",
           ylabel="max |logit difference| vs the verify alone", title=title)
    ax.legend()
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

"""Batched decoding on the real Qwen2.5 shapes (random weights, bench/qwen_shapes.py) with an
oracle draft of known acceptance: where the CPU's verify cost curve takes the gain away.

    python -m bench.qwen_shapes 0.5B 1.5B      # once: ~8 GB under ~/.cache/tinydraft-mlx/shapes
    python -m bench.batch_shapes               # ~15 minutes on a 2-core machine;
                                               # results/batch_shapes.json, .png

A 1.5B-shaped target and a 0.5B-shaped draft (float32, MKL), B in {1, 4} copies of one prompt
(random weights: every row's greedy continuation is the target's, known in advance), the draft
paying its full forward cost and proposing the right token with probability alpha (0.5, 0.9),
each row drawing its own decisions (bench/oracle_draft.py `BatchOracleDraft`). Contenders, each
(contender, B, alpha) in a fresh process, interleaved: mlx-lm's `batch_generate` (no draft),
ours plain batched, ours at k = 1, 2 and "auto". Greedy, 32 tokens per row; warmed up once, then
timed once; aggregate tokens/s over the whole batch's wall time (prefill included). Greedy
outputs of ours are checked equal to the reference.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = Path(os.environ.get("TINYDRAFT_SHAPES")
              or Path.home() / ".cache" / "tinydraft-mlx" / "shapes")
SIZES = (1, 4)
ALPHAS = (0.5, 0.9)
CONTENDERS = ("mlx_lm", "plain", "k1", "k2", "auto")
MAX_TOKENS = 32
PROMPT = "def parse_args(argv=None):\n    parser = argparse.ArgumentParser("


def worker(contender: str, size: int, alpha: float) -> dict:
    from bench.common import machine, model_dtype  # noqa: I001  (before mlx.core: the BLAS preload)

    from mlx_lm.generate import batch_generate as mlx_batch
    from bench.oracle_draft import BatchOracleDraft

    from tinydraft_mlx import batch_generate, generate, load_models

    target, draft, tok = load_models(str(SHAPES / "1.5B"), str(SHAPES / "0.5B"))
    ids = tok.encode(PROMPT)
    reference, _ = generate(target, None, tok, ids, max_tokens=MAX_TOKENS + 12)
    oracle = BatchOracleDraft(draft, ids + reference, alpha)

    def run() -> int:
        if contender == "mlx_lm":
            mlx_batch(target, tok, [ids] * size, max_tokens=MAX_TOKENS)
            return size * MAX_TOKENS
        k = {"plain": 4, "k1": 1, "k2": 2, "auto": "auto"}[contender]
        results = batch_generate(target, None if contender == "plain" else oracle, tok,
                                 [ids] * size, k=k, max_tokens=MAX_TOKENS)
        assert all(t == reference[:MAX_TOKENS] for t, _ in results), "not the greedy output"
        return sum(len(t) for t, _ in results)

    run()  # warm-up: traces, and k="auto"'s costs
    start = time.perf_counter()
    tokens = run()
    seconds = time.perf_counter() - start
    return {"machine": machine(), "dtype": model_dtype(target), "contender": contender,
            "batch": size, "alpha": alpha, "tokens": tokens, "seconds": round(seconds, 3),
            "aggregate_tps": round(tokens / seconds, 2)}


def run(contender: str, size: int, alpha: float) -> dict:
    from bench.common import in_fresh_process

    return in_fresh_process(__file__, contender, size, alpha)


def plot(report: dict, path: Path) -> None:
    from bench.common import finish_figure, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(ALPHAS), figsize=(6 * len(ALPHAS), 4.2))
    for ax, alpha in zip(axes, ALPHAS):
        for i, contender in enumerate(CONTENDERS):
            values = []
            for size in SIZES:
                row = next(r for r in report["runs"] if r["contender"] == contender
                           and r["batch"] == size and (r["alpha"] == alpha
                                                       or contender in ("mlx_lm", "plain")))
                values.append(row["aggregate_tps"])
            xs = [j + (i - 2) * 0.16 for j in range(len(SIZES))]
            ax.bar(xs, values, 0.16, label={"mlx_lm": "mlx-lm batch_generate (no draft)",
                                            "plain": "ours, plain batched", "k1": "ours, k=1",
                                            "k2": "ours, k=2", "auto": 'ours, k="auto"'}[contender])
        ax.set_xticks(range(len(SIZES)), [f"B = {s}" for s in SIZES])
        ax.set(ylabel="aggregate tokens/s", title=f"oracle draft, alpha = {alpha}")
        ax.legend(fontsize=8)
    finish_figure(plt, fig, path, report, "Qwen2.5 shapes 0.5B -> 1.5B (random weights)",
                  f"{MAX_TOKENS} tokens per row")


def main() -> None:
    from bench.common import save

    runs, start = [], time.time()
    jobs = [(c, b, 0.5) for b in SIZES for c in ("mlx_lm", "plain")]
    jobs += [(c, b, a) for a in ALPHAS for b in SIZES for c in ("k1", "k2", "auto")]
    for contender, size, alpha in jobs:
        result = run(contender, size, alpha)
        runs.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "machine"}), flush=True)
    report = {"machine": runs[0]["machine"], "settings": {
        "sizes": SIZES, "alphas": ALPHAS, "max_tokens": MAX_TOKENS, "dtype": runs[0]["dtype"],
        "target": "1.5B shape", "draft": "0.5B shape (oracle)", "prompt": PROMPT,
        "seconds": round(time.time() - start)}, "runs": runs}
    save(report, "batch_shapes", plot)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))))
    else:
        main()

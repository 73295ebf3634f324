"""Draft-vocabulary pruning: draft step time and acceptance vs N.

    python -m bench.draft_vocab                       # demo pair + the 0.5B shape ($S/0.5B)

Demo pair (vocabulary 4096, counts shipped with it): for N = 512, 1024, 2048 and the full head,
the draft's step time (one token through the draft with its cache, synced, median of --steps
steps after a warm-up) and, on held-out prompts, greedy and T=1 acceptance and tokens/s of
speculative decoding (k=--k), plus whether the greedy output equals plain decoding. Qwen2.5-0.5B
shape (random weights, vocabulary 151,936; `python -m bench.qwen_shapes 0.5B`): the draft step
time for N = 16k, 32k, 64k and full (which ids are kept does not change the time). All in one
process, contenders interleaved. Writes results/draft_vocab.json and .png.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx

from bench.common import machine, model_dtype, pyplot, save
from bench.demo_quality import held_out_prompts
from tinydraft_mlx import generate, load_models
from tinydraft_mlx.engine.cache import make_cache
from tinydraft_mlx.engine.pruning import PrunedDraft, prune_draft
from tinydraft_mlx.generation.loading import load_model

SHAPES = Path.home() / ".cache" / "tinydraft-mlx" / "shapes"


def step_ms(model, steps: int, context: int = 64) -> float:
    """Median ms of one draft step (1 token, cache of `context` tokens, synced each step)."""
    cache = make_cache(model)
    model(mx.arange(context, dtype=mx.int32)[None] % 100, cache=cache)
    mx.eval([c.state for c in cache])
    x = mx.array([[7]], dtype=mx.int32)
    times = []
    for i in range(steps + 5):
        start = time.perf_counter()
        y = mx.argmax(model(x, cache=cache)[0, -1]).astype(mx.int32)
        mx.eval(y)
        if i >= 5:
            times.append((time.perf_counter() - start) * 1e3)
        x = y.reshape(1, 1)
    return statistics.median(times)


def demo(args) -> dict:
    target, draft, tok = load_models(dtype="float32")
    drafts = {n: prune_draft(draft, tok, n) for n in args.demo_n}
    drafts["full"] = draft
    prompts = held_out_prompts(args.prompts, seed=0)
    rows = {name: {"step_ms": []} for name in drafts}
    for _ in range(args.repeats):  # interleaved
        for name, d in drafts.items():
            rows[name]["step_ms"].append(step_ms(d, args.steps))
    plain = {p: generate(target, None, tok, p, max_tokens=args.max_tokens)[0] for p in prompts}
    for name, d in drafts.items():
        for label, temperature in (("greedy", 0.0), ("T=1", 1.0)):
            accepted = drafted = tokens = 0
            seconds, equal = 0.0, 0
            for i, p in enumerate(prompts):
                out, stats = generate(target, d, tok, p, k=args.k, max_tokens=args.max_tokens,
                                      temperature=temperature, seed=i)
                accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
                tokens, seconds = tokens + stats.generated, seconds + stats.decode_seconds
                equal += temperature == 0 and out == plain[p]
            rows[name][label] = {"acceptance": accepted / drafted, "tokens_per_second":
                                 tokens / seconds}
            if temperature == 0:
                rows[name][label]["equal_to_plain"] = equal / len(prompts)
        rows[name]["step_ms"] = statistics.median(rows[name]["step_ms"])
        row = rows[name]
        print(f"demo N={name}: step {row['step_ms']:.3f} ms, acceptance greedy "
              f"{row['greedy']['acceptance']:.3f}, T=1 {row['T=1']['acceptance']:.3f}", flush=True)
    return {"dtype": model_dtype(draft), "vocab": draft.args.vocab_size, "rows": rows}


def shape(args) -> dict | None:
    path = SHAPES / "0.5B"
    if not (path / "config.json").exists():
        print(f"skipping the 0.5B shape: {path} missing (python -m bench.qwen_shapes 0.5B)")
        return None
    draft, _ = load_model(path, "float32")
    width = draft.args.vocab_size
    drafts = {n: PrunedDraft(draft, list(range(n))) for n in args.shape_n}
    drafts["full"] = draft
    times = {name: [] for name in drafts}
    for _ in range(args.repeats):
        for name, d in drafts.items():
            times[name].append(step_ms(d, max(8, args.steps // 8)))
    rows = {name: {"step_ms": statistics.median(t)} for name, t in times.items()}
    for name, row in rows.items():
        print(f"0.5B shape N={name}: step {row['step_ms']:.1f} ms", flush=True)
    return {"dtype": model_dtype(draft), "vocab": width, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo-n", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--shape-n", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    report = {"settings": vars(args), "machine": machine(), "demo": demo(args),
              "shape_0.5B": shape(args)}
    save(report, "draft_vocab", plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    d = report["demo"]
    names = list(d["rows"])
    x = [d["vocab"] if n == "full" else int(n) for n in names]
    ax = axes[0]
    ax.plot(x, [d["rows"][n]["step_ms"] for n in names], "o-", color="tab:green",
            label="draft step (ms)")
    ax.set(xlabel="draft vocabulary N", ylabel="draft step (ms)", xscale="log", ylim=(0, None),
           title=f"Demo pair (vocabulary {d['vocab']})")
    ax2 = ax.twinx()
    for label, style in (("greedy", "s--"), ("T=1", "^--")):
        ax2.plot(x, [d["rows"][n][label]["acceptance"] for n in names], style, color="tab:blue",
                 label=f"acceptance, {label}")
    ax2.set(ylabel="acceptance", ylim=(0, 1))
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    s = report["shape_0.5B"]
    if s is not None:
        names = list(s["rows"])
        x = [s["vocab"] if n == "full" else int(n) for n in names]
        axes[1].plot(x, [s["rows"][n]["step_ms"] for n in names], "o-", color="tab:green")
        axes[1].set(xlabel="draft vocabulary N", ylabel="draft step (ms)", xscale="log",
                    ylim=(0, None), title="Qwen2.5-0.5B shape (random weights)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"Draft-vocabulary pruning ({report['machine']['device']}, "
                 f"{report['demo']['dtype']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

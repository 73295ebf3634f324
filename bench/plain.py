"""Plain decoding, ours vs mlx-lm's `generate_step`, on the same model object.

    python -m bench.plain                      # the demo target
    python -m bench.plain --target $S/1.5B --max-tokens 24 --prompts 2

Greedy, the demo pair's held-out prompts, interleaved runs (who goes first rotates), median of
--repeats x --prompts runs. "ours" is the token loop (`speculative.decode`), the counterpart of
`generate_step`; "ours + text" is `stream_generate` (detokenizer and responses on top). Decode
speed: (tokens - 1) / (time of the last token - time of the first), so prefill and the first
token are left out for all. Writes results/<name>.json and .png.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import statistics
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from bench.common import machine, model_dtype, pyplot, save
from bench.demo_quality import held_out_prompts
from bench.speed import decode_rate
from tinydraft_mlx import load_models, stream_generate
from tinydraft_mlx.engine.backend import generation_stream
from tinydraft_mlx.engine.speculative import decode


def ours(target, tok, ids: list[int], n: int) -> tuple[float, list[int]]:
    """Our token loop (`speculative.decode`, as `generate_step` is mlx-lm's): no text layer."""
    out, rate, _ = decode_rate((t.id, None) for t in decode(target, None, ids, max_tokens=n))
    return rate, out


def ours_text(target, tok, ids: list[int], n: int) -> tuple[float, list[int]]:
    """`stream_generate`: the loop plus the text layer (detokenizer, responses)."""
    out, rate, _ = decode_rate((r.token, None) for r in stream_generate(target, None, tok, ids,
                                                                         max_tokens=n))
    return rate, out


def theirs(target, ids: list[int], n: int) -> tuple[float, list[int]]:
    out, rate, _ = decode_rate((int(t), None) for t, _ in generate_step(
        mx.array(ids), target, max_tokens=n, stream=generation_stream()))
    return rate, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="default: the demo target")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="plain")
    args = ap.parse_args()
    target, _, tok = load_models(args.target, "none")
    prompts = [tok.encode(p) for p in held_out_prompts(args.prompts, seed=0)]
    ours(target, tok, prompts[0], 8)  # warm-up both
    theirs(target, prompts[0], 8)
    contenders = {"ours": lambda ids: ours(target, tok, ids, args.max_tokens),
                  "mlx-lm": lambda ids: theirs(target, ids, args.max_tokens),
                  "ours + text": lambda ids: ours_text(target, tok, ids, args.max_tokens)}
    names = list(contenders)
    runs = {name: [] for name in names}
    same, turn = True, 0
    for _ in range(args.repeats):
        for ids in prompts:
            turn += 1  # rotate who goes first: position in the sequence measurably matters
            outs = {}
            for name in names[turn % 3:] + names[: turn % 3]:
                speed, outs[name] = contenders[name](ids)
                runs[name].append(speed)
            same &= outs["ours"] == outs["mlx-lm"][: len(outs["ours"])] == outs["ours + text"]
    median = {k: statistics.median(v) for k, v in runs.items()}
    ratio = median["ours"] / median["mlx-lm"]
    print(f"plain decoding: ours {median['ours']:.1f} tok/s, mlx-lm generate_step "
          f"{median['mlx-lm']:.1f} tok/s: {ratio:.3f}x; with our text layer "
          f"{median['ours + text']:.1f} tok/s (same tokens: {same})")
    report = {"settings": {**vars(args), "dtype": model_dtype(target)}, "machine": machine(),
              "runs": runs, "median_tokens_per_second": median, "ratio": ratio,
              "same_tokens": same}
    save(report, args.name, plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    names = list(report["runs"])
    ax.boxplot([report["runs"][n] for n in names], tick_labels=names)
    ax.set(ylabel="decode tokens/s", title=f"Plain decoding, {report['ratio']:.3f}x mlx-lm "
           f"({report['settings']['dtype']}, {report['machine']['device']})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

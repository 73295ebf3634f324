"""Second-turn prefill with and without a prompt cache, on a multi-turn conversation.

    python -m bench.prompt_cache                                   # the demo pair
    python -m bench.prompt_cache --target $S/1.5B --draft $S/0.5B --name prompt_cache_shapes

Turn 1: a long prompt (a stdlib source file's head) and 32 generated tokens; turn 2: turn 1's
prompt + output + a new message. Turn 2's prefill is timed (and the whole turn) with a
`PromptCache` carried over from turn 1 and without (fresh caches), median of --repeats, both in
one run. Writes results/<name>.json and .png.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import statistics
import sysconfig
import time
from pathlib import Path

from bench.common import machine, model_dtype, pyplot, save
from tinydraft_mlx import PromptCache, generate, load_models


def conversation(tok, first_tokens: int, second_tokens: int) -> tuple[list[int], list[int]]:
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    ids = tok.encode(source)
    return ids[:first_tokens], ids[first_tokens : first_tokens + second_tokens]


def turn(target, draft, tok, prompt, pc, args) -> tuple[list[int], float, float, int]:
    start = time.perf_counter()
    out, stats = generate(target, draft, tok, prompt, k=args.k, max_tokens=args.max_tokens,
                          prompt_cache=pc)
    return out, stats.prefill_seconds, time.perf_counter() - start, stats.cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--first-tokens", type=int, default=600)
    ap.add_argument("--second-tokens", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="prompt_cache")
    args = ap.parse_args()
    target, draft, tok = load_models(args.target, args.draft)
    first, message = conversation(tok, args.first_tokens, args.second_tokens)
    generate(target, draft, tok, first[:16], k=args.k, max_tokens=4)  # warm-up
    runs = {"with prompt cache": [], "without": []}
    for _ in range(args.repeats):
        pc = PromptCache(target, draft)
        out, *_ = turn(target, draft, tok, first, pc, args)
        second = first + out + message
        _, prefill_s, total_s, cached = turn(target, draft, tok, second, pc, args)
        runs["with prompt cache"].append({"prefill_s": prefill_s, "turn_s": total_s,
                                          "cached_tokens": cached})
        _, prefill_s, total_s, cached = turn(target, draft, tok, second, None, args)
        runs["without"].append({"prefill_s": prefill_s, "turn_s": total_s,
                                "cached_tokens": cached})
    summary = {name: {key: statistics.median(r[key] for r in rs)
                      for key in ("prefill_s", "turn_s", "cached_tokens")}
               for name, rs in runs.items()}
    summary["second_turn_prompt_tokens"] = len(second)
    with_pc, without = summary["with prompt cache"], summary["without"]
    print(f"turn 2 ({len(second)} prompt tokens): prefill {with_pc['prefill_s']:.3f}s with the "
          f"prompt cache ({with_pc['cached_tokens']:.0f} cached) vs {without['prefill_s']:.3f}s "
          f"without ({without['prefill_s'] / with_pc['prefill_s']:.1f}x); whole turn "
          f"{with_pc['turn_s']:.2f}s vs {without['turn_s']:.2f}s")
    report = {"settings": {**vars(args), "dtype": model_dtype(target)}, "machine": machine(),
              "runs": runs, "summary": summary}
    save(report, args.name, plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    s = report["summary"]
    names = ["without", "with prompt cache"]
    prefill = [s[n]["prefill_s"] for n in names]
    rest = [s[n]["turn_s"] - s[n]["prefill_s"] for n in names]
    ax.bar(names, prefill, label="prefill")
    ax.bar(names, rest, bottom=prefill, label=f"{report['settings']['max_tokens']} tokens decode")
    ax.set(ylabel="seconds, second turn (median)",
           title=f"{report['settings']['name']}: second turn of "
                 f"{s['second_turn_prompt_tokens']} prompt tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

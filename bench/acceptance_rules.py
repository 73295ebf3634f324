"""What the same block drafter's first proposal is accepted with, at T = 0.7, under our rule and
under token matching (the rule of mlx-vlm's and oMLX's DFlash paths at T > 0).

    python -m bench.acceptance_rules      # ~1 minute on a 2-core machine

Our rule accepts a proposal x ~ q with probability min(1, p(x) / q(x)), so a position accepts
with sum_x min(p(x), q(x)); token matching draws the target's token t ~ p on its own and
accepts when t == x, sum_x p(x) q(x). Both are computed exactly per position (no sampling),
from the demo target's p and demo/dflash's q of the token after each prefix, warped alike
(T = 0.7, no top-p / top-k), along the target's own T = 0.7 continuations (seeded) of 3
held-out stdlib prompts (bench/demo_quality.py's) x 64 tokens, float32. mlx-vlm's DFlash path
itself does not run here: it drafts only for its own model classes (those with
`rollback_speculative_cache`), and the demo target is an mlx-lm Qwen2.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "tinydraft_mlx" / "demo" / "target"
DFLASH = ROOT / "tinydraft_mlx" / "demo" / "dflash"
TEMPERATURE, MAX_TOKENS, PROMPTS = 0.7, 64, 3


def measure() -> dict:
    from bench.common import machine  # noqa: I001  (before mlx.core: the BLAS preload)
    from bench.demo_quality import held_out_prompts

    import mlx.core as mx

    from tinydraft_mlx import generate, load_models

    start = time.time()
    target, block, tok = load_models(str(TARGET), str(DFLASH), dtype="float32")
    source = block.source()
    ours, match = [], []
    for i, text in enumerate(held_out_prompts(PROMPTS, seed=0)):
        prompt = tok.encode(text)
        out, _ = generate(target, None, tok, text, max_tokens=MAX_TOKENS,
                          temperature=TEMPERATURE, seed=i)
        ids = prompt + list(out)
        p_all = mx.softmax(target(mx.array([ids]))[0] / TEMPERATURE, axis=-1)
        for j in range(len(prompt), len(ids)):  # the token at j after the prefix ids[:j]
            q = mx.softmax(source.first_logits(ids[:j]) / TEMPERATURE, axis=-1)
            p = p_all[j - 1]
            ours.append(mx.minimum(p, q).sum().item())
            match.append((p * q).sum().item())
    return {"machine": machine(), "settings": {
        "temperature": TEMPERATURE, "max_tokens": MAX_TOKENS, "prompts": PROMPTS,
        "dtype": "float32", "drafter": "demo/dflash, first block position",
        "seconds": round(time.time() - start)},
        "positions": len(ours),
        "min_p_q": round(statistics.fmean(ours), 4),
        "token_match": round(statistics.fmean(match), 4),
        "ratio": round(statistics.fmean(ours) / statistics.fmean(match), 3)}


def plot(report: dict, path: Path) -> None:
    from bench.common import finish_figure, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax.bar(["min(1, p/q) (ours)", "token match"],
           [report["min_p_q"], report["token_match"]], color=["tab:blue", "tab:gray"])
    ax.set_ylabel("P(first proposal accepted)")
    finish_figure(plt, fig, path, report, "DFlash acceptance by rule",
                  f"T = {report['settings']['temperature']}, {report['positions']} positions",
                  fontsize=9)


def main() -> None:
    from bench.common import save

    report = measure()
    print(save(report, "acceptance_rules", plot))
    print({k: report[k] for k in ("positions", "min_p_q", "token_match", "ratio")})


if __name__ == "__main__":
    sys.exit(main())

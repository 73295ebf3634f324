"""Head-to-head benchmark: plain and speculative decoding, ours vs mlx-lm, same models, prompts
and settings, after a warm-up; per-round cost decomposition and the Leviathan prediction.

    python -m bench.speed --name demo_t0                              # the demo pair, greedy
    python -m bench.speed --target ~/.cache/tinydraft-mlx/shapes/1.5B \\
        --draft ~/.cache/tinydraft-mlx/shapes/0.5B --oracle-alpha 0.5 0.7 0.9 --ks 1 2 3 4 \\
        --prompts 2 --max-tokens 32 --name shapes_0.5B_1.5B

Writes results/<name>.json (machine, versions, BLAS, dtype, settings, raw per-run figures) and
results/<name>.png. Tokens/s are decode-only for every contender: from the first generated token
to the last, so prefill is excluded the same way for ours and mlx-lm's.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.sample_utils import make_sampler

from bench.common import machine, model_dtype, pair_parser, pyplot, save
from bench.oracle_draft import OracleDraft
from tinydraft_mlx import active_blas, load_models, stream_generate
from tinydraft_mlx.engine import skinny
from tinydraft_mlx.engine.backend import generation_stream
from tinydraft_mlx.engine.forward import COMPILE_ENV
from tinydraft_mlx.programs.costs import forward_ms, leviathan

PROMPTS = [
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "def read_config(path):\n    with open(path) as f:\n",
    "    for key, value in sorted(mapping.items()):\n",
    "def fibonacci(n):\n    if n < 2:\n",
]


def decode_rate(items) -> tuple[list[int], float, list]:
    """Consume (token id, extra) pairs as they are produced; return ids, decode tokens/s (from
    the first token to the last, so prefill and the generator's end are left out) and the
    extras."""
    ids, extras, stamps = [], [], []
    for token, extra in items:
        stamps.append(time.perf_counter())
        ids.append(token)
        extras.append(extra)
    elapsed = stamps[-1] - stamps[0] if stamps else 0.0
    return ids, (len(ids) - 1) / elapsed if elapsed > 0 else 0.0, extras


def ours(target, draft, tok, ids, *, k, max_tokens, temp, seed, compiled=True, **sampling):
    """Our `stream_generate`; compiled=False runs the eager forward (TINYDRAFT_COMPILE=0), so
    that ours-eager / mlx-lm is the loop's gain alone and ours / ours-eager the compiled step's.
    `sampling`: more sampling settings (top_p, top_k, ...)."""
    saved = os.environ.get(COMPILE_ENV)
    os.environ[COMPILE_ENV] = "1" if compiled else "0"
    try:
        steps = stream_generate(target, draft, tok, ids, k=k, max_tokens=max_tokens,
                                temperature=temp, seed=seed, **sampling)
        out, rate, tokens = decode_rate((r.token, r) for r in steps)
    finally:
        if saved is None:
            del os.environ[COMPILE_ENV]
        else:
            os.environ[COMPILE_ENV] = saved
    return out, rate, tokens[-1].stats


def theirs(target, draft, ids, *, k, max_tokens, temp, seed, same_kernels=False):
    """mlx-lm's own loops; returns ids, decode tokens/s and per token whether it came from the
    draft. By default on stock mlx modules (our CPU-only skinny matmul switched off for the run):
    what an mlx-lm user gets. same_kernels=True keeps the skinny modules ours run on, so that
    ours / theirs measures the loop alone."""
    if same_kernels:
        return _theirs(target, draft, ids, k=k, max_tokens=max_tokens, temp=temp, seed=seed)
    models = [m for m in (target, getattr(draft, "draft", draft)) if m is not None]
    for m in models:
        skinny.disable(m)
    try:
        return _theirs(target, draft, ids, k=k, max_tokens=max_tokens, temp=temp, seed=seed)
    finally:
        for m in models:
            skinny.enable(m)


def _theirs(target, draft, ids, *, k, max_tokens, temp, seed):
    mx.random.seed(seed)
    sampler = make_sampler(temp=temp)
    if draft is None:
        gen = generate_step(mx.array(ids), target, max_tokens=max_tokens, sampler=sampler,
                            stream=generation_stream())
        return decode_rate((int(t), False) for t, _ in gen)
    gen = speculative_generate_step(mx.array(ids), target, draft, stream=generation_stream(),
                                    num_draft_tokens=k,
                                    max_tokens=max_tokens, sampler=sampler)
    return decode_rate((int(t), bool(fd)) for t, _, fd in gen)


def mlx_lm_acceptance(from_draft: list[bool], k: int, max_tokens: int) -> float:
    """Accepted / drafted for mlx-lm's loop, from its per-token from_draft flags: a round drafts
    min(k, tokens left) and yields its accepted drafts (True) then one target token (False)."""
    drafted = accepted = emitted = 0
    pending = True  # at the start of a round
    for flag in from_draft:
        if pending:
            drafted += min(k, max_tokens - emitted)
            pending = False
        accepted += flag
        emitted += 1
        pending = not flag
    return accepted / drafted if drafted else 0.0


def cell(target, draft, tok, prompts, references, alpha, k, temp, args, *, costs, plain,
         kernel_gain) -> dict:
    """Ours and mlx-lm's speculative loops on every prompt at one (temperature, alpha, k); when
    `kernel_gain` (the skinny matmul changes our kernels), mlx-lm also on our kernels."""
    t_d, t_1, t_v = costs
    kw = dict(max_tokens=args.max_tokens, temp=temp, seed=args.seed)
    row = {"temp": temp, "alpha_oracle": alpha, "k": k, "ours": [], "ours_eager": [], "mlx_lm": [],
           "mlx_lm_same_kernels": [],
           "mlx_lm_from_draft": [], "mlx_lm_acceptance": [], "acceptance": [],
           "per_position": [], "rounds": [], "decode_s": []}
    for ids, ref in zip(prompts, references):
        d = OracleDraft(draft, ref, alpha, args.seed) if alpha is not None else draft
        _, rate, stats = ours(target, d, tok, ids, k=k, **kw)
        row["ours"].append(rate)
        row["acceptance"].append(stats.acceptance_rate)
        row["per_position"].append(stats.per_position_acceptance)
        row["rounds"].append(stats.rounds)
        row["decode_s"].append(stats.decode_seconds)
        row["ours_eager"].append(ours(target, d, tok, ids, k=k, compiled=False, **kw)[1])
        _, their_rate, flags = theirs(target, d, ids, k=k, **kw)
        row["mlx_lm"].append(their_rate)
        row["mlx_lm_from_draft"].append(sum(flags) / len(flags))
        row["mlx_lm_acceptance"].append(mlx_lm_acceptance(flags, k, args.max_tokens))
        if kernel_gain:
            row["mlx_lm_same_kernels"].append(theirs(target, d, ids, k=k, same_kernels=True,
                                                     **kw)[1])
    positions = [p for pp in row["per_position"] for p in pp[:1]]
    alpha_pos = statistics.mean(positions) if positions else 0.0
    row["speedup_ours"] = statistics.mean(row["ours"]) / statistics.mean(plain["ours"])
    row["speedup_mlx_lm"] = statistics.mean(row["mlx_lm"]) / statistics.mean(plain["ours"])
    row["ours_vs_mlx_lm"] = statistics.mean(row["ours"]) / statistics.mean(row["mlx_lm"])
    row["ours_eager_vs_mlx_lm"] = (statistics.mean(row["ours_eager"])
                                   / statistics.mean(row["mlx_lm"]))
    row["compile_gain"] = statistics.mean(row["ours"]) / statistics.mean(row["ours_eager"])
    # the loop's own gain: both engines on the same (skinny) kernels; None when they are stock
    row["ours_vs_mlx_lm_same_kernels"] = (
        statistics.mean(row["ours"]) / statistics.mean(row["mlx_lm_same_kernels"])
        if row["mlx_lm_same_kernels"] else None)
    row["predicted_speedup"] = leviathan(alpha_pos, k, t_d, t_1, t_v[k + 1])
    row["measured_vs_predicted"] = row["speedup_ours"] / row["predicted_speedup"]
    round_ms = 1000 * sum(row["decode_s"]) / sum(row["rounds"])
    row["round_ms"] = round_ms
    row["model_round_ms"] = k * t_d + t_v[k + 1]
    row["overhead_fraction"] = max(0.0, round_ms - row["model_round_ms"]) / round_ms
    row["acceptance_mean"] = statistics.mean(row["acceptance"])
    row["mlx_lm_acceptance_mean"] = statistics.mean(row["mlx_lm_acceptance"])
    same = row["ours_vs_mlx_lm_same_kernels"]
    print(f"T={temp} alpha={alpha} k={k}: ours {row['speedup_ours']:.2f}x plain, "
          f"mlx-lm {row['speedup_mlx_lm']:.2f}x, ours/mlx-lm {row['ours_vs_mlx_lm']:.2f} "
          f"(eager forward {row['ours_eager_vs_mlx_lm']:.2f})"
          + (f" ({same:.2f} on the same kernels), " if same else ", ") +
          f"predicted {row['predicted_speedup']:.2f}x, acceptance {row['acceptance_mean']:.2f} "
          f"(mlx-lm {row['mlx_lm_acceptance_mean']:.2f}), overhead {row['overhead_fraction']:.1%}",
          flush=True)
    return row


def main() -> None:
    ap = pair_parser(__doc__.splitlines()[0], prompts=6, max_tokens=96)
    ap.add_argument("--temp", type=float, nargs="+", default=[0.0])
    ap.add_argument("--oracle-alpha", type=float, nargs="*", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", required=True)
    args = ap.parse_args()
    target, draft, tok = load_models(args.target, args.draft)
    n_skinny = sum(1 for m in (target, draft) for _, x in m.named_modules()
                   if type(x).__name__.startswith("Skinny"))
    # the skinny path only changes kernels on the CPU for weights of MIN_WEIGHT or more
    kernel_gain = n_skinny > 0 and any(
        w.size >= skinny.MIN_WEIGHT for _, w in tree_flatten(target.parameters()))
    prompts = [tok.encode(p) for p in PROMPTS[: args.prompts]]
    kw = dict(max_tokens=args.max_tokens, temp=0.0, seed=args.seed)
    for k in [None, *args.ks]:  # warm-up, compiled steps traced for every shape used below
        ours(target, draft if k else None, tok, prompts[0], k=k or 1, max_tokens=args.max_tokens,
             temp=0.0, seed=0)
    theirs(target, draft, prompts[0], k=2, max_tokens=8, temp=0.0, seed=0)

    # greedy: plain decoding's speed does not depend on T
    plain = {"ours": [], "ours_eager": [], "mlx_lm": []}
    references = []
    for ids in prompts:
        out, rate, _ = ours(target, None, tok, ids, k=1, **kw)
        plain["ours"].append(rate)
        references.append(ids + out)
        plain["ours_eager"].append(ours(target, None, tok, ids, k=1, compiled=False, **kw)[1])
        plain["mlx_lm"].append(theirs(target, None, ids, k=1, **kw)[1])
    t_1 = forward_ms(target, prompts[0], 1)
    t_d = forward_ms(draft, prompts[0], 1)
    t_v = {n: forward_ms(target, prompts[0], n) for n in range(1, max(args.ks) + 2)}

    runs = []
    for temp in args.temp:
        for alpha in args.oracle_alpha or [None]:
            for k in args.ks:
                runs.append(cell(target, draft, tok, prompts, references, alpha, k, temp, args,
                                 costs=(t_d, t_1, t_v), plain=plain, kernel_gain=kernel_gain))

    report = {
        "settings": {**vars(args), "dtype": model_dtype(target), "draft_dtype": model_dtype(draft),
                     "blas": active_blas(), "skinny_matmul_modules": n_skinny},
        "machine": machine(),
        "costs_ms": {"t_1": t_1, "t_d": t_d, "t_v": t_v},
        "plain": plain,
        "runs": runs,
    }
    save(report, args.name, plot)


def _blas_name(report: dict) -> str:
    return report["settings"]["blas"].split(" (")[0]


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ax, acc) = plt.subplots(1, 2, figsize=(12, 4.8))
    groups = sorted({(r["temp"], r["alpha_oracle"]) for r in report["runs"]},
                    key=lambda g: (g[0], g[1] is None, g[1]))
    for temp, alpha in groups:
        rows = [r for r in report["runs"] if (r["temp"], r["alpha_oracle"]) == (temp, alpha)]
        ks = [r["k"] for r in rows]
        label = f"T={temp}, " + (f"alpha={alpha}" if alpha is not None else "real draft")
        line = ax.plot(ks, [r["speedup_ours"] for r in rows], marker="o", label=f"ours, {label}")
        color = line[0].get_color()
        ax.plot(ks, [r["speedup_mlx_lm"] for r in rows], marker="x", ls=":", color=color,
                label=f"mlx-lm, {label}")
        ax.plot(ks, [r["predicted_speedup"] for r in rows], ls="--", color=color, alpha=0.5,
                label=f"predicted, {label}")
        acc.plot(ks, [r["acceptance_mean"] for r in rows], marker="o", color=color,
                 label=f"ours, {label}")
        acc.plot(ks, [r["mlx_lm_acceptance_mean"] for r in rows], marker="x", ls=":",
                 color=color, label=f"mlx-lm, {label}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set(xlabel="draft tokens per round (k)", ylabel="decode tokens/s vs our plain decoding",
           title=f"{report['settings']['name']}: speed (BLAS {_blas_name(report)})")
    acc.set(xlabel="draft tokens per round (k)", ylabel="accepted / drafted", ylim=(0, 1.05),
            title="acceptance")
    ax.legend(fontsize=6, ncol=2)
    acc.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

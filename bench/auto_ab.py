"""k="auto" with one policy setting changed, against itself unchanged and plain decoding: paired,
in one process, to a percent or so.

    python bench/auto_ab.py --set FRUITLESS_SLOWING=0 --temp 0.7            # ~4 minutes
    python bench/auto_ab.py --set FRUITLESS_SLOWING=0 --draft rejected --rounds 40

The fresh- and warm-policy runs of bench/auto.py time six contenders a round, so a pair of them
sits minutes apart on a machine whose speed drifts: their cells' 95% intervals are +-2-5%. Here
three contenders take turns, in shuffled order, round after round: plain decoding, "auto" (this
checkout's policy) and "auto, B" (the same with `--set NAME=VALUE` applied to
`tinydraft_mlx.engine.policy`'s module constants while its generations run). Each auto has a draft
model object of its own, so each has its own shared policy (one pair each), warmed by two
generations of every prompt (`--fresh`: cleared before each of its generations instead). Prompts
in turn, 128 tokens, seed changing with the round; tokens/s from the call to the last token.
Ratios of means with 95% bootstrap intervals (rounds resampled). Drafts: the demo draft ("real"),
or the oracle draft at acceptance A ("alpha A", bench/oracle_draft.py; "rejected": alpha 0).
A second run with --set's roles swapped (B as this checkout's code) tells a draft object's own
effect from the setting's.

Writes results/<name>.json and results/<name>.png.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import os
import random
import statistics
import time
from pathlib import Path

from auto import FRESH_TOKENS, WARM_TEXTS, _auto_ratios, cold, trace_shapes
from common import machine, model_dtype, pyplot, save
from oracle_draft import OracleDraft

from bench import PROMPTS, ours
from tinydraft_mlx import active_blas, load_models
from tinydraft_mlx.engine import policy as policy_module

NAMES = ("plain", "auto", "auto, B")


def parse_setting(text: str) -> tuple[str, float]:
    """"NAME=VALUE" for one of the policy module's numeric constants."""
    name, _, value = text.partition("=")
    if not hasattr(policy_module, name) or not isinstance(getattr(policy_module, name),
                                                          (int, float)):
        raise argparse.ArgumentTypeError(f"--set: {name!r} is not a numeric constant of "
                                         "tinydraft_mlx.engine.policy")
    try:
        return name, type(getattr(policy_module, name))(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--set: {value!r} is not a number") from None


def ratios(runs: dict[str, list[float]]) -> dict[str, dict]:
    """The report's three ratios of means with their 95% bootstrap intervals (bench/auto.py's
    `_auto_ratios`: rounds resampled, 2000 draws)."""
    rounds = len(runs["plain"])
    (a_plain, a_b), (a_plain_95, a_b_95) = _auto_ratios(runs, ["auto, B"], rounds, "auto")
    (b_plain, _), (b_plain_95, _) = _auto_ratios(runs, ["auto"], rounds, "auto, B")
    return {"auto_vs_plain": {"ratio": a_plain, "ci95": a_plain_95},
            "auto_b_vs_plain": {"ratio": b_plain, "ci95": b_plain_95},
            "auto_vs_auto_b": {"ratio": a_b, "ci95": a_b_95}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", dest="setting", type=parse_setting, required=True,
                    metavar="NAME=VALUE", help="a policy module constant for \"auto, B\"")
    ap.add_argument("--temp", type=float, default=0.0, help="above 0: top-p 0.8, top-k 20")
    ap.add_argument("--draft", default="real", help='"real", "rejected" or "alpha A"')
    ap.add_argument("--rounds", type=int, default=48)
    ap.add_argument("--fresh", action="store_true", help="clear each auto's policy first")
    ap.add_argument("--name", default="auto_ab")
    args = ap.parse_args()
    os.environ["TINYDRAFT_POLICY_FILE"] = "off"  # the policies of this process alone
    constant, value_b = args.setting
    value_a = getattr(policy_module, constant)
    target, draft, tok = load_models()
    _, draft_b, _ = load_models()  # a second draft object: a pair (and policy) of its own
    prompts = [tok.encode(p) for p in PROMPTS[:WARM_TEXTS]]
    alpha = None if args.draft == "real" else 0.0 if args.draft == "rejected" else float(
        args.draft.split()[-1])
    if alpha is None:
        models = {"auto": [draft] * len(prompts), "auto, B": [draft_b] * len(prompts)}
    else:
        refs = [ids + ours(target, None, tok, ids, k=1, max_tokens=FRESH_TOKENS, temp=0.0,
                           seed=0)[0] for ids in prompts]
        models = {name: [OracleDraft(d, ref, alpha, 0, target) for ref in refs]
                  for name, d in (("auto", draft), ("auto, B", draft_b))}
    sampling = {} if args.temp == 0 else {"top_p": 0.8, "top_k": 20}
    values = {"auto": value_a, "auto, B": value_b}

    def generate(name: str, i: int, seed: int) -> float:
        """One 128-token generation of contender `name` on prompt i: tokens/s."""
        if name != "plain":
            setattr(policy_module, constant, values[name])
            if args.fresh:
                cold()
        start = time.perf_counter()
        out = ours(target, None if name == "plain" else models[name][i], tok, prompts[i],
                   k=1 if name == "plain" else "auto", max_tokens=FRESH_TOKENS, temp=args.temp,
                   seed=seed, **sampling)[0]
        return len(out) / (time.perf_counter() - start)

    try:
        for name in ("auto", "auto, B"):  # every compiled shape traced, then the policies warmed
            trace_shapes(target, models[name][0], tok, prompts[0], args.temp, **sampling)
        cold()
        if not args.fresh:
            for i in range(2 * len(prompts)):
                for name in ("auto", "auto, B"):
                    generate(name, i % len(prompts), i)
        runs: dict[str, list[float]] = {name: [] for name in NAMES}
        for r in range(args.rounds):
            order = list(NAMES)
            random.Random(r).shuffle(order)
            for name in order:
                runs[name].append(generate(name, r % len(prompts), 100 + r))
    finally:
        setattr(policy_module, constant, value_a)
    report = {
        "settings": {"set": {constant: value_b}, "checkout": {constant: value_a},
                     "temp": args.temp, "sampling": sampling, "draft": args.draft,
                     "rounds": args.rounds, "fresh": args.fresh,
                     "prompts": PROMPTS[:WARM_TEXTS], "max_tokens": FRESH_TOKENS,
                     "dtype": model_dtype(target), "blas": active_blas(),
                     "tokens_per_s": "from the call to the last token"},
        "machine": machine(),
        "tok_s": {name: statistics.fmean(v) for name, v in runs.items()},
        "runs": runs,
        **ratios(runs),
    }
    print({k: v for k, v in report.items() if k not in ("runs", "machine")}, flush=True)
    save(report, args.name, plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    s = report["settings"]
    (constant, value_b), = s["set"].items()
    labels = [f"auto ({constant}={s['checkout'][constant]:g})", f"auto, B ({constant}="
              f"{value_b:g})"]
    cells = [report["auto_vs_plain"], report["auto_b_vs_plain"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    values = [c["ratio"] for c in cells]
    low = [v - c["ci95"][0] for v, c in zip(values, cells)]
    high = [c["ci95"][1] - v for v, c in zip(values, cells)]
    ax.bar(range(2), values, color=["black", "grey"], yerr=[low, high], capsize=4,
           ecolor="red")
    for x, v in enumerate(values):
        ax.text(x, v + 0.01, f"{v:.3f}", ha="center")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(2), labels)
    ax.set_ylim(0.8, max(1.1, max(values) + 0.05))
    ax.set(ylabel=f"tokens/s over plain (mean of {s['rounds']} rounds, 95% interval)",
           title=f"{'fresh' if s['fresh'] else 'warm'} k='auto', {s['draft']} draft, "
                 f"T={s['temp']:g} (demo pair, {s['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

"""k="auto" against plain decoding and every fixed k, warm and cold: does it earn the default?

    python -m bench.auto                                   # the demo pair (about 6 minutes)
    S=~/.cache/tinydraft-mlx/shapes
    python -m bench.auto --target $S/1.5B --draft $S/0.5B --alphas 0.0 0.5 0.9 --prompts 1 \\
        --max-tokens 24 --temps 0.0 --repeats 1 --name auto_shapes

Cells: the real draft at each temperature (above 0 with top-p 0.8 and top-k 20, Qwen2.5-Instruct's
shipped defaults; --top-p, --top-k), and the oracle-acceptance draft (bench/oracle_draft.py,
greedy) at each alpha, alpha 0 being the case where speculation cannot pay. In every cell, per
prompt and repeat, the contenders take turns: plain, k = 1..K, "auto warm" (the pair's shared
policy, already trained by earlier generations of the same cell) and "auto cold" (a fresh policy:
the first generation of a pair in a process). Compiled steps are traced by a warm-up first, so
"cold" is about the policy, not about tracing. Tokens/s are decode-only; figures are the median
over prompts x repeats.

Writes results/<name>.json and results/<name>.png.

    python -m bench.auto --fresh [REPEATS]                 # 5 repeats: ~20 minutes
    python -m bench.auto --fresh-policy [ROUNDS]           # 24 rounds: ~8 minutes

Fresh processes, as every CLI run is: each contender (plain, k = 1..4, "auto, no file" with the
policy file off, "auto, file" with the policy file a previous process wrote) runs one prompt x
128 tokens in a process of its own (compiled steps traced first by fixed-k warm-ups, so that
"fresh" is about the policy), interleaved, REPEATS times (default 5), medians of each run's
tokens/s over plain decoding's in the same process (one 128-token generation before the run and
one after: a process's speed varied by up to 2x between processes on a shared 2-core machine);
at T = 0 and at T = 0.7 with top-p 0.8, top-k 20 (Qwen2.5-Instruct's defaults), and with the
oracle draft at alpha 0 (a draft that is always rejected: speculation cannot pay).

Fresh policies in one process (`--fresh-policy`): what a fresh process's first generation does,
resolved to a few percent. A process's speed moves +-15% between processes here and "best fixed
k" is the largest of four noisy medians, so a fresh-process run cannot tell 5%; the policy is
what is fresh in a fresh process (its compiled steps are traced first either way). So, in one
process, per cell and round, every contender (plain, k = 1..4, k="auto" with the pair's policy
cleared before its generation) runs the same 128-token generation once, in a shuffled order;
tokens/s from the call to the last token (prefills in). Ratios of means over ROUNDS rounds
(default 24), with 95% bootstrap intervals (rounds resampled); the cells above and the oracle draft
at alpha 0.9 (drafting pays clearly); results/auto_fresh_policy.*. "auto, file" is a new process
with the policy file: before its generation nothing of the pair is in memory (its policy, the
models' fingerprints) and it reads the cell's policy file, which a previous process wrote (one
generation before the rounds) and every "auto, file" generation writes in turn, as consecutive
CLI runs do.

    python -m bench.auto --fresh-prompts [ROUNDS]          # 30 rounds: ~8 minutes

The same with every prompt of bench.py's PROMPTS in turn (`--fresh-prompts`), one per round: the
bar above is one prompt's, whose draft's acceptance rises from ~0.65 over its first 64 tokens to
~0.83 over the last 64, and a fresh generation's verdict on other texts (nothing paid on most of
them, R(1) / R(0) ~2) is what a user's first runs get;
results/auto_fresh_prompts.*.

    python -m bench.auto --warm-policy [ROUNDS]            # 24 rounds: ~4 minutes

A warm policy in one process (`--warm-policy`): the same, but the pair's policy is kept: it has
generated each of WARM_TEXTS prompts twice before the rounds, and every round takes the next
prompt in turn (a server's process, whose texts change), the seed changing with the round (the
always-rejected draft follows one text: there each prompt is a pair of its own, warm the same).
Unlike the warm cells above (single 64-token generations, medians: +-20% here), it tells a few
percent apart; results/auto_warm_policy.*.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import os
import statistics
import time
from pathlib import Path

from bench.common import machine, model_dtype, pair_parser, pyplot, save
from bench.oracle_draft import OracleDraft
from bench.speed import PROMPTS, decode_rate, ours
from tinydraft_mlx import active_blas, load_models, stream_generate
from tinydraft_mlx.engine import policy as policy_module


def cold() -> None:
    """Forget every pair's shared policy: the next k="auto" generation starts from scratch."""
    policy_module.forget_pairs()


def trace_shapes(target, model, tok, ids: list[int], temp: float, **sampling) -> None:
    """Trace the compiled step of every shape a contender may use (plain and k = 1..AUTO_MAX_K)
    with short generations, so that timed rounds measure the policy, not tracing."""
    for k in (None, *range(1, policy_module.AUTO_MAX_K + 1)):
        ours(target, model if k else None, tok, ids, k=k or 1, max_tokens=12, temp=temp, seed=1,
             **sampling)


def run_cell(target, tok, prompts, draft_for, ks, args, temp) -> dict:
    names = ["plain", *(f"k={k}" for k in ks), "auto warm", "auto cold"]
    sampling = {} if temp == 0 else {"top_p": args.top_p, "top_k": args.top_k}
    rates = {name: [] for name in names}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            draft = draft_for(i)
            # train the warm policy on this pair first (not timed)
            ours(target, draft, tok, ids, k="auto", max_tokens=args.max_tokens, temp=temp,
                 seed=rep, **sampling)
            for name in names:
                k = "auto" if name.startswith("auto") else 1 if name == "plain" else int(name[2:])
                if name == "auto cold":
                    cold()
                rates[name].append(ours(target, None if name == "plain" else draft, tok, ids,
                                        k=k, max_tokens=args.max_tokens, temp=temp,
                                        seed=rep, **sampling)[1])
    tok_s = {name: statistics.median(r) for name, r in rates.items()}
    fixed = {n: v for n, v in tok_s.items() if n.startswith("k=")}
    best = max(fixed, key=fixed.get)
    row = {"tok_s": tok_s, "runs": rates, "best_fixed": best,
           "vs_plain": {n: v / tok_s["plain"] for n, v in tok_s.items()}}
    for which in ("auto warm", "auto cold"):
        key = which.replace(" ", "_")
        row[f"{key}_vs_best_fixed"] = tok_s[which] / fixed[best]
        row[f"{key}_vs_plain"] = tok_s[which] / tok_s["plain"]
        row[f"{key}_vs_best"] = tok_s[which] / max(fixed[best], tok_s["plain"])
    return row


def main() -> None:
    ap = pair_parser(__doc__.splitlines()[0], prompts=4, max_tokens=64)
    ap.add_argument("--temps", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--top-p", type=float, default=0.8, help="at temperatures > 0")
    ap.add_argument("--top-k", type=int, default=20, help="at temperatures > 0")
    ap.add_argument("--alphas", type=float, nargs="*", default=[0.0, 0.5, 0.9])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--name", default="auto")
    args = ap.parse_args()
    os.environ["TINYDRAFT_POLICY_FILE"] = "off"  # warm and cold are about this process alone
    target, draft, tok = load_models(args.target, args.draft)
    prompts = [tok.encode(p) for p in PROMPTS[: args.prompts]]
    for k in [None, *range(1, policy_module.AUTO_MAX_K + 1)]:  # trace every shape used below
        ours(target, draft if k else None, tok, prompts[0], k=k or 1, max_tokens=args.max_tokens,
             temp=0.0, seed=0)
    refs = [ids + ours(target, None, tok, ids, k=1, max_tokens=args.max_tokens, temp=0.0,
                       seed=0)[0] for ids in prompts]
    cells = []
    for temp in args.temps:
        row = run_cell(target, tok, prompts, lambda i: draft, args.ks, args, temp)
        cells.append({"draft": "real", "temp": temp, "alpha": None, **row})
        print(_line(cells[-1]), flush=True)
    for alpha in args.alphas:
        oracles = [OracleDraft(draft, ref, alpha, 0, target) for ref in refs]
        row = run_cell(target, tok, prompts, oracles.__getitem__, args.ks, args, 0.0)
        cells.append({"draft": "oracle", "temp": 0.0, "alpha": alpha, **row})
        print(_line(cells[-1]), flush=True)
    report = {"settings": {**vars(args), "dtype": model_dtype(target), "blas": active_blas()},
              "machine": machine(), "cells": cells}
    save(report, args.name, plot)


FRESH = ["plain", "k=1", "k=2", "k=3", "k=4", "auto, no file", "auto, file"]
FRESH_CELLS = [("real", 0.0), ("real", 0.7), ("alpha 0", 0.0)]
# in one process (`--fresh-policy`, `--warm-policy`) also the oracle draft at acceptance 0.9, where
# drafting pays clearly (k = 1 1.14-1.22x plain): what a policy must not miss
POLICY_CELLS = [*FRESH_CELLS, ("alpha 0.9", 0.0)]
FILE = "auto, file"  # `--fresh-policy`: a new process that starts from the policy file
FRESH_TOKENS = 128
WARM_TEXTS = 4  # prompts a warm process generates in turn (`--warm-policy`)


def fresh_worker(contender: str, cell: str, temp: float) -> dict:
    """One contender in this (fresh) process: decode tokens/s of one prompt."""
    import tinydraft_mlx.engine.policy as policy

    target, draft, tok = load_models()
    ids = tok.encode(PROMPTS[0])
    if cell == "alpha 0":
        ref = ids + ours(target, None, tok, ids, k=1, max_tokens=FRESH_TOKENS, temp=0.0,
                         seed=0)[0]
        draft = OracleDraft(draft, ref, 0.0, 0, target)
    trace_shapes(target, draft, tok, ids, temp)
    policy.forget_pairs()  # the fixed-k warm-ups timed rounds: this process starts fresh
    k = {"plain": 1}.get(contender, "auto" if contender.startswith("auto") else
                         int(contender[2:]) if contender.startswith("k=") else None)
    sampling = {} if temp == 0 else {"top_p": 0.8, "top_k": 20}

    def timed(model, k) -> tuple[list[int], float, list, float, float]:
        """ids, decode tokens/s (first token to last), extras, and from the call: seconds to
        the first token and to the last."""
        start = time.perf_counter()
        stamps = []

        def stamped():
            for r in stream_generate(target, model, tok, ids, k=k, max_tokens=FRESH_TOKENS,
                                     temperature=temp, seed=0, **sampling):
                stamps.append(time.perf_counter() - start)
                yield r.token, r

        out, rate, extra = decode_rate(stamped())
        return out, rate, extra, stamps[0], stamps[-1]

    def plain_rate() -> tuple[float, float, float]:  # this process's plain speed now
        out, rate, _, first, last = timed(None, 1)
        return rate, first, len(out) / last

    before = plain_rate()
    out, rate, extra, first, last = timed(None if contender == "plain" else draft, k)
    after = plain_rate()
    stats = extra[-1].stats
    return {"contender": contender, "cell": cell, "temp": temp, "tok_s": rate,
            "ref_tok_s": (before[0] + after[0]) / 2, "tokens": len(out),
            # from the call: the first token, and tokens / seconds to the last (prefill in)
            "ttft_ms": first * 1e3, "ref_ttft_ms": (before[1] + after[1]) / 2 * 1e3,
            "e2e_tok_s": len(out) / last, "ref_e2e_tok_s": (before[2] + after[2]) / 2,
            "drafted": stats.drafted, "accepted": stats.accepted,
            "k_histogram": {str(k): n for k, n in sorted(stats.k_histogram.items())}}


def fresh_main(repeats: int = 5) -> None:
    import json
    import subprocess
    import sys
    import tempfile

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {}

        def run(contender: str, cell: str, temp: float) -> dict:
            key = f"{cell}-{temp}"
            file = "off" if contender != "auto, file" else files.setdefault(
                key, os.path.join(tmp, f"{len(files)}.json"))
            env = dict(os.environ, HF_HUB_OFFLINE="1", TINYDRAFT_POLICY_FILE=file)
            done = subprocess.run([sys.executable, __file__, "--fresh-worker", contender, cell,
                                   str(temp)], env=env, check=True, capture_output=True,
                                  text=True, timeout=600)
            return json.loads(done.stdout.strip().splitlines()[-1])

        for cell, temp in FRESH_CELLS:  # a previous process wrote the file "auto, file" reads
            run("auto, file", cell, temp)
        for _rep in range(repeats):
            for cell, temp in FRESH_CELLS:
                for contender in FRESH:
                    runs.append(run(contender, cell, temp))
                    print(json.dumps(runs[-1]), flush=True)
    fresh_report(runs)


def fresh_report(runs: list[dict]) -> None:
    """results/auto_fresh.* from the runs of `fresh_main` (also from the lines it printed:
    `python -m bench.auto --fresh-from LOG`)."""
    cells = []
    for cell, temp in FRESH_CELLS:
        mine = {c: [r for r in runs if r["contender"] == c
                    and (r["cell"], r["temp"]) == (cell, temp)] for c in FRESH}
        tok_s = {c: statistics.median(r["tok_s"] for r in rs) for c, rs in mine.items()}
        # each run against plain decoding in its own process (before and after it): the
        # machine's speed then, which varied by 2x between processes here
        speed = {c: statistics.median(r["tok_s"] / r["ref_tok_s"] for r in rs)
                 for c, rs in mine.items()}
        fixed = {c: v for c, v in speed.items() if c.startswith("k=")}
        best = max(fixed, key=fixed.get)
        cells.append({"cell": cell, "temp": temp, "tok_s": tok_s, "vs_own_plain": speed,
                      "best_fixed": best,
                      "vs_plain": {c: v / speed["plain"] for c, v in speed.items()},
                      "vs_best_fixed": {c: v / fixed[best] for c, v in speed.items()}})
        if all("ttft_ms" in r for rs in mine.values() for r in rs):  # (older runs
            # have no time to first token): medians, each run's over its own plain's too, and
            # tokens / seconds from the call to the last token (prefill in) over plain's
            cells[-1]["ttft_ms"] = {c: statistics.median(r["ttft_ms"] for r in rs)
                                    for c, rs in mine.items()}
            cells[-1]["ttft_vs_own_plain"] = {
                c: statistics.median(r["ttft_ms"] / r["ref_ttft_ms"] for r in rs)
                for c, rs in mine.items()}
            e2e = {c: statistics.median(r["e2e_tok_s"] / r["ref_e2e_tok_s"] for r in rs)
                   for c, rs in mine.items()}
            e2e_fixed = max(v for c, v in e2e.items() if c.startswith("k="))
            cells[-1]["e2e_vs_plain"] = {c: v / e2e["plain"] for c, v in e2e.items()}
            cells[-1]["e2e_vs_best_fixed"] = {c: v / e2e_fixed for c, v in e2e.items()}
        print(cells[-1], flush=True)
    target, _, _ = load_models()
    repeats = sum(r["contender"] == "plain" and (r["cell"], r["temp"]) == FRESH_CELLS[0]
                  for r in runs)
    report = {"settings": {"prompt": PROMPTS[0], "max_tokens": FRESH_TOKENS, "repeats": repeats,
                           "sampled": {"top_p": 0.8, "top_k": 20}, "dtype": model_dtype(target),
                           "blas": active_blas()},
              "machine": machine(), "cells": cells, "runs": runs}
    save(report, "auto_fresh", fresh_plot)


def bars(axis, cells: list[dict], names: list[str], key: str,
         styles: dict[str, dict] | None = None) -> list[tuple[str, list[float], list[float]]]:
    """Draw one bar per contender in each cell, of cell[key][contender], side by side (a
    contender's matplotlib keywords in `styles`); returns (name, xs, values) per contender."""
    width = 0.8 / len(names)
    drawn = []
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(cells))]
        values = [c[key][name] for c in cells]
        axis.bar(xs, values, width=width, label=name, **(styles or {}).get(name, {}))
        drawn.append((name, xs, values))
    return drawn


def fresh_plot(report: dict, path: Path) -> None:
    plt = pyplot()
    cells = report["cells"]
    timed = all("ttft_ms" in c for c in cells)
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(15 if timed else 10, 4.5),
                             gridspec_kw={"width_ratios": [2, 1]} if timed else None)
    ax = axes[0] if timed else axes
    for name, xs, values in bars(ax, cells, FRESH, "vs_plain"):
        if name.startswith("auto"):
            for x, v in zip(xs, values):
                ax.text(x, v + 0.01, f"{v:.2f}", ha="center", fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(cells)), [f"{c['cell']} draft, T={c['temp']}" for c in cells])
    ax.set_ylim(0, 1.25)
    ax.set(ylabel=f"decode tokens/s vs plain (median of {report['settings']['repeats']})",
           title=f"k='auto' in fresh processes (demo pair, {report['settings']['dtype']}, one "
                 f"prompt x {FRESH_TOKENS} tokens; T=0.7 with top-p 0.8, top-k 20)")
    ax.legend(fontsize=8, ncol=len(FRESH), loc="upper center")
    if timed:  # time to the first token, from the call (medians)
        right = axes[1]
        bars(right, cells, FRESH, "ttft_ms")
        right.set_xticks(range(len(cells)), [f"{c['cell']}, T={c['temp']}" for c in cells],
                         fontsize=8)
        right.set(ylabel="ms (median)", title="time to the first token")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fresh_policy_main(rounds: int = 24, warm: bool = False, every_prompt: bool = False) -> None:
    """results/auto_fresh_policy.*: the module docstring's "Fresh policies in one process";
    `warm`: results/auto_warm_policy.*, its "A warm policy in one process"; `every_prompt`:
    results/auto_fresh_prompts.*, fresh policies on every prompt in turn."""
    import random
    import shutil
    import tempfile

    os.environ["TINYDRAFT_POLICY_FILE"] = "off"  # the policy of this process alone
    target, draft, tok = load_models()
    prompts = [tok.encode(p) for p in (PROMPTS[:WARM_TEXTS] if warm else PROMPTS
                                       if every_prompt else PROMPTS[:1])]
    names = ["plain", "k=1", "k=2", "k=3", "k=4", "auto"] + ([] if warm else [FILE])
    files = tempfile.mkdtemp()

    def new_process(file: str) -> None:
        """What a new process has: no pair in memory, no fingerprint computed, the policy file
        (or none)."""
        os.environ["TINYDRAFT_POLICY_FILE"] = file
        policy_module.forget_pairs()
    cells = []
    # per prompt: its greedy text, which an oracle draft ("alpha A") follows (once for every cell)
    references: list[list[int]] = []
    for cell, temp in POLICY_CELLS:
        sampling = {} if temp == 0 else {"top_p": 0.8, "top_k": 20}
        if cell.startswith("alpha") and not references:
            references = [ids + ours(target, None, tok, ids, k=1, max_tokens=FRESH_TOKENS,
                                     temp=0.0, seed=0)[0] for ids in prompts]
        models = [draft] * len(prompts) if not cell.startswith("alpha") else [
            OracleDraft(draft, ref, float(cell.split()[1]), 0, target) for ref in references]
        trace_shapes(target, models[0], tok, prompts[0], temp, **sampling)
        cold()
        file = os.path.join(files, f"{len(cells)}.json")  # this cell's policy file
        if not warm:  # written by a previous process
            new_process(file)
            ours(target, models[0], tok, prompts[0], k="auto", max_tokens=FRESH_TOKENS,
                 temp=temp, seed=len(cells) + 1000, **sampling)
            new_process("off")
        if warm:  # a process that has generated each text twice already
            for i in range(2 * len(prompts)):
                ours(target, models[i % len(prompts)], tok, prompts[i % len(prompts)],
                     k="auto", max_tokens=FRESH_TOKENS, temp=temp, seed=i, **sampling)
        runs: dict[str, list[float]] = {n: [] for n in names}
        drafted: dict[str, list[int]] = {n: [] for n in names if n.startswith("auto")}
        for r in range(rounds):
            ids, model = prompts[r % len(prompts)], models[r % len(prompts)]
            order = names[:]
            random.Random(r).shuffle(order)
            for name in order:
                if name == FILE:  # a new process that reads (and then writes) the file
                    new_process(file)
                elif not warm:
                    cold()
                k = ("auto" if name.startswith("auto") else 1 if name == "plain" else
                     int(name[2:]))
                start = time.perf_counter()
                out, _, stats = ours(target, None if name == "plain" else model, tok, ids, k=k,
                                     max_tokens=FRESH_TOKENS, temp=temp, seed=r if warm else 0,
                                     **sampling)
                runs[name].append(len(out) / (time.perf_counter() - start))
                if name in drafted:
                    drafted[name].append(stats.drafted)
                if name == FILE:
                    new_process("off")
        fixed = [n for n in names if n.startswith("k=")]
        mean = {n: statistics.fmean(v) for n, v in runs.items()}
        point, intervals = _auto_ratios(runs, fixed, rounds)
        cells.append({"cell": cell, "temp": temp, "tok_s": mean, "runs": runs,
                      "vs_plain": {n: v / mean["plain"] for n, v in mean.items()},
                      "best_fixed": max(fixed, key=mean.get),
                      "auto_vs_plain": point[0], "auto_vs_plain_95": intervals[0],
                      "auto_vs_best_fixed": point[1], "auto_vs_best_fixed_95": intervals[1],
                      "auto_drafted_median": statistics.median(drafted["auto"])})
        if FILE in names:  # the same for the process that starts from the policy file
            point, intervals = _auto_ratios(runs, fixed, rounds, FILE)
            cells[-1]["file"] = {"vs_plain": point[0], "vs_plain_95": intervals[0],
                                 "vs_best_fixed": point[1], "vs_best_fixed_95": intervals[1],
                                 "drafted_median": statistics.median(drafted[FILE])}
        print({k: v for k, v in cells[-1].items() if k != "runs"}, flush=True)
    report = {"settings": {"prompt": PROMPTS[0], "prompts": PROMPTS[: len(prompts)],
                           "max_tokens": FRESH_TOKENS, "rounds": rounds, "warm": warm,
                           "sampled": {"top_p": 0.8, "top_k": 20}, "dtype": model_dtype(target),
                           "blas": active_blas(),
                           "tokens_per_s": "from the call to the last token"},
              "machine": machine(), "cells": cells}
    shutil.rmtree(files, ignore_errors=True)
    save(report, "auto_warm_policy" if warm else "auto_fresh_prompts" if every_prompt else
         "auto_fresh_policy", fresh_policy_plot)


def _auto_ratios(runs: dict[str, list[float]], fixed: list[str], rounds: int,
                 auto: str = "auto") -> tuple[tuple[float, float], list[list[float]]]:
    """`auto`'s mean tokens/s over plain's and over the best fixed k's, and their 95% bootstrap
    intervals (rounds resampled, 2000 draws)."""
    import random

    def ratios(picks: list[int]) -> tuple[float, float]:
        mean = {n: statistics.fmean(v[i] for i in picks) for n, v in runs.items()}
        return mean[auto] / mean["plain"], mean[auto] / max(mean[n] for n in fixed)

    rng = random.Random(0)
    boots = [ratios([rng.randrange(rounds) for _ in range(rounds)]) for _ in range(2000)]
    intervals = []
    for j in (0, 1):
        ordered = sorted(b[j] for b in boots)
        intervals.append([ordered[int(0.025 * len(ordered))],
                          ordered[int(0.975 * len(ordered)) - 1]])
    return ratios(list(range(rounds))), intervals


def fresh_policy_plot(report: dict, path: Path) -> None:
    plt = pyplot()
    cells = report["cells"]
    names = list(cells[0]["vs_plain"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, xs, values in bars(ax, cells, names, "vs_plain", {"auto": {"color": "black"}}):
        if name == "auto":  # its 95% interval over plain
            low = [v - c["auto_vs_plain_95"][0] for v, c in zip(values, cells)]
            high = [c["auto_vs_plain_95"][1] - v for v, c in zip(values, cells)]
            ax.errorbar(xs, values, yerr=[low, high], fmt="none", ecolor="red", capsize=3)
            for x, v, c in zip(xs, values, cells):
                ax.text(x, v + 0.06, f"{c['auto_vs_best_fixed']:.2f}\nof best", ha="center",
                        fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(cells)), [f"{c['cell']} draft, T={c['temp']}" for c in cells])
    ax.set_ylim(0, 1.4)
    s = report["settings"]
    ax.set(ylabel=f"tokens/s vs plain (mean of {s['rounds']} rounds)",
           title=(f"k='auto' with a warm policy, one process (demo pair, {s['dtype']}, "
                  f"{len(s['prompts'])} prompts in turn" if s.get("warm") else
                  f"k='auto' with a fresh policy, one process (demo pair, {s['dtype']}, "
                  + ("one prompt" if len(s["prompts"]) == 1 else
                     f"{len(s['prompts'])} prompts in turn")) + f" x {s['max_tokens']} tokens, "
                  "prefills in)")
    ax.legend(fontsize=8, ncol=len(names), loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def label(cell: dict) -> str:
    if cell["draft"] == "real":
        return f"real draft, T={cell['temp']}"
    return f"oracle alpha={cell['alpha']}"


def _line(cell: dict) -> str:
    speeds = ", ".join(f"{n} {v:.2f}x" for n, v in cell["vs_plain"].items())
    return (f"{label(cell)}: {speeds}; auto warm / best fixed ({cell['best_fixed']}) "
            f"{cell['auto_warm_vs_best_fixed']:.2f}, / plain {cell['auto_warm_vs_plain']:.2f}; "
            f"cold {cell['auto_cold_vs_best_fixed']:.2f} / {cell['auto_cold_vs_plain']:.2f}")


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    cells = report["cells"]
    names = list(cells[0]["vs_plain"])
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cells)), 4.5))
    bars(ax, cells, names, "vs_plain",
         {"auto warm": {"color": "black"}, "auto cold": {"color": "dimgrey"}})
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(cells)), [label(c) for c in cells], fontsize=8)
    model = Path(report["settings"]["target"] or "demo").name
    ax.set(ylabel="decode tokens/s vs plain (median)",
           title=f"k='auto' vs plain and fixed k ({model}, {report['settings']['dtype']}, BLAS "
                 f"{report['settings']['blas'].split(' (')[0]})")
    ax.legend(fontsize=8, ncol=len(names))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--fresh-worker"]:
        import json

        print(json.dumps(fresh_worker(sys.argv[2], sys.argv[3], float(sys.argv[4]))))
    elif sys.argv[1:2] == ["--fresh"]:
        fresh_main(*map(int, sys.argv[2:3]))
    elif sys.argv[1:2] == ["--fresh-policy"]:
        fresh_policy_main(*map(int, sys.argv[2:3]))
    elif sys.argv[1:2] == ["--fresh-prompts"]:
        fresh_policy_main(*map(int, sys.argv[2:3]), every_prompt=True)
    elif sys.argv[1:2] == ["--warm-policy"]:
        fresh_policy_main(*map(int, sys.argv[2:3]), warm=True)
    elif sys.argv[1:2] == ["--fresh-from"]:
        import json

        with open(sys.argv[2]) as log:
            fresh_report([json.loads(line) for line in log if line.startswith('{"contender"')])
    else:
        main()

"""Where a fresh k="auto" generation's time goes, against fixed k: its rounds by kind.

    python bench/auto_budget.py [--rounds 30]              # about 2 minutes

`bench/auto.py --fresh-policy` measures how far a fresh k="auto" generation trails the best fixed
k; this shows where the time goes. In one process (policy file off), per cell and round, plain
decoding, fixed k = 1 and 2 and k="auto" with the pair's policy cleared before its generation run
the same 128-token generation, in shuffled order. Each round's wall time is read from the token
stream (public API only): from the last token of the round before to the first token of this one
(a round's tokens come out together), its k and its accepted drafts from the live statistics.
Rounds are classed by what came before them:
- first: the prefill and the first token (from the call);
- plain: a plain round;
- catch-up: k="auto"'s catch-ups of the draft on the plain rounds it missed, out of the rounds
  they began (`GenerationStats.catch_up_seconds`): a look, whether drafting followed or its
  evidence chose plain decoding (a generation's first also fills the draft with the prompt);
- switch: a drafting round after a plain one (its catch-up apart);
- change: a drafting round after a drafting round of another k;
- cold: after a round of the same k that was not accepted whole (its first draft step could not
  run ahead, behind that round's verify);
- run: after a round of the same k accepted whole.
Per contender: milliseconds, tokens and rounds a generation of each kind (means over rounds) and
the whole generation's time from the call. Cells: the real draft at T = 0 and the oracle draft at
acceptance 0.9 (bench/oracle_draft.py, greedy), where auto trails the best fixed k most.

Writes results/auto_budget.json and results/auto_budget.png.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import os
import random
import statistics
import time

from auto import cold, trace_shapes
from common import machine, model_dtype, pyplot, save
from oracle_draft import OracleDraft

from bench import PROMPTS, ours
from tinydraft_mlx import active_blas, load_models, stream_generate

CELLS = [("real", 0.0), ("alpha 0.9", 0.0)]
NAMES = ["plain", "k=1", "k=2", "auto"]
KINDS = ["first", "plain", "catch-up", "switch", "change", "cold", "run"]
TOKENS = 128


def kind_of(before: tuple[int, int] | None, drafted: int) -> str:
    """The kind of a round that drafted `drafted` tokens, after a round that drafted and kept
    `before` = (drafted, accepted) (None: this is the generation's first)."""
    if before is None:
        return "first"
    if drafted == 0:
        return "plain"
    was, kept = before
    if was == 0:
        return "switch"
    if was != drafted:
        return "change"
    return "run" if kept == was else "cold"


def generation(target, model, tok, ids: list[int], k: int | str, seed: int) -> dict:
    """One greedy generation: per kind [seconds, tokens, rounds], and its seconds from the
    call."""
    book = {kind: [0.0, 0, 0] for kind in KINDS}
    start = last = time.perf_counter()
    before, rounds, drafted, accepted, kind = None, 0, 0, 0, "first"
    caught = 0.0
    for r in stream_generate(target, model, tok, ids, k=k, max_tokens=TOKENS, temperature=0.0,
                             seed=seed):
        now = time.perf_counter()
        stats = r.stats
        if stats.rounds != rounds:  # the first token of a round
            d, a = stats.drafted - drafted, stats.accepted - accepted
            kind = kind_of(before, d)
            catch_up = stats.catch_up_seconds - caught
            if catch_up > 0:
                book["catch-up"][0] += catch_up
                book["catch-up"][2] += 1
            book[kind][0] += now - last - catch_up
            book[kind][2] += 1
            before, rounds, drafted, accepted = (d, a), stats.rounds, stats.drafted, stats.accepted
            caught = stats.catch_up_seconds
        book[kind][1] += 1
        last = now
    return {"kinds": book, "seconds": last - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    os.environ["TINYDRAFT_POLICY_FILE"] = "off"  # the policy of this process alone
    target, draft, tok = load_models()
    ids = tok.encode(PROMPTS[0])
    reference = ids + ours(target, None, tok, ids, k=1, max_tokens=TOKENS, temp=0.0, seed=0)[0]
    cells = []
    for cell, temp in CELLS:
        model = draft if cell == "real" else OracleDraft(draft, reference, float(cell.split()[1]),
                                                          0, target)
        trace_shapes(target, model, tok, ids, temp)
        runs: dict[str, list[dict]] = {name: [] for name in NAMES}
        for r in range(args.rounds):
            order = NAMES[:]
            random.Random(r).shuffle(order)
            for name in order:
                cold()  # k="auto": a fresh process's first generation
                k = "auto" if name == "auto" else 1 if name == "plain" else int(name[2:])
                runs[name].append(generation(target, None if name == "plain" else model, tok,
                                             ids, k, seed=0))
        contenders = {}
        for name, gens in runs.items():
            kinds = {kind: {"ms": statistics.fmean(g["kinds"][kind][0] for g in gens) * 1e3,
                            "tokens": statistics.fmean(g["kinds"][kind][1] for g in gens),
                            "rounds": statistics.fmean(g["kinds"][kind][2] for g in gens)}
                     for kind in KINDS}
            contenders[name] = {"ms": statistics.fmean(g["seconds"] for g in gens) * 1e3,
                                "kinds": kinds}
        fixed = [n for n in NAMES if n.startswith("k=")]
        best = min(fixed, key=lambda n: contenders[n]["ms"])
        cells.append({"cell": cell, "temp": temp, "contenders": contenders, "best_fixed": best,
                      "auto_vs_best_fixed": contenders[best]["ms"] / contenders["auto"]["ms"]})
        print(cell, {n: round(c["ms"], 1) for n, c in contenders.items()}, flush=True)
    report = {"settings": {"prompt": PROMPTS[0], "max_tokens": TOKENS, "rounds": args.rounds,
                           "dtype": model_dtype(target), "blas": active_blas(),
                           "kinds": KINDS},
              "machine": machine(), "cells": cells}
    save(report, "auto_budget", plot)


def plot(report: dict, path) -> None:
    """Per cell, a stacked bar per contender: milliseconds a generation in each kind of round."""
    plt = pyplot()
    cells = report["cells"]
    fig, axes = plt.subplots(1, len(cells), figsize=(6 * len(cells), 4.4), squeeze=False)
    colors = dict(zip(KINDS, ["#999999", "#4c72b0", "#937860", "#dd8452", "#c44e52", "#8172b3",
                              "#55a868"]))
    for ax, cell in zip(axes[0], cells):
        names = list(cell["contenders"])
        left = [0.0] * len(names)
        for kind in KINDS:
            widths = [cell["contenders"][n]["kinds"][kind]["ms"] for n in names]
            ax.barh(names, widths, left=left, color=colors[kind], label=kind)
            left = [a + b for a, b in zip(left, widths)]
        for i, n in enumerate(names):
            ax.text(left[i], i, f" {cell['contenders'][n]['ms']:.0f} ms", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set(title=f"{cell['cell']} draft, T = {cell['temp']:g}: auto "
                     f"{cell['auto_vs_best_fixed']:.2f}x the best fixed k",
               xlabel="ms a generation (mean), by kind of round")
        ax.set_xlim(0, max(left) * 1.2)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(KINDS), fontsize=8)
    fig.suptitle(f"Where a fresh k=\"auto\" generation's time goes ({report['settings']['rounds']}"
                 f" rounds, {report['settings']['max_tokens']} tokens, "
                 f"{report['machine']['device']})")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

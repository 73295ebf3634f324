"""k="auto" replayed on recorded texts: the policy's own loss, apart from this machine's noise.

    python bench/auto_replay.py                           # the demo pair (under a minute)
    git show REV:tinydraft_mlx/engine/policy.py > /tmp/old_policy.py
    python bench/auto_replay.py --policy /tmp/old_policy.py --name auto_replay_old \\
        --costs-from results/auto_replay.json

In a fresh process k="auto" decides from round timings that vary by +-30% here, and a fresh
benchmark's ratios (bench/auto.py --fresh) move by +-5% between runs of the same code: they cannot
tell the policy's own loss from the machine's noise. This drives the policy (engine/policy.py's
DraftLengthPolicy, as the decode loop does: looks with a catch-up's evidence, "one more position"
after a round accepted whole) on texts recorded from the pair, greedy: per generated token whether
the draft's argmax given the text before it was that token (a greedy draft is accepted exactly while
those hold), and per last prompt token whether target and draft predicted alike (the prompt's
evidence, booked by policies before 2026-12-03 replayed with `--policy`). Costs are measured here:
R(k), a 128-token generation's decode time over its rounds at each fixed k (plain decoding for k =
0), and the draft's catch-up, a forward of n tokens fitted as a fixed part plus a part per token.
Each round's time is multiplied by noise: none; lognormal (sigma 0.15) with 3% of rounds at 2-3x
(what per-round traces show on this machine); and the same on a level that drifts (log speed an
AR(1) of coefficient 0.97 a round, spread 0.2: bursts of other work lasting tens of rounds). Fixed k
= 0..4 are replayed on the same noise draws (round i gets the i-th factor), so "auto / best fixed"
compares like with like. The always-rejected case replays a text no draft token of which is
accepted, with a prompt that says so. Each text is replayed with a fresh policy (a new process,
policy file off), and the texts one after another `--passes` times with one policy (a warm process,
a server: the noise runs on across generations, so a burst during one can spoil the costs the next
ones start from). As in the loop, the draft starts each generation empty (its first catch-up, a
fill, feeds the prompt too, priced as a catch-up on those tokens) and a pipelined plain round
chooses the next round's k before it is booked. Left out: sampling (acceptance is then a
probability per token), plain rounds'
uneven times within a stretch (the loop's pipelining: the policy books a stretch's middle rounds),
the policy's own host time (~1% of a plain round here) and traced steps.

Writes results/<name>.json and results/<name>.png.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import importlib.util
import json
import random
import statistics
import time
from pathlib import Path

import mlx.core as mx
from common import machine, model_dtype, pyplot, save

from bench import PROMPTS, ours
from tinydraft_mlx import active_blas, load_models, stream_generate
from tinydraft_mlx.engine import policy as current_policy

# per round: lognormal sigma, share of rounds at 2-3x, and a slow drift's sigma (log speed moving
# as an AR(1) of coefficient 0.97 a round: bursts of other work lasting tens of rounds)
NOISES = {"none": (0.0, 0.0, 0.0), "this machine": (0.15, 0.03, 0.0),
          "with bursts": (0.15, 0.03, 0.2)}
FIXED = (0, 1, 2, 3, 4)
PROMPT_EVIDENCE = 16  # last prompt tokens recorded for policies that book the prompt's evidence


def record(target, draft, tok, prompt: str, tokens: int, evidence: int) -> dict:
    """A greedy text and what a greedy draft would have had accepted along it."""
    ids = tok.encode(prompt)
    out = ours(target, None, tok, ids, k=1, max_tokens=tokens, temp=0.0, seed=0)[0]
    seq = ids + out
    d_next = mx.argmax(draft(mx.array([seq]))[0], axis=-1).tolist()
    t_next = mx.argmax(target(mx.array([ids]))[0], axis=-1).tolist()
    # the prefill predicts after each of the prompt's last tokens but its last (decode feeds it)
    fed = len(ids) - 1
    prompt_agree = [float(t_next[j] == d_next[j]) for j in range(fed - evidence, fed)]
    matches = [int(d_next[len(ids) - 1 + i] == out[i]) for i in range(len(out))]
    return {"prompt": " ".join(prompt.split())[:32], "matches": matches,
            "prompt_evidence": prompt_agree, "prompt_tokens": len(ids)}


def measure_costs(target, draft, tok, tokens: int) -> dict:
    """R(k) per fixed k (a generation's decode time over its rounds), and the catch-up's fit in
    seconds."""
    ids = tok.encode(PROMPTS[0])
    rounds = {}
    for k in FIXED:
        for _ in range(2):  # the first traces
            *_, last = stream_generate(target, draft if k else None, tok, ids, k=max(k, 1),
                                       max_tokens=tokens, temperature=0.0)
        stats = last.stats
        rounds[k] = stats.decode_seconds / sum(stats.k_histogram.values())
    points = []
    for n in (4, 16, 32, 64):
        chunk = mx.array([(ids * 8)[:n]])
        mx.eval(draft(chunk))
        start = time.perf_counter()
        for _ in range(5):
            mx.eval(draft(chunk))
        points.append((n, (time.perf_counter() - start) / 5))
    mean_n = statistics.mean(n for n, _ in points)
    mean_s = statistics.mean(s for _, s in points)
    slope = sum((n - mean_n) * (s - mean_s) for n, s in points) / sum(
        (n - mean_n) ** 2 for n, _ in points)
    return {"round_seconds": rounds, "catch_up_fixed": max(0.0, mean_s - slope * mean_n),
            "catch_up_per_token": max(0.0, slope)}


def noise_factors(kind: str, seed: int, n: int) -> list[float]:
    sigma, spikes, drift = NOISES[kind]
    rng = random.Random(seed)
    factors, level = [], rng.gauss(0.0, drift) if drift else 0.0
    for _ in range(n):
        if drift:  # stationary: the level's spread stays `drift`
            level = 0.97 * level + rng.gauss(0.0, drift * (1 - 0.97**2) ** 0.5)
        f = rng.lognormvariate(level, sigma) if sigma else 1.0
        if spikes and rng.random() < spikes:
            f *= rng.uniform(2.0, 3.0)
        factors.append(f)
    return factors


def round_time(round_seconds: dict[int, float], k: int) -> float:
    """The simulated machine's round of k draft tokens: as measured, and beyond the largest
    measured k along the slope of the last two."""
    top = max(round_seconds)
    if k <= top:
        return round_seconds[k]
    return round_seconds[top] + (round_seconds[top] - round_seconds[top - 1]) * (k - top)


def new_policy(policy_module, seed: int):
    """A fresh k="auto" policy (a new process, policy file off), driven as the loop drives it."""
    policy = policy_module.DraftLengthPolicy()
    policy.rng = random.Random(seed)
    policy.looks = True
    return policy


def replay(policy_module, text: dict, costs: dict, noise: list[float], fixed: int | None,
           seed: int, policy=None, first_round: int = 0) -> tuple[float, list[int]]:
    """Tokens per second of one generation along `text`, at a fixed k or with k="auto": a fresh
    policy, or `policy` (a warm process's: what earlier generations learned); the ks chosen.
    Round i of the generation takes the noise factor of round `first_round` + i."""
    matches = text["matches"]
    n_tokens = len(matches)
    if fixed is None:
        if policy is None:
            policy = new_policy(policy_module, seed)
        if hasattr(policy, "start_generation"):  # a generation's start, as in the loop
            policy.start_generation()
        else:  # a policy from before `start_generation` (`--policy`)
            policy.plain_seconds, policy.behind = 0.0, 0
            if hasattr(policy, "look_due"):
                policy.look_due = True
        if hasattr(policy, "observe_first"):  # a policy from before 2026-12-03 (`--policy`)
            policy.observe_first(text["prompt_evidence"])
    else:
        policy = None
    # the draft starts empty (policies since 2026-12-04 know: `empty`), the first round is plain
    # without a choice, and the first catch-up (a fill) feeds the prompt too
    fills = policy is not None and hasattr(policy, "empty")
    if fills:
        policy.empty = text["prompt_tokens"] - 1
    i, seconds, ks, chosen = 0, 0.0, [], None
    while i < n_tokens:
        limit = n_tokens - i - 1
        factor = noise[(first_round + len(ks)) % len(noise)]
        catch_up, filled = 0.0, False
        if policy is None:
            k = min(fixed, limit)
        else:
            filled = fills and policy.empty > 0
            if chosen is not None:  # chosen while the plain round before was decoded
                k, chosen = chosen, None
            else:
                k = 0 if filled and i == 0 else policy.choose(limit)
            fed = policy.behind + (policy.empty if filled else 0)  # tokens the draft lacks
            if k > 0 and fed > 0:  # a look: catch up, book its evidence, choose again
                catch_up = (costs["catch_up_fixed"] + costs["catch_up_per_token"] * fed) * factor
                seen = min(policy_module.CATCH_UP_EVIDENCE, i if filled else policy.behind)
                if seen:
                    policy.observe([float(m) for m in matches[i - seen:i]])
                try:
                    k = policy.choose(limit, caught_up=True)
                except TypeError:  # a policy from before `caught_up`
                    k = policy.choose(limit)
        accepted = 0
        while accepted < k and matches[i + accepted]:
            accepted += 1
        round_seconds = round_time(costs["round_seconds"], k) * factor
        if policy is not None:
            if k == 0 and 0 < i < n_tokens - 1:  # the loop chooses past a pipelined plain
                chosen = policy.choose(limit - 1)  # round before booking it
            if fills:
                policy.update(k, accepted, round_seconds, catch_up=catch_up,
                              filled=filled and catch_up > 0)
            else:
                policy.update(k, accepted, round_seconds, catch_up=catch_up)
            asks = getattr(policy, "wants_beyond", None)  # (policies before 2026-12-04: always)
            if k and accepted == k and i + k < n_tokens and (asks is None or asks(k)):
                policy.observe_beyond(k, bool(matches[i + k]))
        seconds += round_seconds + catch_up
        i += accepted + 1
        ks.append(k)
    if policy is not None and hasattr(policy, "end_stretch"):
        policy.end_stretch()  # as `save_policy` does after a generation
    return n_tokens / seconds, ks


def replay_warm(policy_module, texts: list[dict], costs: dict, noise: list[float],
                fixed: int | None, seed: int) -> tuple[float, list[int]]:
    """Tokens per second over `texts` generated one after another by one process (a server):
    with k="auto" one policy learns across them (a fresh one for one text); the noise runs on
    from one to the next."""
    policy = new_policy(policy_module, seed) if fixed is None else None
    tokens, seconds, ks = 0, 0.0, []
    for text in texts:
        rate, chosen = replay(policy_module, text, costs, noise, fixed, seed, policy, len(ks))
        tokens += len(text["matches"])
        seconds += len(text["matches"]) / rate
        ks += chosen
    return tokens / seconds, ks


def load_policy(path: str | None):
    if path is None:
        return current_policy
    spec = importlib.util.spec_from_file_location("replayed_policy", path)
    module = importlib.util.module_from_spec(spec)
    source = Path(path).read_text().replace("from . import policy_store",
                                            "from tinydraft_mlx.engine import policy_store")
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=200, help="noise draws per text (a warm "
                    "process: a quarter as many)")
    ap.add_argument("--passes", type=int, default=5,
                    help="a warm process generates the texts one after another this many times")
    ap.add_argument("--policy", help="a policy module's file (default: this checkout's)")
    ap.add_argument("--name", default="auto_replay")
    ap.add_argument("--costs-from", help="a results JSON of this script whose measured costs to "
                    "reuse (comparing two policies on the same costs)")
    args = ap.parse_args()
    policy_module = load_policy(args.policy)
    target, draft, tok = load_models()
    texts = [record(target, draft, tok, p, args.tokens, PROMPT_EVIDENCE)
             for p in PROMPTS[: args.prompts]]
    texts.append({"prompt": "(always rejected)", "matches": [0] * args.tokens,
                  "prompt_evidence": [0.0] * PROMPT_EVIDENCE,
                  "prompt_tokens": round(statistics.fmean(t["prompt_tokens"] for t in texts))})
    if args.costs_from:
        saved = json.loads(Path(args.costs_from).read_text())["settings"]["costs"]
        costs = {**saved, "round_seconds": {int(k): v for k, v in saved["round_seconds"].items()}}
    else:
        costs = measure_costs(target, draft, tok, args.tokens)
    print("R(k) ms:", {k: round(v * 1e3, 2) for k, v in costs["round_seconds"].items()},
          f"catch-up ms: {costs['catch_up_fixed'] * 1e3:.2f} + "
          f"{costs['catch_up_per_token'] * 1e3:.3f} / token", flush=True)
    # a warm process (a server): the recorded texts one after another, PASSES times, one policy
    session = texts[:-1] * args.passes
    warm = {"prompt": f"warm: {len(texts) - 1} texts x {args.passes}",
            "matches": [m for t in session for m in t["matches"]],
            "prompt_evidence": [e for t in session for e in t["prompt_evidence"]]}
    cells = []
    for text in [*texts, warm]:
        for kind in NOISES:
            rates: dict[str, list[float]] = {f"k={k}": [] for k in FIXED}
            rates["auto"] = []
            chosen: dict[int, int] = {}
            seeds = args.seeds if text is not warm else max(1, args.seeds // 4)
            for seed in range(seeds):
                rounds = 4 * len(text["matches"])
                noise = noise_factors(kind, seed, rounds)
                texts_run = session if text is warm else [text]
                for k in FIXED:
                    rates[f"k={k}"].append(
                        replay_warm(policy_module, texts_run, costs, noise, k, seed)[0])
                rate, ks = replay_warm(policy_module, texts_run, costs, noise, None, seed)
                rates["auto"].append(rate)
                for k in ks:
                    chosen[k] = chosen.get(k, 0) + 1
            mean = {name: statistics.mean(r) for name, r in rates.items()}
            best = max((n for n in mean if n != "auto" and n != "k=0"), key=mean.get)
            per_seed = [a / max(rates[best][s], rates["k=0"][s])
                        for s, a in enumerate(rates["auto"])]
            cell = {"prompt": text["prompt"], "noise": kind, "seeds": seeds,
                    "acceptance": statistics.mean(text["matches"]),
                    "prompt_acceptance": statistics.mean(text["prompt_evidence"]),
                    "vs_plain": {n: v / mean["k=0"] for n, v in mean.items()},
                    "best_fixed": best,
                    "auto_vs_best": mean["auto"] / max(mean[best], mean["k=0"]),
                    "auto_vs_best_p10": sorted(per_seed)[len(per_seed) // 10],
                    "chosen": {str(k): n for k, n in sorted(chosen.items())}}
            cells.append(cell)
            print(f"{cell['prompt'][:24]:24s} {kind:13s} acc {cell['acceptance']:.2f} "
                  + " ".join(f"{n} {v:.2f}" for n, v in cell["vs_plain"].items())
                  + f" | auto/best {cell['auto_vs_best']:.3f} (p10 {cell['auto_vs_best_p10']:.3f})",
                  flush=True)
    report = {"settings": {**vars(args), "dtype": model_dtype(target), "blas": active_blas(),
                           "noises": NOISES, "costs": {
                               "round_seconds": {str(k): v for k, v in
                                                 costs["round_seconds"].items()},
                               "catch_up_fixed": costs["catch_up_fixed"],
                               "catch_up_per_token": costs["catch_up_per_token"]}},
              "machine": machine(), "cells": cells}
    save(report, args.name, plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    cells = report["cells"]
    prompts = list(dict.fromkeys(c["prompt"] for c in cells))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(NOISES)
    for j, kind in enumerate(NOISES):
        values = [next(c["auto_vs_best"] for c in cells if c["prompt"] == p and c["noise"] == kind)
                  for p in prompts]
        xs = [i + (j - (len(NOISES) - 1) / 2) * width for i in range(len(prompts))]
        ax.bar(xs, values, width, label=f"noise: {kind}")
        for x, v in zip(xs, values):
            ax.text(x, v + 0.005, f"{v:.2f}", ha="center", fontsize=7)
    ax.axhline(0.95, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(prompts)))
    ax.set_xticklabels([p[:22] for p in prompts], fontsize=8)
    ax.set_ylim(0.6, 1.1)
    ax.set_ylabel("auto / max(best fixed k, plain), tokens/s")
    ax.set_title("k='auto' replayed on recorded demo-pair texts (greedy, a fresh policy per text, "
                 f"{report['settings']['seeds']} noise draws; right: a warm process)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

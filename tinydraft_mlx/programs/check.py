"""`python -m tinydraft_mlx.check`: is speculative decoding exact for this pair on this machine,
and does it pay?

For each draft (a model, "prompt-lookup" or "none"):
1. Greedy identity: speculative vs plain greedy for k in {1, 2, 4, 8} on the prompts. A
   divergence is reported with its position and the plain run's top-2 logit margin there; below
   the dtype's float tolerance (NEAR_TIE) it is a near-tie flip (a one-row and a (k+1)-row pass
   round differently), at a clear margin it is a failure.
2. Sampling exactness: the first generated token at the user's settings (default T=1), sampled
   with independent seeds, against the target's exact distribution at that position (its own
   logits, warped): Pearson chi-square, failing below p = 3.2e-5 (z = 4 under the Wilson-Hilferty
   approximation, the test suite's bound), on the prompt where the draft's first proposal is
   least likely to be accepted, so that the acceptance rule matters most.
3. Costs: t_1, t_d, t_v(n) for n = 1..9 (cached forward passes), host overhead per round.
4. Acceptance overall and per position, greedy and at the user's temperature.
5. Leviathan's predicted speedup per k from 3 and 4, the measured speedup per k (decode tokens/s
   against plain decoding, same prompts), and the recommended k, draft or plain decoding. A cost
   curve that does not rise with n (a busy machine: t_v(4) = 113 ms after t_v(3) = 2.5 ms was
   seen) is flagged and predicts nothing.

With `--tree N` the drafts verify candidate trees of N nodes, k deep (engine/trees.py): checks 1,
2 and 4 and the measured speedups as above; nothing predicted (5 is a chain's cost model) and
nothing written to the policy file.

What it measured for each drafting draft (round costs per k, acceptance per position) is written
to `k="auto"`'s policy file as that pair's entry (see engine/policy_store.py), so a checked pair
starts informed in the next process.

Every forward runs on the generation stream the decode loop uses (a second stream means a second
thread calling the BLAS on the CPU, which distorts every figure after it).

Exit status 0 when exact, 1 when an exactness check fails, 2 on bad arguments, 3 when the check
itself fails to run (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, NoReturn

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..engine.backend import active_blas, device_name, generation_stream
from ..engine.drafters import resolve_drafter
from ..engine.drafters.mtp import MTP
from ..engine.policy import record_rounds, sampling_regime
from ..engine.rounds import BatchDecoder
from ..engine.sampling import ParameterError, SamplingParams, check_int, warp
from ..engine.tree_verify import check_budget
from ..engine.trees import MAX_TREE
from ..generation.api import generate, stream_generate
from ..generation.loading import (
    DEMO_DIR,
    ModelLoadError,
    default_draft,
    load_draft,
    load_head,
    load_models,
)
from ..generation.prompt_cache import PromptCache
from .costs import draft_ms, leviathan, target_costs

KS = (1, 2, 4, 8)
NEAR_TIE = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 2.5e-1}  # top-2 gaps that may flip
CURVE_DROP = 0.8  # t_v(n) below this share of a smaller n's: the curve does not rise, unreliable
CHI2_Z = 4.0  # fail above the Wilson-Hilferty 1 - 3.2e-5 quantile
P_FAIL = 0.5 * math.erfc(CHI2_Z / math.sqrt(2))
PROMPTS = [
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def read_config(path):\n    with open(path) as f:\n",
    "    for key, value in sorted(mapping.items()):\n",
]


# -- statistics -----------------------------------------------------------------------------------

def chi_square(counts: Counter, probs: np.ndarray, n: int) -> tuple[float, int]:
    """Pearson's statistic of observed token `counts` against `probs`, pooling the cells with
    expected count < 5; an observed token of probability 0 gives inf. Returns (statistic, df)."""
    if any(probs[t] <= 0 for t in counts):
        return math.inf, 1
    expected = n * probs
    big = np.flatnonzero(expected >= 5)
    observed = np.array([counts.get(int(t), 0) for t in big], dtype=np.float64)
    stat = float((((observed - expected[big]) ** 2) / expected[big]).sum())
    rest_expected = n - expected[big].sum()
    cells = len(big)
    if rest_expected > 1e-9:
        rest_observed = n - observed.sum()
        stat += (rest_observed - rest_expected) ** 2 / rest_expected
        cells += 1
    return stat, max(cells - 1, 1)


def chi2_p_value(stat: float, df: int) -> float:
    """Upper tail of chi-square(df) at `stat`, by the Wilson-Hilferty normal approximation."""
    if math.isinf(stat):
        return 0.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def compute_dtype(model: nn.Module) -> str:
    """The least precise floating dtype among the model's parameters: what its matmuls round
    in ("float32", "float16", "bfloat16"). A quantized model's weights are integers (uint32);
    its scales and the rest say how it computes."""
    floats = {str(w.dtype).removeprefix("mlx.core.") for _, w in
              tree_flatten(model.parameters()) if mx.issubdtype(w.dtype, mx.floating)}
    for name in ("bfloat16", "float16", "float32"):  # least precise first
        if name in floats:
            return name
    return "float32"


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
               for _, m in model.named_modules())


def rising(t_v: dict[int, float]) -> bool:
    """Whether a verify cost curve rises with n as a real one does (up to noise): no t_v(n)
    below CURVE_DROP x the largest t_v of a smaller n. A curve that falls was measured on a
    busy machine, and a prediction from it means nothing."""
    highest = 0.0
    for n in sorted(t_v):
        if t_v[n] < CURVE_DROP * highest:
            return False
        highest = max(highest, t_v[n])
    return True


def plain_reference(target, tok, ids: list[int], n: int) -> dict[str, Any]:
    """Plain greedy tokens, the top-2 logit gap at each position, and the decode rate."""
    tokens, margins = [], []
    for r in stream_generate(target, None, tok, ids, max_tokens=n):
        tokens.append(r.token)
        top2 = np.sort(np.array(r.logprobs.astype(mx.float32)))[-2:]
        margins.append(float(top2[1] - top2[0]))
    return {"tokens": tokens, "margins": margins, "stats": r.stats}


def _add_positions(hits: list[int], reached: list[int], stats) -> None:
    """Add a generation's per-position accepted / reached counts to running totals."""
    for i, (a, r) in enumerate(zip(stats.position_accepted, stats.position_reached)):
        hits[i], reached[i] = hits[i] + a, reached[i] + r


def greedy_runs(target, draft, tok, prompts, refs, ks, max_tokens, tolerance,
                tree: int | None = None) -> dict[str, Any]:
    """Speculative greedy vs plain for every prompt and k (with `tree`: candidate trees of that
    budget, k deep): divergences (near-tie or not), the tokens compared, acceptance, and decode
    rates per k next to a plain run of the same prompt timed just before (side by side, so a
    noisy machine shifts both)."""
    out = {"divergences": [], "compared_tokens": 0, "per_k": {}}
    totals = {k: Counter() for k in ks}
    hits = {k: [0] * k for k in ks}
    reached = {k: [0] * k for k in ks}
    for p, (ids, ref) in enumerate(zip(prompts, refs)):
        _, plain = generate(target, None, tok, ids, max_tokens=max_tokens)
        for k in ks:
            got, stats = generate(target, draft, tok, ids, k=k, max_tokens=max_tokens, tree=tree)
            position = next((i for i, (a, b) in enumerate(zip(got, ref["tokens"])) if a != b),
                            None)
            out["compared_tokens"] += len(got) if position is None else position
            if position is not None:
                margin = ref["margins"][position]
                out["divergences"].append({"prompt": p, "k": k, "position": position,
                                           "margin": margin, "near_tie": margin < tolerance})
            totals[k].update(tokens=stats.generated, seconds=stats.decode_seconds,
                             plain_tokens=plain.generated, plain_seconds=plain.decode_seconds,
                             accepted=stats.accepted, drafted=stats.drafted, rounds=stats.rounds)
            _add_positions(hits[k], reached[k], stats)
    for k, t in totals.items():
        rate = t["tokens"] / t["seconds"] if t["seconds"] else 0.0
        plain_rate = t["plain_tokens"] / t["plain_seconds"] if t["plain_seconds"] else 0.0
        out["per_k"][k] = {
            "tokens_per_second": rate,
            "plain_tokens_per_second": plain_rate,
            "speedup": rate / plain_rate if plain_rate else 0.0,
            "acceptance": t["accepted"] / t["drafted"] if t["drafted"] else 0.0,
            "per_position": [h / r if r else None for h, r in zip(hits[k], reached[k])],
            "round_ms": 1000 * t["seconds"] / max(1, t["rounds"]),
            "rounds": t["rounds"],
            "plain_tokens": t["plain_tokens"],
            "position_accepted": hits[k],
            "position_reached": reached[k],
        }
    return out


def _first_distributions(target, draft, ids, sampling) -> tuple[np.ndarray, float]:
    """The target's warped first-token distribution p after `ids`, and sum(min(p, q)) with the
    draft model's q (the probability that its first proposal is accepted; 1.0 without a model)."""
    with mx.stream(generation_stream()):
        p = np.array(warp(target(mx.array([ids]))[0, -1], sampling)).astype(np.float64)
        logits = resolve_drafter(draft, target=target).first_logits(ids)
        if logits is None:
            return p / p.sum(), 1.0
        q = np.array(warp(logits, sampling)).astype(np.float64)
    width = min(len(p), len(q))
    return p / p.sum(), float(np.minimum(p[:width], q[:width]).sum())


def sampling_check(target, draft, tok, prompts, sampling: SamplingParams, samples: int,
                   k: int = 1, tree: int | None = None) -> dict[str, Any]:
    """First-token distribution of `samples` unseeded runs (k drafts in the first round, so the
    accept and the residual paths of the rejection rule both shape it) against the target's
    warped distribution, on the prompt where draft and target disagree most (lowest
    sum(min(p, q))): there a wrong acceptance rule shows most. (A seeded run's tokens are plain
    decoding's by construction, engine/sampling/seeded.py; the suite checks that coupling.)"""
    firsts = [_first_distributions(target, draft, ids, sampling) for ids in prompts]
    chosen = min(range(len(prompts)), key=lambda i: firsts[i][1])
    ids, (probs, overlap) = prompts[chosen], firsts[chosen]
    start = time.perf_counter()
    counts, paths = first_tokens(target, draft, tok, ids, sampling, samples, k, tree=tree)
    stat, df = chi_square(counts, probs, samples)
    return {"p_value": chi2_p_value(stat, df), "statistic": stat, "df": df, "samples": samples,
            "prompt": chosen, "first_acceptance_probability": overlap,
            "first_token_paths": dict(paths), "seconds": time.perf_counter() - start,
            "support": int((probs > 0).sum())}


def first_tokens(target, draft, tok, ids: list[int], sampling: SamplingParams, samples: int,
                 k: int, rows: int = 100, tree: int | None = None) -> tuple[Counter, Counter]:
    """The first token after `ids` of `samples` unseeded sequences drafting k in their first
    round, and which path gave it ("accepted" draft or "resampled"), run `rows` at a time as
    the sequences of one batch (the engine the server runs; each row draws with its own
    uniforms, so the samples are independent). Every row starts from a copy of the prompt's
    caches, prefilled once."""
    drafter = resolve_drafter(draft, target=target)
    cache = PromptCache(target, draft)
    generate(target, draft, tok, ids, k=k, max_tokens=1, prompt_cache=cache)  # the prompt in
    counts, paths = Counter(), Counter()
    for begin in range(0, samples, rows):
        decoder = BatchDecoder(target, drafter.model, max_k=max(1, k, tree or 0))
        uids = []
        for _ in range(min(rows, samples - begin)):
            row = cache.copy()
            row.reuse(ids)
            uids.append(decoder.insert(ids, draft=resolve_drafter(draft, target=target), k=k,
                                       max_tokens=k + 1, sampling=sampling,
                                       target_cache=row.target_cache,
                                       draft_cache=row.draft_cache, tree=tree))
        firsts = {}
        while len(decoder):
            for uid, tokens in decoder.step().items():
                firsts.setdefault(uid, tokens[0])
        for uid in uids:
            counts[firsts[uid].id] += 1
            paths["accepted" if firsts[uid].from_draft else "resampled"] += 1
    return counts, paths


def temperature_acceptance(target, draft, tok, prompts, sampling, max_tokens, k,
                           tree: int | None = None) -> dict:
    """Acceptance overall and per position at the user's sampling settings (unseeded: the
    rejection rule, which accepts more than a seed's coupling)."""
    accepted = drafted = 0
    hits, reached = [0] * k, [0] * k
    for ids in prompts:
        _, stats = generate(target, draft, tok, ids, k=k, max_tokens=max_tokens,
                            temperature=sampling.temperature, top_p=sampling.top_p,
                            top_k=sampling.top_k, min_p=sampling.min_p, tree=tree)
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
        _add_positions(hits, reached, stats)
    return {"acceptance": accepted / drafted if drafted else 0.0,
            "per_position": [h / r if r else None for h, r in zip(hits, reached)],
            "position_accepted": hits, "position_reached": reached}


# -- one draft ------------------------------------------------------------------------------------

def check_draft(name, target, draft, tok, prompts, refs, args, sampling, tolerance,
                measured: dict[str, Any]) -> dict:
    """All five checks for one draft; `measured`: the target's costs. With `args.tree` a
    drafting draft verifies trees (no chain cost model: nothing predicted)."""
    tree = args.tree if resolve_drafter(draft).drafts else None
    greedy = greedy_runs(target, draft, tok, prompts, refs, args.ks, args.max_tokens, tolerance,
                         tree)
    failures = [d for d in greedy["divergences"] if not d["near_tie"]]
    c = {**measured, "t_d": draft_ms(draft, prompts[0], args.repeats, target)}
    block = resolve_drafter(draft, target=target).block  # one draft forward a round
    steps = {k: 1 if block else k for k in args.ks}
    pooled = [greedy["per_k"][k]["per_position"][0] for k in args.ks
              if greedy["per_k"][k]["per_position"][0] is not None]
    alpha = statistics.mean(pooled) if pooled else 0.0
    sampled = sampling_check(target, draft, tok, prompts, sampling, args.samples, tree=tree)
    overhead = {}
    for k in args.ks if tree is None else []:  # round time beyond k draft steps + a verify
        round_ms = greedy["per_k"][k]["round_ms"]
        model_ms = steps[k] * c["t_d"] + c["t_v"][k + 1]
        overhead[k] = max(0.0, round_ms - model_ms) / round_ms if round_ms else 0.0
    c["host_overhead_per_round"] = overhead
    c["rising"] = rising(c["t_v"])
    predicted = {k: leviathan(alpha, k, c["t_d"], c["t_1"], c["t_v"][k + 1], steps[k])
                 if c["rising"] and tree is None else None for k in args.ks}
    return {
        "draft": name,
        # the baseline: its "speedups" are plain vs plain (noise)
        "plain": not resolve_drafter(draft).drafts,
        "greedy_identical": not failures,
        "greedy": greedy,
        "sampling_p_value": sampled["p_value"],
        "sampling": sampled,
        "costs": c,
        "acceptance": {
            "greedy": {k: {"overall": v["acceptance"], "per_position": v["per_position"]}
                       for k, v in greedy["per_k"].items()},
            "sampled": temperature_acceptance(target, draft, tok, prompts, sampling,
                                              args.max_tokens, 4, tree),
            "alpha_first_position": alpha,
        },
        "predicted_speedup": predicted,
        "measured_speedup": {k: greedy["per_k"][k]["speedup"] for k in args.ks},
    }


def save_policy_entry(target, draft, result: dict, sampling: SamplingParams) -> None:
    """What the check measured for a drafting draft, written to `k="auto"`'s policy file as the
    pair's entry (round costs per k from the greedy runs, R(0) from the plain runs beside them;
    per-position acceptance greedy and at the user's settings), so that a checked pair starts
    informed in the next process. Nothing is written when the policy file is off."""
    drafter = resolve_drafter(draft)
    if not drafter.drafts:
        return
    per_k = result["greedy"]["per_k"]
    rounds = {k: (v["round_ms"] / 1000, v["rounds"]) for k, v in per_k.items()}
    first = next(iter(per_k.values()))
    if first["plain_tokens_per_second"] > 0:
        rounds[0] = (1 / first["plain_tokens_per_second"], first["plain_tokens"])
    width = max(len(v["position_reached"]) for v in per_k.values())
    hits, reached = [0.0] * width, [0.0] * width  # pooled over k (record_rounds keeps k_max)
    for v in per_k.values():
        for i, (a, r) in enumerate(zip(v["position_accepted"], v["position_reached"])):
            hits[i], reached[i] = hits[i] + a, reached[i] + r
    record_rounds(target, drafter.policy_key, sampling_regime(SamplingParams()), rounds, hits,
                  reached)
    sampled = result["acceptance"]["sampled"]
    record_rounds(target, drafter.policy_key, sampling_regime(sampling), {},
                  sampled["position_accepted"], sampled["position_reached"])


def recommend(results: list[dict]) -> dict[str, Any]:
    """The draft and k with the best measured speedup, or plain decoding when none beats 1."""
    best = max(((r, k, s) for r in results if not r["plain"]
                for k, s in r["measured_speedup"].items()), key=lambda t: t[2], default=None)
    if best is None:
        return {"draft": "none", "k": 0, "why": "only plain decoding was checked"}
    if best[2] <= 1.0:
        return {"draft": "none", "k": 0, "why": f"no draft and k beat plain decoding here "
                f"(best measured {best[2]:.2f}x): use plain decoding, a better draft, or "
                "k=auto"}
    r, k, s = best
    predicted = r["predicted_speedup"][k]
    why = (f"predicted {predicted:.2f}x from costs and acceptance "
           f"{r['acceptance']['alpha_first_position']:.2f}" if predicted is not None
           else "no prediction: the cost curve does not rise with n")
    return {"draft": r["draft"], "k": k, "why": f"measured {s:.2f}x plain decoding at k={k} "
                                                 f"({why})"}


# -- the command ----------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def setup_arg_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tinydraft-mlx-check",
                description="Is speculative decoding exact for this pair here, and does it pay?")
    p.add_argument("--target", "--model", default=None, help="target (default: the demo target)")
    p.add_argument("--draft", action="append", default=None,
                   help="a draft model, 'default' (the target's default draft), 'prompt-lookup' "
                        "or 'none'; repeat to compare several (default: 'default')")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="prompts: a JSON list of strings, or text with prompts separated by "
                        "lines holding only '---' (default: 6 built-in code/text prompts)")
    p.add_argument("--temp", type=float, default=1.0, help="sampling check temperature (1.0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--json", default=None, metavar="OUT", help="write the report as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="cost curve and speedup per k (needs matplotlib)")
    p.add_argument("--tree", type=int, default=None, metavar="N",
                   help=f"check candidate trees of at most N nodes (1..{MAX_TREE}), k deep")
    p.add_argument("--quick", action="store_true",
                   help="2 prompts x 32 tokens, 2000 samples (under a minute on the demo pair)")
    return p


def read_prompts(path: str | None) -> list[str]:
    if path is None:
        return list(PROMPTS)
    text = Path(path).read_text()
    if path.endswith(".json"):
        prompts = json.loads(text)
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"--prompts {path}: a JSON file must hold a list of strings")
    else:
        prompts = [p.strip("\n") for p in text.split("\n---\n")]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts in the file")
    return prompts


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load the models and run every check; returns the report (no printing)."""
    sampling = SamplingParams(args.temp, args.top_p, args.top_k, args.min_p)
    if sampling.greedy:
        raise ParameterError("--temp", "> 0 for the sampling check", args.temp)
    check_budget(args.tree, MAX_TREE)
    names = args.draft or ["default"]
    paths = [default_draft(args.target) if n == "default" else n for n in names]
    target, first, tok = load_models(args.target, paths[0], dtype=args.dtype)
    drafts = [first] + [load_head(target, args.target or DEMO_DIR / "target")
                        if str(d).lower() == MTP else load_draft(d, tok, dtype=args.dtype)
                        for d in paths[1:]]
    texts = args.texts[: args.n_prompts]
    prompts = [tok.encode(t) for t in texts]
    generate(target, first, tok, prompts[0], k=2, max_tokens=8)  # warm-up
    refs = [plain_reference(target, tok, ids, args.max_tokens) for ids in prompts]
    dtype = compute_dtype(target)
    tolerance = NEAR_TIE[dtype]
    measured = target_costs(target, prompts[0], max(args.ks), args.repeats)
    results = [check_draft(name, target, d, tok, prompts, refs, args, sampling, tolerance,
                           measured) for name, d in zip(names, drafts)]
    for d, result in zip(drafts, results):
        if args.tree is None:  # k="auto" learns chains
            save_policy_entry(target, d, result, sampling)
    return {
        "target": args.target or "bundled demo target",
        "settings": {"prompts": len(prompts), "max_tokens": args.max_tokens, "ks": args.ks,
                     "samples": args.samples, "sampling": vars(sampling), "dtype": dtype,
                     "quantized": is_quantized(target),
                     "near_tie_tolerance": tolerance, "sampling_fail_below": P_FAIL,
                     "device": device_name(), "blas": active_blas(), "quick": args.quick,
                     "tree": args.tree},
        "greedy_identical": all(r["greedy_identical"] for r in results),
        "sampling_p_value": min(r["sampling_p_value"] for r in results),
        "drafts": results,
        "recommended": recommend(results),
        "recommended_k": recommend(results)["k"],
        "costs": {r["draft"]: r["costs"] for r in results},
        "acceptance": {r["draft"]: r["acceptance"] for r in results},
        "predicted_speedup": {r["draft"]: r["predicted_speedup"] for r in results},
        "measured_speedup": {r["draft"]: r["measured_speedup"] for r in results},
    }


def exact(report: dict[str, Any]) -> bool:
    return report["greedy_identical"] and report["sampling_p_value"] >= P_FAIL


def format_report(report: dict[str, Any]) -> str:
    """The one-screen text report."""
    s = report["settings"]
    lines = [f"tinydraft-mlx check: {report['target']} ({s['dtype']}, {s['device']}, BLAS "
             f"{s['blas'].split(' (')[0]}); {s['prompts']} prompts x {s['max_tokens']} tokens"
             + (f"; candidate trees of {s['tree']} nodes, k deep" if s.get("tree") else "")]
    for r in report["drafts"]:
        g, c = r["greedy"], r["costs"]
        bad = [d for d in g["divergences"] if not d["near_tie"]]
        ties = [d for d in g["divergences"] if d["near_tie"]]
        verdict = "identical" if not g["divergences"] else (
            f"{len(ties)} near-tie flip(s) (margin < {s['near_tie_tolerance']:g}), no failure"
            if not bad else f"FAILED: {len(bad)} divergence(s) at clear margins")
        lines.append(f"\ndraft {r['draft']}")
        lines.append(f"  greedy identity, k in {s['ks']}: {verdict} "
                     f"({g['compared_tokens']} tokens compared)")
        for d in bad[:3]:
            lines.append(f"    prompt {d['prompt']}, k={d['k']}: position {d['position']}, "
                         f"plain top-2 margin {d['margin']:.3g}")
        sp = r["sampling"]
        ok = "ok" if sp["p_value"] >= P_FAIL else "FAILED"
        lines.append(f"  sampling exactness (T={s['sampling']['temperature']}, first token, "
                     f"{sp['samples']} samples): chi-square {sp['statistic']:.1f} on {sp['df']} "
                     f"df, p = {sp['p_value']:.3g} ({ok}; fails below {P_FAIL:.1e})")
        t_v = " ".join(f"{v:.1f}" for v in c["t_v"].values())
        lines.append(f"  costs (ms): t_1 {c['t_1']:.1f}, t_d {c['t_d']:.1f}, t_v(1..) {t_v}")
        if not c["rising"]:
            lines.append("  WARNING: the verify cost curve does not rise with n (the machine was "
                         "busy?): no speedup is predicted from it; rerun on a quiet machine")
        acc = r["acceptance"]
        lines.append("  acceptance, greedy: " + ", ".join(
            f"k={k} {v['overall']:.2f}" for k, v in acc["greedy"].items())
            + f"; sampled (k=4): {acc['sampled']['acceptance']:.2f}")
        if c["host_overhead_per_round"]:  # a chain's cost model (none for trees)
            lines.append("  host overhead per round (beyond k t_d + t_v(k+1)): " + ", ".join(
                f"k={k} {v:.0%}" for k, v in c["host_overhead_per_round"].items()))
        if r["plain"]:
            lines.append("  plain decoding against itself (this machine's run-to-run noise): "
                         + ", ".join(f"{v:.2f}x" for v in r["measured_speedup"].values()))
            continue
        lines.append("  speedup per k, predicted / measured: " + ", ".join(
            f"k={k} {_times(r['predicted_speedup'][k])} / {r['measured_speedup'][k]:.2f}x"
            for k in s["ks"]))
    rec = report["recommended"]
    lines.append(f"\nrecommended: draft {rec['draft']}, k={rec['k']}: {rec['why']}")
    lines.append("result: EXACT" if exact(report) else "result: NOT EXACT (see above)")
    return "\n".join(lines)


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cost, speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in report["drafts"]:
        c = r["costs"]
        ns = [int(n) for n in c["t_v"]]
        line = cost.plot(ns, [v / c["t_1"] for v in c["t_v"].values()], marker="o",
                         label=f"t_v(n) / t_1 ({r['draft']})")
        cost.axhline(c["t_d"] / c["t_1"], ls=":", color=line[0].get_color(),
                     label=f"t_d / t_1 ({r['draft']})")
        if r["plain"]:
            continue
        ks = [int(k) for k in r["measured_speedup"]]
        line = speed.plot(ks, list(r["measured_speedup"].values()), marker="o",
                          label=f"measured ({r['draft']})")
        if c["rising"]:
            speed.plot(ks, list(r["predicted_speedup"].values()), ls="--",
                       color=line[0].get_color(), label=f"predicted ({r['draft']})")
    cost.set(xlabel="tokens in one target pass (n)", ylabel="time / one-token step",
             title="verify cost curve")
    speed.axhline(1.0, color="black", lw=0.8)
    speed.set(xlabel="draft tokens per round (k)", ylabel="decode speed vs plain",
              title=f"speedup ({'EXACT' if exact(report) else 'NOT EXACT'})")
    cost.legend(fontsize=7)
    speed.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns 0 when exact, 1 when an exactness check fails, 3 when it fails to
    run; exits with status 2 on bad arguments."""
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    args.n_prompts, args.max_tokens, args.samples = (2, 32, 2000) if args.quick else (4, 64, 5000)
    args.ks, args.repeats = list(KS), 3 if args.quick else 5
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.exit(2, f"{parser.prog}: error: --plot needs matplotlib: "
                           "pip install 'tinydraft-mlx[bench]'\n")
    try:
        check_int("--top-k", args.top_k, 0)
        args.texts = read_prompts(args.prompts)  # read once, before any model loads
    except (ParameterError, ValueError, OSError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    try:
        report = run(args)
    except (ParameterError, ModelLoadError) as err:  # the flags named something unusable
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    except Exception as err:  # the check itself failed: not the user's arguments
        print(f"{parser.prog}: error while checking: {type(err).__name__}: {err}",
              file=sys.stderr)
        return 3
    print(format_report(report))
    if args.json is not None:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    if args.plot is not None:
        plot(report, args.plot)
    return 0 if exact(report) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Candidate trees against chains on the demo pair: tokens per target forward at the same number
of verified positions, and what a tree round's parts cost.

    python -m bench.trees      # ~5 minutes on a 2-core machine; results/trees.json, .png

Part 1, tau (tokens per target forward, hardware-independent): each drafter of the demo pair
(the 0.9M draft model "model", the EAGLE-3 head "eagle3", the DFlash block drafter "dflash"),
T in {0, 0.7 (unseeded: min(1, p/q) on a chain; each prompt run SAMPLED times)}, 3 held-out
stdlib prompts (bench/demo_quality.py's) x 64 tokens, float32. At N verified draft positions
per round (N + 1 with the root, N in {4, 8, 15}): a chain of k = N against a tree of budget N.
A block drafter's tree is DDTree's, 15 deep (its block's reach: one draft forward either way); a
draft model's or a head's tree is its chain of max(2, N // 2) drafts (half the chain's draft
steps) with the likeliest siblings filling the budget (at T = 0.7 the spine is taken whole and
tested by rejection, the siblings by the residual's draw). Greedy outputs are checked equal to
plain decoding's.

Part 2, costs of a tree round (demo pair, draft model, budget 16, depth 8, greedy), B in
{1, 8}: the verify of 17 positions through the tree mask against the chain verify of the same
17 positions, growing the trees on the host (`tree_verify.shapes`, with its read of the
candidates), their layout, the commit's compaction, and a whole round (`BatchDecoder.step`),
each the median of REPEATS timings in one process; shares are of the round.

Part 3, tokens per second on this machine (greedy, the same 3 prompts x 64 tokens, prefill
included), each contender in a process of its own after a warm-up generation, SPEED_REPEATS
runs interleaved, medians: plain decoding, the DFlash drafter's chain (k = 15) and trees
(budgets 8, 15, 32), the draft model's chain (k = 4) and tree (k = 4, budget 8), and each
drafter with k = "auto" alone and with tree = 8 (each round the tree or the k = "auto" chain,
whichever has recently given more tokens per second); k = "auto" starts unlearned in every
process (TINYDRAFT_POLICY_FILE=off).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EAGLE = ROOT / "tinydraft_mlx" / "demo" / "eagle3"
DFLASH = ROOT / "tinydraft_mlx" / "demo" / "dflash"
DRAFTERS = ("model", "eagle3", "dflash")
POSITIONS = (4, 8, 15)
TEMPERATURES = (0.0, 0.7)
PROMPTS, MAX_TOKENS = 3, 64
SAMPLED = 4  # runs of each prompt at T > 0 (unseeded: tau is an average over draws)
REPEATS = 20
SPEED_REPEATS = 3
# contender -> (drafter, k, tree)
SPEED = {"plain": (None, 1, None), "dflash chain k=15": ("dflash", 15, None),
         "dflash tree 8": ("dflash", 15, 8), "dflash tree 15": ("dflash", 15, 15),
         "dflash tree 32": ("dflash", 15, 32), "dflash auto": ("dflash", "auto", None),
         "dflash auto tree 8": ("dflash", "auto", 8), "model chain k=4": ("model", 4, None),
         "model tree 8": ("model", 4, 8), "model auto": ("model", "auto", None),
         "model auto tree 8": ("model", "auto", 8)}


def _models():
    from tinydraft_mlx import load_models
    from tinydraft_mlx.engine.drafters.dflash import load_dflash
    from tinydraft_mlx.generation.loading import load_eagle

    target, draft, tok = load_models(dtype="float32")
    return target, tok, {"model": draft, "eagle3": load_eagle(target, EAGLE),
                         "dflash": load_dflash(target, DFLASH)}


def tau(target, tok, drafters) -> dict:
    from bench.demo_quality import held_out_prompts
    from tinydraft_mlx import generate

    prompts = held_out_prompts(PROMPTS, seed=0)
    out: dict = {}
    for temperature in TEMPERATURES:
        plain = [generate(target, None, tok, p, max_tokens=MAX_TOKENS)[0] for p in prompts]
        for name, drafter in drafters.items():
            for n in POSITIONS:
                for shape in ("chain", "tree"):
                    generated = rounds = nodes = 0
                    k = n if shape == "chain" else 15 if name == "dflash" else max(2, n // 2)
                    # unseeded draws: each prompt SAMPLED times at T > 0
                    for i, p in enumerate(prompts * (SAMPLED if temperature else 1)):
                        ids, stats = generate(target, drafter, tok, p, max_tokens=MAX_TOKENS,
                                              k=k, tree=n if shape == "tree" else None,
                                              temperature=temperature)
                        assert temperature or ids == plain[i], (name, n, shape)
                        generated, rounds = generated + stats.generated, rounds + stats.rounds
                        nodes += stats.drafted
                    out.setdefault(f"T={temperature}", {}).setdefault(name, {}).setdefault(
                        shape, {})[n] = {"k": k, "tau": round(generated / rounds, 3),
                                         "verified_per_round": round(nodes / rounds, 2)}
    return out


def _median(f, repeats: int = REPEATS) -> float:
    import mlx.core as mx

    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        mx.eval(f())
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def costs(target, tok, drafters) -> dict:
    from bench.demo_quality import held_out_prompts

    prompts = [tok.encode(p) for p in held_out_prompts(8, seed=0)]
    return {f"B={batch}": _costs(target, drafters["model"], prompts[:batch])
            for batch in (1, 8)}


def _costs(target, draft, prompts: list[list[int]]) -> dict:
    """The parts of a tree round for these prompts' rows, in ms, and their shares."""
    import mlx.core as mx

    from tinydraft_mlx import BatchDecoder
    from tinydraft_mlx.engine.tree_verify import compact, forward, layout, shapes

    decoder = BatchDecoder(target, draft)
    for p in prompts:
        decoder.insert(p, draft="model", k=8, tree=16, max_tokens=10_000)
    for _ in range(3):  # joined, drafted a few rounds
        decoder.step()

    def whole_round():
        decoder.step()
        return []

    whole = _median(whole_round, 10)
    rows, cache = decoder.rows, decoder.target_cache
    for row in rows:
        row.round_k = 8
    proposals = decoder.drafting.propose(rows, [8] * len(rows))
    mx.eval(proposals.chain)
    trees = shapes(rows, proposals)
    placed = layout(trees)
    tokens = placed.tokens
    lengths = list(cache.lengths)
    # a path of 4 nodes and the last node per row (a commit that moves keys)
    paths = [list(range(min(len(t), 4))) + ([len(t) - 1] if len(t) > 4 else []) for t in trees]

    def verify_tree():
        logits = forward(target, cache, tokens, placed)
        cache.rollback(lengths)
        return logits

    def verify_chain():
        logits = cache.forward(target, tokens)
        cache.rollback(lengths)
        return logits

    def commit():
        compact(cache.kv, [n - 1 for n in lengths], paths)
        return [layer.keys for layer in cache.kv]

    def grow():
        shapes(rows, proposals)
        return []

    def lay():
        layout(trees)
        return []

    parts = {"tree verify": _median(verify_tree), "chain verify": _median(verify_chain),
             "grow trees": _median(grow), "layout": _median(lay),
             "compaction": _median(commit), "round": whole}
    return {"positions": tokens.shape[1], **{k: round(v, 3) for k, v in parts.items()},
            "shares": {k: round(v / whole, 3) for k, v in parts.items()
                       if k not in ("round", "chain verify")},
            "tree / chain verify": round(parts["tree verify"] / parts["chain verify"], 3)}


def speed_worker(contender: str) -> dict:
    """One contender's tokens per second (Part 3), in this process."""
    os.environ["TINYDRAFT_POLICY_FILE"] = "off"  # every process starts unlearned
    from bench.common import machine  # noqa: I001  (before mlx.core: the BLAS preload)
    from bench.demo_quality import held_out_prompts
    from tinydraft_mlx import generate

    target, tok, drafters = _models()
    name, k, tree = SPEED[contender]
    drafter = drafters.get(name)
    prompts = held_out_prompts(PROMPTS, seed=0)
    generate(target, drafter, tok, prompts[0], k=k, tree=tree, max_tokens=16)  # warm-up
    start, generated, rounds = time.perf_counter(), 0, 0
    for p in prompts:
        _, stats = generate(target, drafter, tok, p, k=k, tree=tree, max_tokens=MAX_TOKENS)
        generated, rounds = generated + stats.generated, rounds + stats.rounds
    seconds = time.perf_counter() - start
    return {"contender": contender, "tps": round(generated / seconds, 2),
            "tau": round(generated / rounds, 3), "blas": machine()["blas"]}


def speed() -> dict:
    from bench.common import in_fresh_process

    runs = [in_fresh_process(__file__, contender) for _ in range(SPEED_REPEATS)
            for contender in SPEED]
    plain = statistics.median(r["tps"] for r in runs if r["contender"] == "plain")
    out = {}
    for contender in SPEED:
        tps = statistics.median(r["tps"] for r in runs if r["contender"] == contender)
        tau = next(r["tau"] for r in runs if r["contender"] == contender)
        out[contender] = {"tps": tps, "vs_plain": round(tps / plain, 3), "tau": tau}
    return out


def measure() -> dict:
    from bench.common import machine  # noqa: I001  (before mlx.core: the BLAS preload)

    start = time.time()
    target, tok, drafters = _models()
    report = {"machine": machine(), "settings": {
        "dtype": "float32", "drafters": list(DRAFTERS), "positions": list(POSITIONS),
        "temperatures": list(TEMPERATURES), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
        "sampled_runs": SAMPLED,
        "cost_settings": "draft model, budget 16, depth 8, greedy", "repeats": REPEATS,
        "speed_repeats": SPEED_REPEATS}}
    report["tau"] = tau(target, tok, drafters)
    report["costs"] = costs(target, tok, drafters)
    report["speed"] = speed()
    report["settings"]["seconds"] = round(time.time() - start)
    return report


def plot(report: dict, path: Path) -> None:
    from bench.common import finish_figure, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    colors = {"model": "tab:blue", "eagle3": "tab:green", "dflash": "tab:red"}
    for ax, temperature in zip(axes[:2], report["tau"]):
        for name, shapes in report["tau"][temperature].items():
            for shape, style in (("chain", "--"), ("tree", "-")):
                xs = [int(n) for n in shapes[shape]]
                ax.plot(xs, [v["tau"] for v in shapes[shape].values()], style, marker="o",
                        color=colors[name], label=f"{name} {shape}")
        ax.set_xlabel("draft positions verified per round (chain k / tree budget)")
        ax.set_ylabel("tokens per target forward (tau)")
        ax.set_title(temperature)
        ax.legend(fontsize=8)
    ax = axes[2]
    labels = ["tree verify", "grow trees", "layout", "compaction"]
    for i, parts in enumerate(report["costs"].values()):
        bottom = 0.0
        for j, label in enumerate(labels):
            share = parts["shares"][label]
            ax.bar(i, share, bottom=bottom, color=f"C{j}", label=label if i == 0 else None)
            bottom += share
    ax.set_xticks(range(len(report["costs"])), list(report["costs"]))
    ax.set_ylabel("share of a tree round")
    ax.set_title("tree round parts (model, budget 16)")
    ax.legend(fontsize=8)
    finish_figure(plt, fig, path, report, "Candidate trees vs chains, demo pair",
                  f"{report['settings']['prompts']} prompts x "
                  f"{report['settings']['max_tokens']} tokens", fontsize=10)


def main() -> None:
    from bench.common import save

    report = measure()
    print(save(report, "trees", plot))
    print(report["tau"], report["costs"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(speed_worker(sys.argv[2])))
    else:
        sys.exit(main())

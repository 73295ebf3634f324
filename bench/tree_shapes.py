"""What a tree verify costs on shapes users run: Qwen3-4B- and Qwen3.5-4B-shaped random targets
(mlx-lm's own models, random weights, float32; Qwen3.5's Gated DeltaNet layers run along each
branch, depth by depth: cache/branches.py), t_v(n) with a tree mask against the causal verify of
the same n positions, and the speed-up a DFlash tree would give under a cost model.

    python -m bench.tree_shapes     # ~6 minutes on a 2-core machine, ~6 GB of memory

As bench/dflash_shapes.py (whose SHAPES these are): each target is built with MEASURED of its
layers (Qwen3.5's 3:1 Gated DeltaNet : attention pattern kept) and its full depth is
extrapolated, t(n) = t_head(n) + (layers / MEASURED) (t_small(n) - t_head(n)), t_head
the final norm and LM head on n positions measured apart; each t the median of REPEATS after a
warm-up, the tree's and the causal verify of each n measured back to back, after a 64-token
prompt, one row (B = 1), each shape in a process of its own. The tree
is a binary one (node i's parent is (i - 1) // 2, depth log2(n)), laid out and masked as the
engine's (`tree_verify.forward`); the causal verify is the batch cache's own forward of the same
positions.

The model, labelled as one: a round of a DFlash drafter costs t_block + t_v(n + 1) and emits
tau tokens, so speed-up = tau t_1 / (t_block + t_v(n + 1)), with t_block from
results/dflash_shapes.json (the same shape's 5-layer drafter) and tau, chain and tree at the
same n, from results/trees.json (the demo pair's DFlash drafter, greedy: a small drafter's
acceptance, not a published one's).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("qwen3-4b", "qwen3.5-4b")
NS = (1, 5, 9, 16, 32, 64)
REPEATS = 5  # each t the median of as many (after a warm-up)


def worker(shape: str) -> dict:
    from bench.common import machine  # noqa: I001  (before mlx.core: the BLAS preload)

    import mlx.core as mx

    from bench.dflash_shapes import MEASURED, PROMPT, _median_ms, measured_target
    from tinydraft_mlx.engine import hidden
    from tinydraft_mlx.engine.cache import layer_kinds, make_cache
    from tinydraft_mlx.engine.cache.batch import BatchCache
    from tinydraft_mlx.engine.tree_verify import forward, layout
    from tinydraft_mlx.engine.trees import Tree

    target, text, depth = measured_target(shape)
    ids = [(7 * i) % 1000 + 10 for i in range(PROMPT)]
    margin = max(NS)  # a recurrent layer's tape holds a forward of n <= margin + 1 positions
    solo = make_cache(target, margin=margin)
    target(mx.array([ids[:-1]]), cache=solo)
    rows = BatchCache(layer_kinds(target), margin=margin)
    rows.add([solo])
    mx.eval(rows.arrays())
    lengths = list(rows.lengths)

    def causal(n: int):
        x = mx.array([[11] * n])

        def run():
            out = rows.forward(target, x)
            rows.rollback(lengths)
            return out
        return run

    def tree(n: int):
        shape = Tree([11] * n, [-1] + [(i - 1) // 2 for i in range(1, n)],
                     [0] + [(i + 1).bit_length() - 1 for i in range(1, n)])
        placed = layout([shape])

        def run():
            out = forward(target, rows, placed.tokens, placed)
            rows.rollback(lengths)
            return out
        return run

    norm = hidden.final_norm(target)

    def head_only(n: int):
        x = mx.random.normal((1, n, text["hidden_size"]))
        return lambda: hidden.embeddings(target).as_linear(norm(x))  # both tie embeddings

    scale = depth / MEASURED[shape]
    heads = {n: _median_ms(head_only(n)) for n in NS}
    out: dict = {"causal": {}, "tree": {}}
    for n in NS:  # the two verifies of each n back to back (the machine's load drifts)
        for name, make in (("causal", causal), ("tree", tree)):
            small = _median_ms(make(n), REPEATS)
            out[name][n] = round(heads[n] + scale * max(0.0, small - heads[n]), 2)
    return {"machine": machine(), "shape": shape, "layers": depth,
            "measured_layers": MEASURED[shape], "t_v_ms": out}


def model(report: dict) -> dict:
    """The cost model's speed-ups (see the module docstring), where the inputs exist."""
    shapes, trees = ROOT / "results" / "dflash_shapes.json", ROOT / "results" / "trees.json"
    if not shapes.exists() or not trees.exists():
        return {}
    block = next(r for r in json.loads(shapes.read_text())["runs"]
                 if r["shape"] == report["shape"])
    tau = json.loads(trees.read_text())["tau"]["T=0.0"]["dflash"]
    t_v, t_1, t_b = report["t_v_ms"], report["t_v_ms"]["causal"]["1"], block["t_block_ms"]

    def cost(kind: str, n: int) -> float:  # t_v(n + 1), interpolated between measured n
        points = sorted((int(k), v) for k, v in t_v[kind].items())
        for (a, ta), (b, tb) in zip(points, points[1:]):
            if a <= n + 1 <= b:
                return ta + (tb - ta) * (n + 1 - a) / (b - a)
        raise ValueError(n)

    out = {}
    for n in tau["chain"]:
        chain = tau["chain"][n]["tau"] * t_1 / (t_b + cost("causal", int(n)))
        tree = tau["tree"][n]["tau"] * t_1 / (t_b + cost("tree", int(n)))
        out[n] = {"chain": round(chain, 3), "tree": round(tree, 3),
                  "tau_chain": tau["chain"][n]["tau"], "tau_tree": tau["tree"][n]["tau"]}
    return {"t_1_ms": t_1, "t_block_ms": t_b, "speedup": out}


def plot(report: dict, path: Path) -> None:
    from bench.common import finish_figure, pyplot

    plt = pyplot()
    runs = report["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"causal": "--", "tree": "-", "chain": "--"}
    for run, colour in zip(runs, ("C0", "C1")):
        t_v = run["t_v_ms"]
        t_1 = t_v["causal"]["1"]
        for kind in ("causal", "tree"):
            n = sorted(int(k) for k in t_v[kind])
            axes[0].plot(n, [t_v[kind][str(k)] / t_1 for k in n], styles[kind], marker="o",
                         color=colour, label=f"{run['shape']}, {kind}")
        speed = run.get("model", {}).get("speedup", {})
        ns = sorted(int(n) for n in speed)
        for kind in ("chain", "tree"):
            if ns:
                axes[1].plot(ns, [speed[str(n)][kind] for n in ns], styles[kind], marker="o",
                             color=colour, label=f"{run['shape']}, {kind}")
    axes[0].set_xlabel("verified positions n")
    axes[0].set_ylabel("t_v(n) / t_1")
    axes[0].legend(fontsize=8)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_xlabel("draft positions verified per round")
    axes[1].set_ylabel("modelled speed-up (demo DFlash tau)")
    axes[1].legend(fontsize=8)
    finish_figure(plt, fig, path, report, "Tree verify on Qwen3-4B and Qwen3.5-4B shapes",
                  "random weights; speed-up = tau t_1 / (t_block + t_v(n + 1)), a model", 10)


def main() -> None:
    from bench.common import in_fresh_process, save

    start = time.time()
    runs = []
    for shape in SHAPES:
        run = in_fresh_process(__file__, shape, timeout=1500)
        run["model"] = model(run)
        runs.append(run)
        print(run["shape"], run["t_v_ms"], run["model"], flush=True)
    report = {"machine": runs[0].pop("machine"), "runs": runs,
              "settings": {"dtype": "float32", "ns": list(NS), "batch": 1,
                           "seconds": round(time.time() - start)}}
    for run in runs[1:]:
        run.pop("machine")
    print(save(report, "tree_shapes", plot))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker(sys.argv[2])))
    else:
        sys.exit(main())

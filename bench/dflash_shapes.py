"""What a DFlash drafter would pay on the shapes users run: a Qwen3-4B-shaped and a
Qwen3.5-4B-shaped random target (mlx-lm's own models, random weights, float32: this CPU's fast
path; bfloat16 runs 3.4-7x slower here, without BLAS) with a random DFlash drafter of the
published kind (5 Qwen3 layers of the target's width, block 16, reading 5 target layers spread
over its depth).

    python -m bench.dflash_shapes     # ~10 minutes on a 2-core machine, ~7 GB of memory

A whole 4B target in float32 (16 GB) does not fit beside the rest here, so the target is built
with MEASURED of its layers (the Qwen3.5 one keeps its 3:1 Gated DeltaNet : attention pattern)
and its full depth is extrapolated: t(n) = t_head(n) + (layers / MEASURED) (t_small(n) -
t_head(n)), with t_head(n) the final norm and LM head on n positions, measured apart. Measured
(median of REPEATS after a warm-up, each shape in a process of its own): the target's decode step
t_1 and its verify t_v(n) for n in NS after a 64-token prompt, and the drafter's block forward t_b
(16 positions over the same context, its 5 layers whole). From these, a model, labelled as one:
a round verifies the whole block and emits tau tokens (tau: tokens per target forward, the
drafter's quality, not measured here), so speed-up(tau) = tau * t_1 / (t_b + t_v(16)), for tau
from 1 to 8; the tau at which drafting breaks even is reported. The shapes are stated in the
report (the Qwen3.5 one is its published layer kinds at 4B's width as we configure it here:
Gated DeltaNet layers with full attention every 4th).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPEATS, PROMPT, BLOCK, DRAFT_LAYERS = 3, 64, 16, 5
MEASURED = {"qwen3-4b": 6, "qwen3.5-4b": 8}  # layers built and timed; the rest extrapolated
NS = (1, 2, 4, 8, 12, 16)
TAUS = (1, 2, 3, 4, 5, 6, 7, 8)

SHAPES = {
    "qwen3-4b": {
        "model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 9728, "vocab_size": 151936, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": True, "max_position_embeddings": 40960,
    },
    "qwen3.5-4b": {
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text", "hidden_size": 2560, "num_hidden_layers": 32,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
            "intermediate_size": 9216, "vocab_size": 248320, "tie_word_embeddings": True,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                "partial_rotary_factor": 0.25},
        },
        "tie_word_embeddings": True,
    },
}


def _median_ms(run, repeats: int = REPEATS) -> float:
    import mlx.core as mx

    mx.eval(run())  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 2)


def measured_target(shape: str):
    """(the random target of SHAPES[shape] built with MEASURED[shape] of its layers, its text
    config, its full depth): the shape benchmarks' target."""
    import mlx.core as mx
    from mlx_lm.models import qwen3, qwen3_5

    config = json.loads(json.dumps(SHAPES[shape]))
    text = config.get("text_config", config)
    depth, text["num_hidden_layers"] = text["num_hidden_layers"], MEASURED[shape]
    module = qwen3 if config["model_type"] == "qwen3" else qwen3_5
    mx.random.seed(0)
    target = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(target.parameters())
    return target, text, depth


def worker(shape: str) -> dict:
    from bench.common import machine  # noqa: I001  (before mlx.core: the BLAS preload)

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from tinydraft_mlx.engine import hidden
    from tinydraft_mlx.engine.cache import make_cache, rollback
    from tinydraft_mlx.engine.drafters.dflash import DFlashDraft, default_layer_ids
    from training.dflash import drafter_config, new_drafter

    target, text, depth = measured_target(shape)
    layers = default_layer_ids(depth, DRAFT_LAYERS)  # as on the full target
    measured = [min(j, MEASURED[shape] - 2) for j in layers]  # the layers the small one has
    cfg = drafter_config(target, block_size=BLOCK, mask_token_id=0, layers=DRAFT_LAYERS,
                         target_layer_ids=measured)
    draft: DFlashDraft = new_drafter(target, cfg)
    mx.eval(draft.parameters())
    hidden.watch(target, draft.after)
    ids = mx.array([[(7 * i) % 1000 + 10 for i in range(PROMPT)]])
    cache = make_cache(target, margin=BLOCK + 1)
    with hidden.capture() as seen:
        target(ids, cache=cache)
    states = draft.read(seen)[-1]
    mx.eval(states, [c.state for c in cache])

    def verify(n: int):
        def run():
            out = target(mx.array([[11] * n]), cache=cache)
            rollback(cache, PROMPT)
            return out
        return run

    small = {n: _median_ms(verify(n)) for n in NS}
    norm = hidden.final_norm(target)
    head = draft.logits  # the target's LM head (tied or not)

    def head_only(n: int):
        x = mx.random.normal((1, n, text["hidden_size"]))
        return lambda: head(norm(x))

    heads = {n: _median_ms(head_only(n)) for n in NS}
    scale = depth / MEASURED[shape]
    t_v = {n: round(heads[n] + scale * max(0.0, small[n] - heads[n]), 2) for n in NS}
    block = mx.array([[11] + [0] * (BLOCK - 1)])
    draft_cache = draft.make_cache()
    draft.absorb(states[:, :-1], draft_cache)

    def block_forward():
        out = draft(block, draft_cache, context=states[:, -1:])[0]
        rollback(draft_cache, PROMPT - 1)
        return out

    t_b = _median_ms(block_forward)
    t_1 = t_v[1]
    rates = {tau: round(tau * t_1 / (t_b + t_v[BLOCK]), 3) for tau in TAUS}
    even = (t_b + t_v[BLOCK]) / t_1
    params = sum(v.size for _, v in tree_flatten(draft.parameters()))
    return {"machine": machine(), "shape": shape, "config": SHAPES[shape], "dtype": "float32",
            "layers": depth, "measured_layers": MEASURED[shape],
            "draft": {"layers": DRAFT_LAYERS, "block_size": BLOCK, "target_layer_ids": layers,
                      "parameters": params},
            "t_v_measured_ms": small, "t_head_ms": heads,
            "t_1_ms": t_1, "t_v_ms": t_v, "t_block_ms": t_b,
            "block_over_step": round(t_b / t_1, 3),
            "verify16_over_step": round(t_v[BLOCK] / t_1, 3),
            "predicted_speedup": rates, "break_even_tau": round(even, 2)}


def plot(report: dict, path: Path) -> None:
    from bench.common import finish_figure, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in report["runs"]:
        n = sorted(int(k) for k in run["t_v_ms"])
        axes[0].plot(n, [run["t_v_ms"][str(k)] / run["t_1_ms"] for k in n], marker="o",
                     label=f"{run['shape']}: t_v(n) / t_1 (block forward "
                           f"{run['block_over_step']:.2f} t_1)")
        axes[1].plot(TAUS, [run["predicted_speedup"][str(t)] for t in TAUS], marker="o",
                     label=f"{run['shape']} (breaks even at tau {run['break_even_tau']})")
    axes[0].set_xlabel("verified positions n")
    axes[0].set_ylabel("cost / one decode step")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_xlabel("tau: tokens per target forward (the drafter's quality)")
    axes[1].set_ylabel("predicted speed-up (a model)")
    for ax in axes:
        ax.legend(fontsize=8)
    finish_figure(plt, fig, path, report, "DFlash on 4B shapes: measured costs, modelled gain",
                  "speed-up(tau) = tau t_1 / (t_block + t_v(16)); random weights", 10)


def main() -> None:
    from bench.common import in_fresh_process, save

    start = time.time()
    runs = [in_fresh_process(__file__, shape, timeout=1800) for shape in SHAPES]
    for run in runs:
        for key in ("t_v_ms", "t_v_measured_ms", "t_head_ms"):
            run[key] = {str(k): v for k, v in run[key].items()}
        run["predicted_speedup"] = {str(k): v for k, v in run["predicted_speedup"].items()}
    report = {"machine": runs[0]["machine"], "settings": {
        "shapes": list(SHAPES), "dtype": "float32", "prompt": PROMPT, "block_size": BLOCK,
        "draft_layers": DRAFT_LAYERS, "repeats": REPEATS, "taus": TAUS, "ns": NS,
        "measured_layers": MEASURED,
        "model": "speed-up(tau) = tau * t_1 / (t_block + t_v(16)): every round verifies the "
                 "whole block; tau is not measured here; the target's full depth extrapolated "
                 "from its measured layers (t_head + depth / measured * (t - t_head))",
        "seconds": round(time.time() - start)},
        "runs": [{k: v for k, v in r.items() if k != "machine"} for r in runs]}
    print(save(report, "dflash_shapes", plot))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker(sys.argv[2])))
    else:
        main()

"""Every drafter side by side on the demo pair, and what a head's step costs on a real shape.

    python -m bench.drafters      # ~15 minutes on a 2-core machine; results/drafters.json, .png

Part 1, demo target (float32): plain decoding ("none"), the 0.9M draft model ("model"), prompt
lookup ("lookup"), lookup + model ("hybrid"), the target's MTP layer ("mtp",
demo/target/mtp.safetensors) and its EAGLE-3 head ("eagle3", demo/eagle3/), both trained by
training/train_heads.py, and its DFlash block drafter ("dflash", demo/dflash/, trained by
training/train_dflash.py; k = 1, 2, 3, 4, 7, 15: one draft forward of its 16-position block
whatever k). For k = 1..4, T in {0, 0.7 (top-p 0.8, top-k 20)} and B in {1, 8}: tokens
per second, acceptance per draft position and the mean accepted length per drafting round, on
8 held-out stdlib prompts (bench/demo_quality.py's: B = 1 decodes the first 3 one at a time,
B = 8 all 8 in one batch), 64 tokens each. One process per (drafter, T, B), every k in it after
a warm-up, REPEATS rounds interleaved; tokens/s is generated tokens over wall time of the
decoding (prefill included: the same prompts for every drafter). Greedy outputs are checked
equal to plain decoding's.

Part 2, a random Qwen3.5-shaped target (bench/hybrid_models.py's 8-layer model of Qwen3.5-0.8B's
shapes, float32): one target step against one MTP-layer step (the target's own attention layer
kind, its 151,936-row head shared) and one EAGLE-3 step (a Llama layer of the same width, a
32,000-token draft vocabulary), each after a 64-token prompt, median of 20 (check.py's timing).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = ("none", "model", "lookup", "hybrid", "mtp", "eagle3", "dflash")
KS = (1, 2, 3, 4)
BLOCK_KS = (1, 2, 3, 4, 7, 15)  # a block drafter's k costs one draft forward whatever it is
TEMPERATURES = (0.0, 0.7)
BATCHES = (1, 8)
MAX_TOKENS = 64
REPEATS = 2
EAGLE = ROOT / "tinydraft_mlx" / "demo" / "eagle3"
DFLASH = ROOT / "tinydraft_mlx" / "demo" / "dflash"


def ks_of(contender: str) -> tuple[int, ...]:
    """The k each contender runs: without a draft k plays no part; a block drafter's reach
    its block."""
    return (1,) if contender == "none" else BLOCK_KS if contender == "dflash" else KS


def _drafter(contender: str):
    from tinydraft_mlx import Hybrid, load_models

    if contender in ("none", "lookup", "model"):
        target, draft, tok = load_models(None, {"none": "none", "lookup": "prompt-lookup"}
                                         .get(contender))
    elif contender == "hybrid":
        target, model, tok = load_models()
        draft = Hybrid(model)
    else:
        target, draft, tok = load_models(None, {"mtp": "mtp", "eagle3": str(EAGLE),
                                                "dflash": str(DFLASH)}[contender])
    return target, draft, tok


def worker(contender: str, temperature: float, batch: int) -> dict:
    from bench.common import machine, model_dtype  # noqa: I001  (before mlx.core: the BLAS preload)
    from bench.demo_quality import held_out_prompts

    from tinydraft_mlx import batch_generate, generate

    target, draft, tok = _drafter(contender)
    texts = held_out_prompts(8, seed=0)
    sampling = {} if temperature == 0 else {"temperature": temperature, "top_p": 0.8,
                                            "top_k": 20}
    ks = ks_of(contender)

    def run(k: int, texts: list[str], n: int) -> dict:
        start = time.perf_counter()
        if batch == 1:
            results = [generate(target, draft, tok, t, k=k, max_tokens=n, seed=7, **sampling)
                       for t in texts]
        else:
            results = batch_generate(target, draft, tok, texts, k=k, max_tokens=n, seed=7,
                                     **sampling)
        seconds = time.perf_counter() - start
        width = max(len(s.position_reached) for _, s in results)
        reached, hits = [0] * width, [0] * width
        lengths: list[int] = []
        for _, s in results:
            for i, (r, a) in enumerate(zip(s.position_reached, s.position_accepted)):
                reached[i] += r
                hits[i] += a
            for n_acc, count in enumerate(s.accepted_length_counts):
                lengths += [n_acc] * count
        tokens = sum(s.generated for _, s in results)
        drafted, accepted = (sum(s.drafted for _, s in results),
                             sum(s.accepted for _, s in results))
        return {"k": k, "tokens": tokens, "seconds": round(seconds, 4),
                "tps": round(tokens / seconds, 1),
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "per_position": [round(h / r, 3) if r else None for h, r in zip(hits, reached)],
                "mean_accepted": round(statistics.mean(lengths), 3) if lengths else None,
                # tau: tokens per target forward (a round is one verify), hardware-independent
                "tau": round(tokens / max(1, sum(s.rounds for _, s in results)), 3),
                "outputs": [o for o, _ in results]}

    chosen = texts[:3] if batch == 1 else texts
    for k in ks:  # warm-up: traces
        run(k, chosen[:1] if batch == 1 else chosen, 8)
    cells = [run(k, chosen, MAX_TOKENS) for k in ks]
    return {"machine": machine(), "dtype": model_dtype(target), "contender": contender,
            "temperature": temperature, "batch": batch, "cells": cells}


def head_costs() -> dict:
    """Part 2 (see the module docstring), in this process."""
    from bench.common import machine  # noqa: I001  (before mlx.core: the BLAS preload)
    from bench import hybrid_models

    import mlx.core as mx
    from mlx_lm.models import llama

    from tinydraft_mlx.engine import hidden
    from tinydraft_mlx.engine.drafters import resolve_drafter
    from tinydraft_mlx.engine.drafters.eagle import Eagle3Head
    from tinydraft_mlx.engine.drafters.mtp import MtpHead, attach, attention_layer
    from tinydraft_mlx.generation.loading import load_model
    from tinydraft_mlx.programs.costs import forward_ms

    hybrid_models.build()
    target, _ = load_model(hybrid_models.TARGET, "float32")
    text = hidden.text_model(target)
    args = text.args
    index, layer = attention_layer(target)
    mx.random.seed(0)
    mtp = MtpHead(target, type(layer)(args, layer_idx=index), args.hidden_size,
                  args.rms_norm_eps)
    attach(target, mtp)
    eargs = llama.ModelArgs(model_type="llama", hidden_size=args.hidden_size,
                            num_hidden_layers=1, intermediate_size=args.intermediate_size,
                            num_attention_heads=16, num_key_value_heads=4, rms_norm_eps=1e-6,
                            vocab_size=args.vocab_size)
    depth = len(text.layers)
    eagle = Eagle3Head(target, eargs, 32000, args.hidden_size, (1, depth // 2 - 1, depth - 4),
                       False, False, False)
    hidden.watch(target, eagle.after)
    mx.eval(mtp.parameters(), eagle.parameters())
    ids = list(range(1000, 1064))
    out = {"machine": machine(), "target": str(hybrid_models.TARGET.name),
           "target_layers": depth, "vocab": args.vocab_size, "prompt": len(ids), "repeats": 20}
    for name, model in (("target", target), ("mtp", mtp), ("eagle3", eagle)):
        drafter = None if model is target else resolve_drafter(model, target=target)
        forward_ms(model, ids, 1, 3, drafter=drafter)  # warm-up
        out[f"{name}_ms"] = round(forward_ms(model, ids, 1, 20, drafter=drafter), 3)
    out["mtp_vs_target"] = round(out["mtp_ms"] / out["target_ms"], 3)
    out["eagle3_vs_target"] = round(out["eagle3_ms"] / out["target_ms"], 3)
    return out


def summarize(runs: list[dict]) -> list[dict]:
    """Median tokens/s per (drafter, T, B, k), its ratio to plain decoding's, acceptance."""
    out = []
    for temperature in TEMPERATURES:
        for batch in BATCHES:
            same = [r for r in runs if (r["temperature"], r["batch"]) == (temperature, batch)]
            plain = statistics.median(c["tps"] for r in same if r["contender"] == "none"
                                      for c in r["cells"])
            for contender in CONTENDERS:
                rows = [r for r in same if r["contender"] == contender]
                for i, k in enumerate(ks_of(contender)):
                    cells = [r["cells"][i] for r in rows]
                    tps = statistics.median(c["tps"] for c in cells)
                    out.append({"contender": contender, "temperature": temperature,
                                "batch": batch, "k": k, "tps": round(tps, 1),
                                "vs_plain": round(tps / plain, 3),
                                "acceptance": cells[-1]["acceptance"],
                                "per_position": cells[-1]["per_position"],
                                "mean_accepted": cells[-1]["mean_accepted"],
                                "tau": cells[-1]["tau"]})
    return out


def plot(report: dict, path: Path) -> None:
    from bench.common import finish_figure, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(15, 4.2), sharey=True)
    drafting = [c for c in CONTENDERS if c != "none"]
    for ax, (temperature, batch) in zip(axes, [(t, b) for t in TEMPERATURES for b in BATCHES]):
        for contender in drafting:
            rows = [s for s in report["summary"] if s["contender"] == contender
                    and (s["temperature"], s["batch"]) == (temperature, batch)]
            ax.plot([s["k"] for s in rows], [s["vs_plain"] for s in rows], marker="o",
                    label=contender)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(BLOCK_KS)
        ax.set_xlabel("k")
        ax.set_title(f"{'greedy' if temperature == 0 else f'T = {temperature}'}, B = {batch}",
                     fontsize=10)
    axes[0].set_ylabel("tokens/s / plain decoding's")
    axes[0].legend(fontsize=8)
    finish_figure(plt, fig, path, report, "Drafters on the demo target",
                  f"{MAX_TOKENS} tokens per prompt, median of {REPEATS} processes", 10)


def main() -> None:
    from bench.common import in_fresh_process, save

    runs, start = [], time.time()
    jobs = [(c, t, b) for _ in range(REPEATS) for t in TEMPERATURES for b in BATCHES
            for c in CONTENDERS]
    for contender, temperature, batch in jobs:
        result = in_fresh_process(__file__, contender, temperature, batch)
        runs.append(result)
        print(json.dumps({"contender": contender, "temperature": temperature, "batch": batch,
                          "tps": [c["tps"] for c in result["cells"]]}), flush=True)
    exact = all(c["outputs"] == p["cells"][0]["outputs"] for r in runs for c in r["cells"]
                for p in runs if r["temperature"] == 0 and p["contender"] == "none"
                and p["temperature"] == 0 and p["batch"] == r["batch"])
    costs = in_fresh_process(__file__, "costs", 0, 0)
    report = {"machine": runs[0]["machine"], "settings": {
        "contenders": CONTENDERS, "ks": KS, "block_ks": BLOCK_KS,
        "temperatures": TEMPERATURES, "batches": BATCHES,
        "sampling": {"top_p": 0.8, "top_k": 20}, "max_tokens": MAX_TOKENS, "repeats": REPEATS,
        "prompts": "8 held-out stdlib prompts (bench/demo_quality.py, seed 0); B = 1: the "
                   "first 3", "dtype": runs[0]["dtype"], "seconds": round(time.time() - start)},
        "greedy_outputs_equal_plain": exact, "summary": summarize(runs), "head_costs": costs,
        "runs": [{k: v for k, v in r.items() if k != "machine"} | {"cells": [
            {k: v for k, v in c.items() if k != "outputs"} for c in r["cells"]]}
            for r in runs]}
    print(save(report, "drafters", plot))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        if sys.argv[2] == "costs":
            print(json.dumps(head_costs()))
        else:
            print(json.dumps(worker(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))))
    else:
        main()

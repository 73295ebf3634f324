"""Our DFlash path against the reference's: z-lab's `dflash` 0.1.0 MLX `stream_generate`, the
same target (the demo's) and the same drafter (demo/dflash/), one sequence.

    python -m bench.dflash_reference      # ~10 minutes on a 2-core machine

The reference installs into bench/.peers/ (`pip install --no-deps --target`; it is not a
dependency of the package: its pins conflict with ours) when it is not importable. Contenders,
each in a process of its own, REPEATS rounds interleaved: "plain" (our plain decoding),
"ours" (our generate, k = 15: the drafter's whole block), "ours-auto" (k = "auto": the
block length chosen each round from measured round costs and acceptance, 0 = plain rounds
included; a fresh policy in each process) and "reference" (its stream_generate, block_size
16), greedy and T = 0.7 (no top-p / top-k: the reference's sampler and ours then warp alike),
3 held-out stdlib prompts (bench/demo_quality.py's) x 128 tokens, after a warm-up,
every model in float32 (the checkpoints are float16, which this CPU runs without BLAS).
Reported per contender: tokens/s over the decoding (prefill included, the same prompts for
all), tau (tokens per target forward: generated / rounds; the reference's per yielded round),
and for greedy whether our tokens equal the reference's (the same algorithm: they must).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "bench" / ".peers"
DFLASH = ROOT / "tinydraft_mlx" / "demo" / "dflash"
TARGET = ROOT / "tinydraft_mlx" / "demo" / "target"
CONTENDERS = ("plain", "ours", "ours-auto", "reference")
TEMPERATURES = (0.0, 0.7)
MAX_TOKENS, REPEATS, BLOCK = 128, 3, 16


def ensure_reference() -> None:
    """The reference package under bench/.peers/ (installed there if absent)."""
    if (PEERS / "dflash" / "model_mlx.py").is_file():
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--target", str(PEERS), "dflash==0.1.0"], check=True)


def worker(contender: str, temperature: float) -> dict:
    os.environ["TINYDRAFT_POLICY_FILE"] = "off"  # k="auto" learns in this process alone
    from bench.common import machine  # noqa: I001  (before mlx.core: the BLAS preload)
    from bench.demo_quality import held_out_prompts

    import mlx.core as mx

    from tinydraft_mlx import generate, load_models

    texts = held_out_prompts(3, seed=0)
    drafting = contender.startswith("ours")
    target, draft, tok = load_models(str(TARGET), str(DFLASH) if drafting else "none",
                                     dtype="float32")

    if contender == "reference":
        sys.path.insert(0, str(PEERS))
        import mlx_lm
        from dflash import model_mlx

        model_mlx.snapshot_download = lambda path, **_: path  # a local directory
        ref_target, ref_tok = mlx_lm.load(str(TARGET))
        ref_draft = model_mlx.load_draft(str(DFLASH))
        for model in (ref_target, ref_draft):  # float32 as ours (float16 has no BLAS here)
            model.set_dtype(mx.float32)
        mx.eval(ref_target.parameters(), ref_draft.parameters())

        def one(text: str, n: int) -> tuple[list[int], int]:
            tokens, rounds = [], 0
            for r in model_mlx.stream_generate(ref_target, ref_draft, ref_tok, text,
                                               block_size=BLOCK, max_tokens=n,
                                               temperature=temperature):
                tokens += r.tokens
                rounds += r.accepted is not None
            return tokens, rounds
    else:
        def one(text: str, n: int) -> tuple[list[int], int]:
            k = {"ours": BLOCK - 1, "ours-auto": "auto"}.get(contender, 1)
            out, stats = generate(target, draft, tok, text, max_tokens=n, temperature=temperature,
                                  k=k)
            return out, stats.rounds - 1  # the first token comes from the prefill

    one(texts[0], 16)  # warm-up
    mx.random.seed(0)
    start = time.perf_counter()
    runs = [one(t, MAX_TOKENS) for t in texts]
    seconds = time.perf_counter() - start
    tokens = sum(len(o) for o, _ in runs)
    rounds = sum(r for _, r in runs)
    return {"machine": machine(), "contender": contender, "temperature": temperature,
            "tps": round(tokens / seconds, 1), "tokens": tokens,
            "tau": round((tokens - len(runs)) / max(1, rounds), 3),
            "outputs": [o for o, _ in runs]}


def plot(report: dict, path: Path) -> None:
    from bench.common import finish_figure, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, key, label in ((axes[0], "tps", "tokens/s"), (axes[1], "tau",
                                                           "tokens per target forward")):
        for i, temperature in enumerate(TEMPERATURES):
            rows = [s for s in report["summary"] if s["temperature"] == temperature]
            ax.bar([j + 0.4 * i for j in range(len(rows))], [s[key] for s in rows], width=0.4,
                   label="greedy" if temperature == 0 else f"T = {temperature}")
        ax.set_xticks([j + 0.2 for j in range(len(CONTENDERS))], CONTENDERS)
        ax.set_ylabel(label)
    axes[0].legend()
    finish_figure(plt, fig, path, report, "DFlash: ours vs the reference's MLX stream_generate",
                  f"demo target + demo/dflash, {MAX_TOKENS} tokens x 3 prompts, median of "
                  f"{REPEATS} processes")


def main() -> None:
    from bench.common import in_fresh_process, save

    ensure_reference()
    runs, start = [], time.time()
    for _ in range(REPEATS):
        for temperature in TEMPERATURES:
            for contender in CONTENDERS:
                runs.append(in_fresh_process(__file__, contender, temperature))
                print(json.dumps({k: runs[-1][k] for k in ("contender", "temperature", "tps",
                                                           "tau")}), flush=True)
    summary = []
    for temperature in TEMPERATURES:
        plain = statistics.median(r["tps"] for r in runs
                                  if (r["contender"], r["temperature"]) == ("plain", temperature))
        for contender in CONTENDERS:
            rows = [r for r in runs if (r["contender"], r["temperature"]) == (contender,
                                                                              temperature)]
            tps = statistics.median(r["tps"] for r in rows)
            summary.append({"contender": contender, "temperature": temperature,
                            "tps": tps, "vs_plain": round(tps / plain, 3),
                            "tau": statistics.median(r["tau"] for r in rows)})
    greedy = {c: next(r["outputs"] for r in runs if (r["contender"], r["temperature"])
                      == (c, 0.0)) for c in CONTENDERS}
    ours = {s["temperature"]: s["tps"] for s in summary if s["contender"] == "ours"}
    auto = {s["temperature"]: s["tps"] for s in summary if s["contender"] == "ours-auto"}
    theirs = {s["temperature"]: s["tps"] for s in summary if s["contender"] == "reference"}
    report = {"machine": runs[0]["machine"], "settings": {
        "contenders": CONTENDERS, "temperatures": TEMPERATURES, "max_tokens": MAX_TOKENS,
        "block_size": BLOCK, "repeats": REPEATS, "dtype": "float32", "reference": "dflash 0.1.0",
        "prompts": "3 held-out stdlib prompts (bench/demo_quality.py, seed 0)",
        "seconds": round(time.time() - start)},
        "greedy_equal_reference": greedy["ours"] == greedy["reference"],
        "greedy_equal_plain": greedy["ours"] == greedy["plain"],
        "ours_vs_reference": {str(t): round(ours[t] / theirs[t], 3) for t in TEMPERATURES},
        "auto_vs_reference": {str(t): round(auto[t] / theirs[t], 3) for t in TEMPERATURES},
        "summary": summary,
        "runs": [{k: v for k, v in r.items() if k not in ("machine", "outputs")} for r in runs]}
    print(save(report, "dflash_reference", plot))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker(sys.argv[2], float(sys.argv[3]))))
    else:
        main()

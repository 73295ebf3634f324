"""How many MKL threads for the forwards we run, on an idle and on a busy 2-core machine.

    python -m bench.studies.threads            # ~4 minutes; writes results/threads.json and .png

Each (threads, load) runs in a fresh process (MKL reads MKL_NUM_THREADS once, at load), the
contenders interleaved, every configuration twice. Load: none, or one or two processes spinning
on a core each (another job on the machine). Measured in each process: plain and speculative
(k=3) decoding of the demo pair (tokens/s, best of 3 generations of 64 tokens) and, where
`bench/qwen_shapes.py 0.5B` has been run, one cached forward of 1 and 5 tokens of a Qwen2.5-0.5B
shaped model (the draft a real pair would use; ms, median of 5). CPU-only: Metal does not use
this BLAS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
THREADS = (1, 2)
LOADS = (0, 1, 2)  # spinning processes
PROMPT = "def parse_args(argv=None):\n    parser = argparse.ArgumentParser("


def worker() -> dict:
    from bench.common import machine  # noqa: I001  (before mlx.core: the BLAS preload)

    from bench.qwen_shapes import CACHE

    from tinydraft_mlx import generate, load_models
    from tinydraft_mlx.programs.costs import forward_ms

    target, draft, tok = load_models()
    ids = tok.encode(PROMPT)
    out = {"machine": machine()}
    for name, d, k in (("plain", None, 4), ("speculative_k3", draft, 3)):
        generate(target, d, tok, ids, k=k, max_tokens=16)  # warm-up (traces)
        rates = [generate(target, d, tok, ids, k=k, max_tokens=64)[1].tokens_per_second
                 for _ in range(3)]
        out[name] = max(rates)
    shape = CACHE / "0.5B"
    if (shape / "config.json").exists():
        model, _, shape_tok = load_models(str(shape), "none")
        shape_ids = shape_tok.encode(PROMPT)
        for n in (1, 5):
            forward_ms(model, shape_ids, n, repeats=1)  # warm-up
            out[f"qwen0.5B_forward_{n}_ms"] = forward_ms(model, shape_ids, n, repeats=5)
    return out


def run(threads: int, load: int) -> dict:
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(load)]
    try:
        env = dict(os.environ, MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
        module = ".".join(Path(__file__).resolve().relative_to(ROOT).with_suffix("").parts)
        done = subprocess.run([sys.executable, "-m", module, "--worker"], env=env,
                              cwd=ROOT, check=True,
                              capture_output=True, text=True, timeout=600)
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def plot(report: dict, path: Path) -> None:
    from bench.common import pyplot

    plt = pyplot()
    metrics = [m for m in ("plain", "speculative_k3") if m in report["best"]["1/0"]]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8))
    for ax, metric in zip(axes, metrics):
        for threads in THREADS:
            ys = [report["best"][f"{threads}/{load}"][metric] for load in LOADS]
            ax.plot(LOADS, ys, marker="o", label=f"MKL_NUM_THREADS={threads}")
        ax.set(xticks=list(LOADS), xlabel="other processes spinning (2 cores)",
               ylabel="decode tokens/s (demo pair)", title=metric.replace("_", " "))
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle("MKL threads under load (each run a fresh process; best of 2 runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    from bench.common import save

    runs = []
    start = time.time()
    for repeat in range(2):
        for load in LOADS:
            for threads in THREADS:
                result = run(threads, load)
                result.update(threads=threads, load=load, repeat=repeat)
                runs.append(result)
                print(json.dumps({k: v for k, v in result.items() if k != "machine"}),
                      flush=True)
    best = {}
    for r in runs:
        key = f"{r['threads']}/{r['load']}"
        cur = best.setdefault(key, {})
        for metric, value in r.items():
            if metric in ("machine", "threads", "load", "repeat"):
                continue
            better = min if metric.endswith("_ms") else max
            cur[metric] = better(cur.get(metric, value), value)
    report = {"machine": runs[0]["machine"], "settings": {
        "threads": THREADS, "loads": LOADS, "prompt": PROMPT, "max_tokens": 64,
        "dtype": "float32", "seconds": round(time.time() - start)},
        "runs": runs, "best": best}
    print(save(report, "threads", plot))


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        print(json.dumps(worker()))
    else:
        main()

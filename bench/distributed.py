"""The target tensor-parallel over 2 local ranks vs one process: t_1, t_v(n), the draft step, the
communication share of a target forward, and plain vs speculative speed.

    python -m bench.distributed                        # demo pair, then the 1.5B / 0.5B shapes

Each pair is measured in this process and as 2 ranks of `mlx.launch --backend ring --hosts
127.0.0.1 -n 2` (this script again, with --rank-worker; one BLAS thread per rank). On one
2-core machine the two ranks share the cores and talk over loopback, so the numbers are ratios,
not what two Macs would see:
communication share = 2 all-reduces per layer (mlx-lm's sharding: after attention and after the
MLP) x the measured time of one all-reduce of (1, n, hidden) floats, over t_v(n). The predicted
speedups use the Leviathan formula with the measured costs at oracle acceptance alpha. The demo
pair also runs real greedy generations (plain and k=3). Writes results/distributed.json and .png.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

from bench.common import machine, pyplot, save
from tinydraft_mlx import generate, load_models
from tinydraft_mlx.engine.distributed import free_ports, ranks_of
from tinydraft_mlx.programs.costs import forward_ms, leviathan

SHAPES = Path.home() / ".cache" / "tinydraft-mlx" / "shapes"
NS = [1, 2, 3, 5]
PROMPTS = ["class Stack:\n    def push(self, item):", "def parse_args("]


def allreduce_ms(n: int, hidden: int, repeats: int = 30) -> float:
    """One all-reduce of (1, n, hidden) floats in steady state: after an all-reduce that lines the
    ranks up, `repeats` back to back (each evaluated, as inside a forward), averaged; timing one
    alone would include the other rank's lateness."""
    x = mx.ones((1, n, hidden), dtype=mx.float32)
    for _ in range(5):  # the first all-reduces of a size pay a one-time cost (measured: 7-13 ms)
        mx.eval(mx.distributed.all_sum(x))
    start = time.perf_counter()
    for _ in range(repeats):
        x = mx.distributed.all_sum(x) * 0.5
        mx.eval(x)
    return 1000 * (time.perf_counter() - start) / repeats


def measure(target: str | None, draft: str | None, distributed: bool, speed: bool) -> dict:
    model, dmodel, tok = load_models(target, draft, distributed=distributed)
    ids = [(7 * i) % 500 + 1 for i in range(64)]
    forward_ms(model, ids, 2, repeats=2)  # warm-up: allocation, first collectives
    forward_ms(dmodel, ids, 1, repeats=2)
    out = {"t_1": forward_ms(model, ids, 1), "t_v": {n: forward_ms(model, ids, n) for n in NS},
           "t_d": forward_ms(dmodel, ids, 1)}
    ranks = ranks_of(model)
    if ranks is not None:
        layers, hidden = len(model.layers), model.args.hidden_size
        out["allreduce_ms"] = {n: allreduce_ms(n, hidden) for n in NS}
        out["comm_share"] = {n: 2 * layers * out["allreduce_ms"][n] / out["t_v"][n]
                             for n in NS}
    if speed:
        for name, d, k in (("plain", None, 4), ("k=3", dmodel, 3)):
            tokens = seconds = 0
            for p in PROMPTS:
                _, stats = generate(model, d, tok, p, k=k, max_tokens=24)
                tokens, seconds = tokens + stats.generated, seconds + stats.decode_seconds
            out[f"{name} tok/s"] = tokens / seconds
    return out


def on_two_ranks(args: list[str]) -> dict:
    out = Path(f"/tmp/tinydraft-distributed-{os.getpid()}.json")
    launcher = str(Path(sys.executable).with_name("mlx.launch"))
    # one BLAS thread per rank: the ranks share this machine's cores, and MKL's default threads
    # spin against the other rank's (measured: 7x slower decoding)
    cmd = [launcher, "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "--starting-port",
           str(free_ports(2)), "--env", "MKL_NUM_THREADS=1", "--env", "OMP_NUM_THREADS=1",
           sys.executable, __file__, "--rank-worker", str(out), *args]
    subprocess.run(cmd, check=True, cwd=Path(__file__).parent, timeout=1800)
    result = json.loads(out.read_text())
    out.unlink()
    return result


def pairs() -> list[tuple[str, str | None, str | None]]:
    found = [("demo pair", None, None)]
    if (SHAPES / "1.5B" / "config.json").exists() and (SHAPES / "0.5B" / "config.json").exists():
        found.append(("Qwen2.5 shapes 0.5B -> 1.5B", str(SHAPES / "1.5B"), str(SHAPES / "0.5B")))
    else:
        print(f"skipping the Qwen2.5 shapes: {SHAPES} lacks 1.5B or 0.5B "
              "(python -m bench.qwen_shapes 0.5B 1.5B)")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--target", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--draft", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--speed", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker:  # one of the 2 ranks
        result = measure(args.target, args.draft, True, args.speed)
        if mx.distributed.init().rank() == 0:
            Path(args.rank_worker).write_text(json.dumps(result))
        return
    rows = []
    for name, target, draft in pairs():
        speed = target is None
        one = measure(target, draft, False, speed)
        extra = [a for flag, value in (("--target", target), ("--draft", draft)) if value
                 for a in (flag, value)] + (["--speed"] if speed else [])
        two = on_two_ranks(extra)
        row = {"pair": name, "one process": one, "2 ranks": two, "predicted": {}}
        for label, m in (("one process", one), ("2 ranks", two)):
            t_v = {int(n): v for n, v in m["t_v"].items()}
            row["predicted"][label] = {
                str(alpha): max(leviathan(alpha, k, m["t_d"], m["t_1"], t_v[k + 1])
                                for k in (1, 2, 4)) for alpha in (0.5, 0.7, 0.9)}
        print(json.dumps(row, indent=1), flush=True)
        rows.append(row)
    save({"settings": {"ns": NS, "prompts": PROMPTS}, "machine": machine(), "rows": rows},
         "distributed", plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    rows = report["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        for label, colour in (("one process", "tab:gray"), ("2 ranks", "tab:green")):
            m = row[label]
            ns = sorted(int(n) for n in m["t_v"])
            ax.plot(ns, [m["t_v"][str(n)] if str(n) in m["t_v"] else m["t_v"][n] for n in ns],
                    "o-", color=colour, label=f"t_v(n), {label}")
        comm = row["2 ranks"].get("comm_share", {})
        if comm:
            ax.bar([int(n) for n in comm], [row["2 ranks"]["t_v"][n] * comm[n] for n in comm],
                   width=0.3, color="tab:red", alpha=0.5, label="all-reduces (2 ranks)")
        ax.set(xlabel="tokens per target forward (n)", ylabel="ms", title=row["pair"],
               ylim=(0, None))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Tensor-parallel target on 2 local ranks vs one process "
                 f"({report['machine']['device']}; one 2-core machine: ratios only)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

"""Time to first token and tokens/s through HTTP: our server (batching, `--max-batch 16`, and one
request at a time, `--max-batch 1`) vs `mlx_lm.server --draft-model` (which does not batch) and
plain `mlx_lm.server` (no draft, batched), the same pair, prompts and k, 1/2/4/8/16 concurrent
streaming clients, greedy and T=0.7.

    python -m bench.server                                    # the demo pair, ~6 minutes
    python -m bench.server --target $S/1.5B --draft $S/0.5B --clients 1 2 --requests 1 \\
        --max-tokens 16 --name server_shapes

All servers run as subprocesses on 127.0.0.1 with the same weights (float32 copies:
mlx_lm.server has no dtype flag and would run a float16 checkpoint in float16 on the CPU; the
copies' configs carry the RoPE base at the top level, where mlx-lm reads it) and the same BLAS
(LD_PRELOAD of MKL on Linux, for all). Each cell runs the engines one after the other
(alternating the order), each client sending --requests streaming completions in turn. A
connection dropped before any answer is retried (counted in `dropped_connections`; the TTFT
then includes the retry). TTFT: request sent -> first text chunk. Per-request decode speed:
(tokens - 1) / (last chunk - first chunk). Throughput: all tokens / the cell's wall time. At
T=0 every text is compared with plain greedy decoding of its prompt (the library, no draft, in
this process): the same continuation, leading and trailing whitespace aside
(`equal_to_plain_greedy`), and the same text exactly (`text_equal_to_plain_greedy`). Writes
results/<name>.json and .png.
"""

from __future__ import annotations

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload precedes mlx.core)
import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import mlx.core as mx

from bench.common import machine, pyplot, save
from tinydraft_mlx.engine.backend import mkl_candidates
from tinydraft_mlx.generation.loading import DEMO_DIR, config_overrides

PROMPTS = ["def parse_args(", "class Config:", "import os\nimport sys\n", "for i in range(",
           "def main():\n", "if __name__ == ", "with open(", "    return "]
RETRIES = 3  # a request whose connection is dropped before any answer is sent again
ENGINES = ("tinydraft-mlx", "tinydraft-mlx --max-batch 1", "mlx_lm.server",
           "mlx_lm.server, no draft")


def float32_copy(src: Path, dst: Path) -> Path:
    """`src` with its floating weights cast to float32 (config and tokenizer copied)."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        weights = mx.load(str(f))
        mx.save_safetensors(str(f), {k: v.astype(mx.float32) if mx.issubdtype(
            v.dtype, mx.floating) else v for k, v in weights.items()})
    config = json.loads((dst / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "float32"
    # transformers 5 writes the RoPE base under "rope_parameters", which mlx-lm's qwen2 does not
    # read (it would run with 1e6): give it the top-level key so both engines run the same model
    config.update({k: v for k, v in config_overrides(config).items() if k not in config})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def plain_greedy(target: Path, max_tokens: int) -> dict[str, str]:
    """Each prompt's plain greedy text (no draft), from the library in this process."""
    from tinydraft_mlx import generate, load_models

    model, _, tok = load_models(str(target), "none", dtype="float32")
    return {p: tok.decode(generate(model, None, tok, p, max_tokens=max_tokens)[0])
            for p in PROMPTS}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(engine: str, target: Path, draft: Path, k: int, env: dict) -> tuple:
    port = free_port()
    if engine.startswith("tinydraft-mlx"):
        cmd = [sys.executable, "-m", "tinydraft_mlx.server", "--target", str(target), "--draft",
               str(draft), "-k", str(k), "--port", str(port), "--log-level", "warning",
               "--max-queue", "64", "--dtype", "float32",
               "--max-batch", "1" if engine.endswith("--max-batch 1") else "16"]
    elif engine == "mlx_lm.server":
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(target), "--draft-model",
               str(draft), "--num-draft-tokens", str(k), "--port", str(port), "--log-level",
               "WARNING"]
    else:  # without a draft model mlx_lm.server batches concurrent requests
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(target), "--port",
               str(port), "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{engine} did not start: {' '.join(cmd)}")
        time.sleep(0.3)


async def request(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                  args: argparse.Namespace, temperature: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "stream": True,
            "temperature": temperature, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = last = None
    text, chunks, usage = [], 0, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            usage = data.get("usage") or usage
            for choice in data.get("choices") or []:
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                chunks += 1
                text.append(choice.get("text") or "")
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft_s": first - sent, "tokens": tokens, "text": "".join(text),
            "decode_tps": (tokens - 1) / (last - first) if tokens > 1 and last > first else None,
            "total_s": last - sent}


async def cell(url: str, model: str, clients: int, args: argparse.Namespace,
               temperature: float) -> dict:
    dropped = [0]
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(i: int) -> list[dict]:
            out = []
            for j in range(args.requests):
                prompt = PROMPTS[(i + j) % len(PROMPTS)]
                for attempt in range(RETRIES + 1):
                    try:
                        result = await request(client, url, model, prompt, args, temperature)
                        break
                    except httpx.TransportError:  # a dropped connection (mlx_lm.server's
                        if attempt == RETRIES:    # listen backlog at 16 clients): again
                            raise
                        dropped[0] += 1
                        await asyncio.sleep(0.05)
                out.append({"prompt": prompt, **result})
            return out

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(one(i) for i in range(clients)))
                   for r in rs]
        wall = time.perf_counter() - start
    tps = [r["decode_tps"] for r in results if r["decode_tps"]]
    return {"requests": results, "wall_s": wall, "dropped_connections": dropped[0],
            "ttft_median_s": statistics.median(r["ttft_s"] for r in results),
            "ttft_max_s": max(r["ttft_s"] for r in results),
            "decode_tps_median": statistics.median(tps) if tps else None,
            "throughput_tps": sum(r["tokens"] for r in results) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="target directory (default: demo target)")
    ap.add_argument("--draft", default=None, help="draft directory (default: demo draft)")
    ap.add_argument("-k", type=int, default=3, help="draft tokens per round, both engines (3)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--requests", type=int, default=3, help="requests per client per cell")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--name", default="server")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tinydraft-bench-"))
    target = float32_copy(Path(args.target or DEMO_DIR / "target"), tmp / "target")
    draft = float32_copy(Path(args.draft or DEMO_DIR / "draft"), tmp / "draft")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    mkl = mkl_candidates()
    if sys.platform == "linux" and mkl:
        env["LD_PRELOAD"] = mkl[0]
    plain = plain_greedy(target, args.max_tokens)
    servers = {e: start(e, target, draft, args.k, env) for e in ENGINES}
    models = {e: str(target) if e.startswith("tinydraft") else "default_model" for e in ENGINES}
    try:
        for engine, (_, url) in servers.items():  # warm-up: load, compile, allocate
            asyncio.run(cell(url, models[engine], 2, argparse.Namespace(
                **{**vars(args), "requests": 1}), 0.0))
        cells = []
        for n, (temperature, clients) in enumerate(
                [(t, c) for t in args.temperatures for c in args.clients]):
            order = ENGINES if n % 2 == 0 else ENGINES[::-1]  # alternating which goes first
            row = {"temperature": temperature, "clients": clients}
            for engine in order:
                row[engine] = asyncio.run(cell(servers[engine][1], models[engine], clients, args,
                                               temperature))
            ours, theirs = row["tinydraft-mlx"], row["mlx_lm.server, no draft"]
            if temperature == 0:
                for engine in ENGINES:
                    requests = row[engine]["requests"]
                    # the same continuation: leading and trailing whitespace aside (mlx-lm's
                    # detokenizer drops the first token's leading space and may hold a last one)
                    row[engine]["equal_to_plain_greedy"] = sum(
                        r["text"].strip() == plain[r["prompt"]].strip()
                        for r in requests) / len(requests)
                    row[engine]["text_equal_to_plain_greedy"] = sum(
                        r["text"] == plain[r["prompt"]] for r in requests) / len(requests)
            print(f"T={temperature} clients={clients}: TTFT {ours['ttft_median_s'] * 1e3:.0f} vs "
                  f"{theirs['ttft_median_s'] * 1e3:.0f} ms, throughput "
                  f"{ours['throughput_tps']:.0f} vs {theirs['throughput_tps']:.0f} tok/s "
                  f"(ours batched vs mlx_lm.server without a draft, batched)", flush=True)
            cells.append(row)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)
    report = {"settings": {**vars(args), "dtype": "float32", "ld_preload": env.get("LD_PRELOAD")},
              "machine": machine(), "cells": cells}
    save(report, args.name, plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    s = report["settings"]
    for t, style in zip(s["temperatures"], ("-", "--")):
        rows = [c for c in report["cells"] if c["temperature"] == t]
        x = [c["clients"] for c in rows]
        for engine, colour in zip(ENGINES, ("tab:green", "tab:olive", "tab:gray", "tab:blue")):
            axes[0].plot(x, [c[engine]["ttft_median_s"] * 1e3 for c in rows], style, color=colour,
                         marker="o", label=f"{engine}, T={t}")
            axes[1].plot(x, [c[engine]["throughput_tps"] for c in rows], style, color=colour,
                         marker="o", label=f"{engine}, T={t}")
    axes[0].set(xlabel="concurrent clients", ylabel="median time to first token (ms)",
                title="Time to first token (lower is better)", xscale="log", yscale="log")
    axes[1].set(xlabel="concurrent clients", ylabel="tokens/s, all clients",
                title="Throughput (higher is better)", xscale="log")
    for ax in axes:
        ax.set_xticks(s["clients"], [str(c) for c in s["clients"]])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    target = "demo pair" if s["target"] is None else Path(s["target"]).name
    fig.suptitle(f"Streaming completions over HTTP, {target}, k={s['k']}, {s['max_tokens']} tokens "
                 f"per request ({report['machine']['device']}, {s['dtype']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

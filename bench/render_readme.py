"""Render the README's results tables from results/*.json (between the RESULTS markers).

    python bench/render_readme.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _load(name: str) -> dict | None:
    path = ROOT / "results" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def demo_quality(r: dict) -> list[str]:
    s = r["settings"]
    plain = r["plain"]["tokens_per_second"]
    lines = [
        f"**Demo pair, held-out prompts** (`python bench/demo_quality.py`; {s['prompts']} prompts "
        f"x {s['max_tokens']} tokens, k={s['k']}, {s['dtype']}, {r['machine']['device']}, "
        f"BLAS: {r['machine']['blas']}; [json](results/demo_quality.json), "
        "[plot](results/demo_quality.png))",
        "",
        "| sampling | acceptance | per position | speculative / plain tokens/s |",
        "| --- | --- | --- | --- |",
    ]
    for name, res in r["speculative"].items():
        curve = " ".join(f"{x:.2f}" for x in res["per_position"] if x is not None)
        lines.append(f"| {name} | {res['acceptance']:.3f} | {curve} | "
                     f"{res['tokens_per_second'] / plain:.2f}x |")
    return lines


def demo_training(r: dict) -> list[str]:
    loss = r["held_out_loss_nats"]
    p = r["parameters"]
    return [
        f"**Demo pair training** (`{r['command']}`, {r['seconds']['total'] / 60:.0f} min on "
        f"{r['machine']['threads']} CPU threads; [json](results/demo_training.json)): target "
        f"{p['target'] / 1e6:.2f}M parameters, held-out loss {loss['target']:.3f} nats; draft "
        f"{p['draft'] / 1e6:.2f}M, {loss['draft']:.3f} nats; uniform "
        f"{r['uniform_loss_nats']:.3f} nats.",
    ]


def bounded_memory(r: dict) -> list[str]:
    s = r["settings"]
    lines = [
        f"**Bounded cache** (`python bench/bounded_memory.py`; {s['tokens']} tokens, "
        f"max_kv_size={s['max_kv_size']}, k={s['k']}, demo pair; "
        "[json](results/bounded_memory.json), [plot](results/bounded_memory.png))",
        "",
        "| run | KV cache at the end | process peak memory | tokens/s, whole run | "
        "tokens/s, last window |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, res in r["runs"].items():
        lines.append(f"| {name} | {res['final_cache_bytes'] / 2**20:.2f} MiB | "
                     f"{res['peak_memory_bytes'] / 2**20:.1f} MiB | "
                     f"{res['tokens_per_second']:.1f} | "
                     f"{res['points'][-1]['tokens_per_second']:.1f} |")
    return lines


def main() -> None:
    parts = []
    for name, render in [("demo_training", demo_training), ("demo_quality", demo_quality),
                         ("bounded_memory", bounded_memory)]:
        data = _load(name)
        if data is not None:
            parts += render(data) + [""]
    readme = ROOT / "README.md"
    text = readme.read_text()
    head, rest = text.split(START)
    _, tail = rest.split(END)
    readme.write_text(head + START + "\n" + "\n".join(parts) + END + tail)


if __name__ == "__main__":
    main()

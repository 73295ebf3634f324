"""The hybrid drafter against its two sources and plain decoding, on editing and on fresh code.

    python -m bench.hybrid          # ~8 minutes on a 2-core machine; results/hybrid.json, .png

Workloads (demo pair, float32, 128 tokens per prompt): "editing", prompts that hold a file and
ask for it back with a change (the continuation should copy most of the file: where n-gram
lookup pays), and "fresh", code prompts with nothing to copy. Contenders: plain decoding, prompt
lookup, the draft model, hybrid (k = 3 each, the server's default), and hybrid at k="auto". Each
(contender, workload, temperature) runs in a fresh process (one generation stream per process),
interleaved, REPEATS times, every process warmed up once; tokens/s is generated tokens over
decode time, summed over the workload's prompts. Greedy outputs are checked equal to plain
decoding's. The hybrid's rounds are counted by source.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = ("plain", "lookup", "model", "hybrid", "hybrid-auto")
WORKLOADS = ("editing", "fresh")
TEMPERATURES = (0.0, 0.7)
MAX_TOKENS = 128
REPEATS = 3

FILES = [
    "import math\n\n\nclass Circle:\n    def __init__(self, radius):\n        self.radius = "
    "radius\n\n    def area(self):\n        return math.pi * self.radius ** 2\n\n    def "
    "perimeter(self):\n        return 2 * math.pi * self.radius\n\n\nclass Square:\n    def "
    "__init__(self, side):\n        self.side = side\n\n    def area(self):\n        return "
    "self.side ** 2\n\n    def perimeter(self):\n        return 4 * self.side\n",
    "import json\nimport os\n\n\ndef load_config(path):\n    if not os.path.exists(path):\n"
    "        return {}\n    with open(path) as f:\n        return json.load(f)\n\n\ndef "
    "save_config(path, config):\n    with open(path, 'w') as f:\n        json.dump(config, f, "
    "indent=2)\n\n\ndef merge(base, extra):\n    out = dict(base)\n    for key, value in "
    "extra.items():\n        out[key] = value\n    return out\n",
    "def parse_args(argv):\n    args = {}\n    for item in argv:\n        if '=' in item:\n"
    "            key, value = item.split('=', 1)\n            args[key] = value\n        else:\n"
    "            args[item] = True\n    return args\n\n\ndef main(argv):\n    args = "
    "parse_args(argv)\n    for key in sorted(args):\n        print(key, args[key])\n    return "
    "0\n",
]
CHANGES = ["Circle renamed to Disk", "merge renamed to combine", "main returning 1"]
FRESH = ["def parse_args(", "import os\nimport sys\n\nclass Config:",
         "class Node:\n    def __init__(self"]


def prompts(workload: str) -> list[str]:
    if workload == "fresh":
        return FRESH
    return [f"# {name}.py\n{text}\n\n# {name}.py, the same file with {change}:\n"
            + text.split("\n", 1)[0] + "\n"
            for name, text, change in zip(("shapes", "config", "cli"), FILES, CHANGES)]


def worker(contender: str, workload: str, temperature: float) -> dict:
    from bench.common import machine, model_dtype  # noqa: I001  (before mlx.core: the BLAS preload)

    from tinydraft_mlx import Hybrid, generate, load_models
    from tinydraft_mlx.engine.drafters import HybridDraft

    target, draft, tok = load_models()
    texts = prompts(workload)
    sources = {"prompt-lookup": 0, "model": 0}

    def run(texts: list[str]) -> tuple[list, float, int, int, int]:
        outs, seconds, tokens, drafted, accepted = [], 0.0, 0, 0, 0
        for text in texts:
            k = "auto" if contender == "hybrid-auto" else 3
            if contender.startswith("hybrid"):
                d = HybridDraft(Hybrid(draft))
            else:
                d = {"plain": None, "lookup": "prompt-lookup", "model": draft}[contender]
            out, stats = generate(target, d, tok, text, k=k, max_tokens=MAX_TOKENS,
                                  temperature=temperature, seed=0)
            if isinstance(d, HybridDraft):
                for source, recent in d.recent.items():
                    sources[source] += recent.rounds
            outs.append(out)
            seconds += stats.decode_seconds
            tokens += stats.generated
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        return outs, seconds, tokens, drafted, accepted

    run(texts[:1])  # warm-up: traces, and k="auto"'s costs
    for source in sources:
        sources[source] = 0
    outs, seconds, tokens, drafted, accepted = run(texts)
    return {"machine": machine(), "dtype": model_dtype(target), "contender": contender,
            "workload": workload, "temperature": temperature, "tokens": tokens,
            "seconds": round(seconds, 4), "tps": round(tokens / seconds, 1),
            "drafted": drafted, "accepted": accepted,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "hybrid_rounds": sources if contender.startswith("hybrid") else None,
            "outputs": outs}


def run(contender: str, workload: str, temperature: float) -> dict:
    from bench.common import in_fresh_process

    return in_fresh_process(__file__, contender, workload, temperature)


def summarize(runs: list[dict]) -> list[dict]:
    """Median tokens/s per (workload, temperature, contender), and the ratio to plain's."""
    out = []
    for workload in WORKLOADS:
        for temperature in TEMPERATURES:
            cell = {c: [r for r in runs if r["contender"] == c and r["workload"] == workload
                        and r["temperature"] == temperature] for c in CONTENDERS}
            plain = statistics.median(r["tps"] for r in cell["plain"])
            for contender, rows in cell.items():
                tps = statistics.median(r["tps"] for r in rows)
                acc = [r["acceptance"] for r in rows if r["acceptance"] is not None]
                out.append({"workload": workload, "temperature": temperature,
                            "contender": contender, "tps": round(tps, 1),
                            "vs_plain": round(tps / plain, 3),
                            "acceptance": round(statistics.median(acc), 3) if acc else None,
                            "hybrid_rounds": rows[-1]["hybrid_rounds"]})
    return out


def plot(report: dict, path: Path) -> None:
    from bench.common import pyplot

    plt = pyplot()
    cells = [(w, t) for w in WORKLOADS for t in TEMPERATURES]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(CONTENDERS)
    for i, contender in enumerate(CONTENDERS):
        values = [next(s["vs_plain"] for s in report["summary"] if s["contender"] == contender
                       and (s["workload"], s["temperature"]) == cell) for cell in cells]
        ax.bar([j + i * width for j in range(len(cells))], values, width, label=contender)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))],
                  [f"{w}, {'greedy' if t == 0 else f'T={t}'}" for w, t in cells])
    ax.set_ylabel("tokens/s / plain decoding's")
    ax.legend(fontsize=8, ncol=len(CONTENDERS))
    m = report["machine"]
    ax.set_title(f"Hybrid drafting, demo pair, {report['settings']['dtype']}, {m['device']}, "
                 f"BLAS {m['blas'].split(' ')[0]}; k = 3, {MAX_TOKENS} tokens per prompt, "
                 f"median of {REPEATS}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    from bench.common import save

    runs, start = [], time.time()
    jobs = [(c, w, t) for _ in range(REPEATS) for w in WORKLOADS for t in TEMPERATURES
            for c in CONTENDERS]
    for contender, workload, temperature in jobs:
        result = run(contender, workload, temperature)
        runs.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "outputs")}),
              flush=True)
    exact = all(r["outputs"] == p["outputs"] for r in runs for p in runs
                if r["temperature"] == 0 and p["contender"] == "plain"
                and (p["workload"], p["temperature"]) == (r["workload"], r["temperature"]))
    report = {"machine": runs[0]["machine"], "settings": {
        "contenders": CONTENDERS, "workloads": {w: prompts(w) for w in WORKLOADS},
        "temperatures": TEMPERATURES, "k": 3, "max_tokens": MAX_TOKENS, "repeats": REPEATS,
        "dtype": runs[0]["dtype"], "seconds": round(time.time() - start)},
        "greedy_outputs_equal_plain": exact, "summary": summarize(runs),
        "runs": [{k: v for k, v in r.items() if k not in ("machine", "outputs")} for r in runs]}
    print(save(report, "hybrid", plot))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker(sys.argv[2], sys.argv[3], float(sys.argv[4]))))
    else:
        main()

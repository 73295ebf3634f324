"""Render the results tables of results/README.md from results/*.json (between the markers).

    python -m bench.render_readme

The sections of one subject have their own module: render_demo (the demo pair), render_auto
(k="auto"), render_heads (the heads that read the target), render_numerics (bit for bit).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench import render_auto, render_blocks, render_demo, render_heads, render_numerics

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _load(name: str) -> dict | None:
    path = ROOT / "results" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def batch_shapes(r: dict) -> list[str]:
    s = r["settings"]
    runs = r["runs"]

    def tps(contender: str, size: int, alpha: float | None = None) -> float:
        return next(x["aggregate_tps"] for x in runs if x["contender"] == contender
                    and x["batch"] == size and (alpha is None or x["alpha"] == alpha))

    lines = [
        f"**Batches on the Qwen2.5 shapes** (`python -m bench.batch_shapes`; {s['target']} "
        f"target, {s['draft']} draft, {s['dtype']}, B copies of one prompt, {s['max_tokens']} "
        "tokens per row, greedy, aggregate tokens/s over the whole batch (prefill included), one "
        "timed run per cell after a warm-up; [json](results/batch_shapes.json), "
        "[plot](results/batch_shapes.png))",
        "",
        "| B | mlx-lm `batch_generate` | ours plain | alpha | ours k=1 | ours k=2 | ours auto |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size in s["sizes"]:
        plain = tps("plain", size)
        for alpha in s["alphas"]:
            cells = " | ".join(f"{tps(c, size, alpha):.2f} ({tps(c, size, alpha) / plain:.2f}x)"
                               for c in ("k1", "k2", "auto"))
            lines.append(f"| {size} | {tps('mlx_lm', size):.2f} | {plain:.2f} | {alpha} | "
                         f"{cells} |")
    lines += ["", "Ratios in brackets are to ours plain batched at the same B."]
    return lines


def bounded_memory(r: dict) -> list[str]:
    s = r["settings"]
    lines = [
        f"**Bounded cache** (`python -m bench.bounded_memory`; {s['tokens']} tokens, "
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


def _cmd(r: dict, script: str, keys: list[str]) -> str:
    """The command line that produced `r`, from its recorded settings."""
    s = r["settings"]
    flags = []
    for key in keys:
        value = s.get(key)
        if value in (None, [], False):
            continue
        value = " ".join(map(str, value)) if isinstance(value, list) else value
        if key in ("target", "draft", "models"):
            value = " ".join("$S/" + Path(v).name for v in str(value).split())
        flags.append(f"--{key.replace('_', '-')} {value}")
    return f"python -m {script} " + " ".join(flags)


def head_to_head(name: str):
    def render(r: dict) -> list[str]:
        c = r["costs_ms"]
        t_v = " ".join(f"{float(v):.0f}" for v in c["t_v"].values())
        cmd = _cmd(r, "bench.speed", ["target", "draft", "oracle_alpha", "ks", "prompts",
                                   "max_tokens", "temp", "name"])
        lines = [
            f"**{name}** (`{cmd}`; {r['settings']['dtype']}, "
            f"BLAS {r['machine']['blas'].split(' (')[0]}; "
            f"[json](results/{r['settings']['name']}.json), "
            f"[plot](results/{r['settings']['name']}.png)). Costs: t_1 {c['t_1']:.1f} ms, "
            f"t_d {c['t_d']:.1f} ms, t_v(1..) {t_v} ms.",
            "",
            "| T | alpha | k | ours vs plain | mlx-lm vs plain | ours / mlx-lm | "
            "ours / mlx-lm, same kernels | ours with the eager forward / mlx-lm | predicted | "
            "measured / predicted | acceptance ours / mlx-lm | overhead |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in r["runs"]:
            alpha = "-" if row["alpha_oracle"] is None else row["alpha_oracle"]
            same = row.get("ours_vs_mlx_lm_same_kernels")
            same = "not run" if same is None and "mlx_lm_same_kernels" not in row else (
                "= (stock kernels)" if same is None else f"{same:.2f}")
            lines.append(
                f"| {row['temp']} | {alpha} | {row['k']} | {row['speedup_ours']:.2f}x | "
                f"{row['speedup_mlx_lm']:.2f}x | {row['ours_vs_mlx_lm']:.2f} | {same} | "
                f"{_eager(row)} | {row['predicted_speedup']:.2f}x | "
                f"{row['speedup_ours'] / row['predicted_speedup']:.2f} | "
                f"{row['acceptance_mean']:.2f} / {row['mlx_lm_acceptance_mean']:.2f} | "
                f"{row['overhead_fraction']:.0%} |")
        return lines

    return render


def _eager(row: dict) -> str:
    value = row.get("ours_eager_vs_mlx_lm")
    return "not run" if value is None else f"{value:.2f}"


def best_k(r: dict) -> list[str]:
    """Best fixed k, ours vs mlx-lm, per temperature (the issue's head-to-head figure)."""
    lines = ["| T | ours: best k, tok/s | mlx-lm: best k, tok/s | ours / mlx-lm, best vs best | "
             "ours with the eager forward, best / mlx-lm best | plain: ours / mlx-lm |",
             "| --- | --- | --- | --- | --- | --- |"]
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    plain = mean(r["plain"]["ours"]) / mean(r["plain"]["mlx_lm"])
    for temp in sorted({row["temp"] for row in r["runs"]}):
        rows = [row for row in r["runs"] if row["temp"] == temp and row["alpha_oracle"] is None]
        if not rows or "ours_eager" not in rows[0]:
            continue
        ours = max(rows, key=lambda row: mean(row["ours"]))
        eager = max(rows, key=lambda row: mean(row["ours_eager"]))
        theirs = max(rows, key=lambda row: mean(row["mlx_lm"]))
        o, e, t = mean(ours["ours"]), mean(eager["ours_eager"]), mean(theirs["mlx_lm"])
        lines.append(f"| {temp} | k={ours['k']}, {o:.0f} | k={theirs['k']}, {t:.0f} | "
                     f"**{o / t:.2f}** | {e / t:.2f} (k={eager['k']}) | {plain:.2f} |")
    return lines if len(lines) > 2 else []


def blas(r: dict) -> list[str]:
    s = r["settings"]
    lines = [
        "**BLAS** (`python -m bench.studies.blas --models $S/0.5B $S/1.5B`; prefill "
        f"{s['prefill_tokens']} tokens, decode {s['decode_tokens']} tokens, median of "
        f"{s['repeats']}, fp32; "
        "[json](results/blas.json), [plot](results/blas.png))",
        "",
        "| shapes | BLAS | decode tok/s | x stock | prefill tok/s | x stock |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["runs"]:
        lines.append(f"| {row['model']} | {row['blas'].split(' (')[0]} | "
                     f"{row['decode_tok_s']:.2f} | {row['decode_vs_stock']:.1f}x | "
                     f"{row['prefill_tok_s']:.1f} | {row['prefill_vs_stock']:.1f}x |")
    return lines


def adaptive(r: dict) -> list[str]:
    s = r["settings"]
    cmd = _cmd(r, "bench.adaptive", ["target", "draft", "alphas", "ks", "prompts", "max_tokens",
                                  "lookup_tokens"])
    lines = [f"**k=auto and prompt lookup** (`{cmd}`; greedy, BLAS {s['blas'].split(' (')[0]}; "
             "[json](results/adaptive.json), [plot](results/adaptive.png))", ""]
    if r["oracle"]:
        names = list(r["oracle"][0]["speedup"])
        lines += ["| alpha | " + " | ".join(names) + " | auto / best fixed k | auto / plain |",
                  "| --- " * (len(names) + 3) + "|"]
        for row in r["oracle"]:
            lines.append(f"| {row['alpha']} | " + " | ".join(
                f"{row['speedup'][n]:.2f}x" for n in names) +
                f" | {row['auto_vs_best_fixed']:.2f} | {row['auto_vs_plain']:.2f} |")
        lines.append("")
    names = list(r["lookup"][0]["speedup"])
    lines += ["| demo target, workload | " + " | ".join(names) + " |",
              "| --- " * (len(names) + 1) + "|"]
    for row in r["lookup"]:
        lines.append(f"| {row['workload']} | " + " | ".join(
            f"{row['speedup'][n]:.2f}x" for n in names) + " |")
    return lines


def row_consistency(r: dict) -> list[str]:
    rows = [int(n) for n in r["runs"][0]["max_difference_by_rows"]]
    lines = [
        "**Greedy identity: one row vs k + 1 rows** (`python -m bench.studies.row_consistency`; "
        f"demo target, {r['settings']['tokens']} tokens after each of 4 prompts, device "
        f"{r['machine']['device']}, BLAS {r['machine']['blas'].split(' (')[0]}; "
        "[json](results/row_consistency.json), [plot](results/row_consistency.png)): the largest "
        "logit difference between plain decoding's one-row pass and a verify pass scoring the "
        "same positions together.",
        "",
        "| dtype | max abs logit | " + " | ".join(f"{n} rows" for n in rows) + " |",
        "| --- " * (len(rows) + 2) + "|",
    ]
    for run in r["runs"]:
        diffs = run["max_difference_by_rows"].values()
        lines.append(f"| {run['dtype']} | {run['max_abs_logit']:.1f} | "
                     + " | ".join(f"{d:.1e}" if d else "0" for d in diffs) + " |")
    batched = [run for run in r["runs"] if "max_difference_batched_by_b" in run]
    if batched:
        sizes = list(batched[0]["max_difference_batched_by_b"])
        lines += ["", "The same for batches: a sequence's 4-row verify alone vs as one row of a "
                  "batch of B sequences of different lengths.", "",
                  "| dtype | " + " | ".join(f"B = {b}" for b in sizes) + " |",
                  "| --- " * (len(sizes) + 1) + "|"]
        for run in batched:
            diffs = run["max_difference_batched_by_b"].values()
            lines.append(f"| {run['dtype']} | "
                         + " | ".join(f"{d:.1e}" if d else "0" for d in diffs) + " |")
    return lines


def prompt_cache(r: dict) -> list[str]:
    s, summary = r["settings"], r["summary"]
    cmd = _cmd(r, "bench.prompt_cache", ["target", "draft", "first_tokens", "second_tokens",
                                      "max_tokens", "name"])
    with_pc, without = summary["with prompt cache"], summary["without"]
    pair = "demo pair" if s["target"] is None else f"{Path(s['target']).name} target"
    return [
        f"| {pair} (`{cmd}`; {s['dtype']}, [json](results/{s['name']}.json)) | "
        f"{summary['second_turn_prompt_tokens']} ({with_pc['cached_tokens']:.0f} cached) | "
        f"{without['prefill_s']:.3f} s | {with_pc['prefill_s']:.3f} s | "
        f"{without['prefill_s'] / with_pc['prefill_s']:.1f}x | "
        f"{without['turn_s']:.2f} s -> {with_pc['turn_s']:.2f} s |",
    ]


def plain(r: dict) -> list[str]:
    s, m = r["settings"], r["median_tokens_per_second"]
    return [
        f"**Plain decoding, ours vs mlx-lm's `generate_step`** (`python -m bench.plain "
        f"--repeats {s['repeats']}`; demo target, {s['dtype']}, greedy, {s['prompts']} held-out "
        f"prompts x {s['max_tokens']} tokens, same model object, order rotated; "
        f"[json](results/plain.json), [plot](results/plain.png)): our token loop "
        f"{m['ours']:.1f} tok/s, `generate_step` {m['mlx-lm']:.1f} tok/s "
        f"(**{r['ratio']:.2f}x**), `stream_generate` with the text layer {m['ours + text']:.1f} "
        f"tok/s; same tokens: {r['same_tokens']}.",
    ]


def draft_vocab(r: dict) -> list[str]:
    d, s = r["demo"], r["settings"]
    full = d["rows"]["full"]
    lines = [
        f"**Draft-vocabulary pruning** (`python -m bench.draft_vocab`; {d['dtype']}, k={s['k']}, "
        f"{s['prompts']} held-out prompts x {s['max_tokens']} tokens; "
        "[json](results/draft_vocab.json), [plot](results/draft_vocab.png))",
        "",
        "| model | N | draft step | vs full head | acceptance greedy / T=1 | tok/s greedy | "
        "greedy output = plain |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, row in d["rows"].items():
        lines.append(
            f"| demo pair (vocabulary {d['vocab']}) | {n} | {row['step_ms']:.2f} ms | "
            f"{row['step_ms'] / full['step_ms']:.2f}x | {row['greedy']['acceptance']:.2f} / "
            f"{row['T=1']['acceptance']:.2f} | {row['greedy']['tokens_per_second']:.0f} | "
            f"{row['greedy']['equal_to_plain']:.0%} |")
    shape = r.get("shape_0.5B")
    if shape:
        base = shape["rows"]["full"]["step_ms"]
        for n, row in shape["rows"].items():
            lines.append(f"| Qwen2.5-0.5B shape (vocabulary {shape['vocab']}) | {n} | "
                         f"{row['step_ms']:.1f} ms | {row['step_ms'] / base:.2f}x | - | - | - |")
    return lines


def distributed(r: dict) -> list[str]:
    lines = [
        "**Target tensor-parallel on 2 local ranks vs one process** (`python -m bench.distributed`;"
        f" ring backend on 127.0.0.1, one BLAS thread per rank, {r['machine']['device']}; two "
        "ranks share this machine's 2 cores: ratios only; [json](results/distributed.json), "
        "[plot](results/distributed.png))",
        "",
        "| pair | run | t_1 | t_v(2) / t_v(5) | t_d | all-reduces in t_v(5) | plain tok/s | "
        "k=3 tok/s (vs plain) | predicted best at alpha 0.5 / 0.7 / 0.9 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["rows"]:
        for run in ("one process", "2 ranks"):
            m = row[run]
            share = m.get("comm_share", {}).get("5")
            speed = (f"{m['plain tok/s']:.0f} | {m['k=3 tok/s']:.0f} "
                     f"({m['k=3 tok/s'] / m['plain tok/s']:.2f}x)"
                     if "plain tok/s" in m else "- | -")
            pred = " / ".join(f"{v:.2f}x" for v in row["predicted"][run].values())
            lines.append(
                f"| {row['pair']} | {run} | {m['t_1']:.1f} ms | {m['t_v']['2']:.1f} / "
                f"{m['t_v']['5']:.1f} ms | {m['t_d']:.1f} ms | "
                f"{'-' if share is None else f'{share:.0%}'} | {speed} | {pred} |")
    return lines


def server(r: dict) -> list[str]:
    s = r["settings"]
    pair = "demo pair" if s["target"] is None else Path(s["target"]).name
    engines = [e for e in r["cells"][0] if e not in ("temperature", "clients")]
    base = "mlx_lm.server, no draft" if "mlx_lm.server, no draft" in engines else engines[-1]
    command = "python -m bench.server" + ("" if s["name"] == "server" else
                                          f" --clients {' '.join(map(str, s['clients']))} "
                                          + ("" if s["requests"] == 3 else
                                             f"--requests {s['requests']} ")
                                          + f"--name {s['name']}")
    lines = [
        f"**Through HTTP** (`{command}`; {pair}, {s['dtype']} for all, k={s['k']}, "
        f"{s['max_tokens']} tokens per request, {s['requests']} streaming requests per client, "
        f"{r['machine']['device']}, BLAS: {r['machine']['blas']}; "
        f"[json](results/{s['name']}.json), [plot](results/{s['name']}.png)). Throughput tok/s "
        f"(ratio to `{base}`) / median TTFT ms; greedy rows: share of texts equal to plain "
        "greedy decoding.",
        "",
        "| T | clients | " + " | ".join(f"`{e}`" for e in engines) + " |",
        "| --- | --- | " + "--- | " * len(engines),
    ]
    for c in r["cells"]:
        ref = c[base]["throughput_tps"]
        cells = []
        for e in engines:
            x = c[e]
            equal = (f", {x['equal_to_plain_greedy']:.0%} exact" if "equal_to_plain_greedy" in x
                     else "")
            cells.append(f"{x['throughput_tps']:.0f} ({x['throughput_tps'] / ref:.2f}x) / "
                         f"{x['ttft_median_s'] * 1e3:.0f} ms{equal}")
        lines.append(f"| {c['temperature']:g} | {c['clients']} | " + " | ".join(cells) + " |")
    return lines


def batch(r: dict) -> list[str]:
    s, m = r["settings"], r["machine"]
    lines = [
        f"**Batches: aggregate tokens/s against B** (`python -m bench.batch`; demo pair, "
        f"{s['dtype']}, {s['max_tokens']} tokens per prompt, each cell a fresh process, warm; "
        f"{m['device']}, BLAS: {m['blas']}; [json](results/batch.json), "
        "[plot](results/batch.png)). In brackets: / mlx-lm's `batch_generate` (no draft).",
        "",
        "| T | B | mlx-lm | ours plain | ours k=1 | ours k=3 | ours auto | per sequence, k=3 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    cell = {(x["contender"], x["batch"], x["temperature"]): x for x in r["runs"]}
    for t in s["temperatures"]:
        for b in s["sizes"]:
            base = cell[("mlx_lm", b, t)]["aggregate_tps"]
            row = [f"{t:g}", str(b), f"{base:.0f}"]
            for c in ("plain", "k1", "k3", "auto"):
                v = cell[(c, b, t)]["aggregate_tps"]
                row.append(f"{v:.0f} ({v / base:.2f}x)")
            row.append(f"{cell[('k3', b, t)]['per_sequence_tps']:.0f}")
            lines.append("| " + " | ".join(row) + " |")
    single = {x["temperature"]: x for x in r["runs"] if x["contender"] == "single"}
    if single:
        lines += ["", "B = 1 against single-stream `generate` at k=3: " + ", ".join(
            f"T={t:g} {cell[('k3', 1, t)]['aggregate_tps'] / x['aggregate_tps']:.2f}x "
            f"({cell[('k3', 1, t)]['aggregate_tps']:.0f} vs {x['aggregate_tps']:.0f} tok/s)"
            for t, x in sorted(single.items()))]
    return lines


def hybrid(r: dict) -> list[str]:
    s, m = r["settings"], r["machine"]
    lines = [
        f"**Hybrid drafting: prompt lookup and the draft model** (`python -m bench.hybrid`; demo "
        f"pair, {s['dtype']}, k={s['k']}, {s['max_tokens']} tokens per prompt, 3 prompts per "
        f"workload, each cell a fresh process, median of {s['repeats']}; {m['device']}, BLAS: "
        f"{m['blas']}; [json](results/hybrid.json), [plot](results/hybrid.png)). Decode "
        "tokens/s (ratio to plain) and acceptance; greedy outputs equal to plain decoding's: "
        f"{'yes' if r['greedy_outputs_equal_plain'] else 'NO'}.",
        "",
        "| workload | T | " + " | ".join(s["contenders"]) + " | hybrid rounds, lookup / model |",
        "| --- | --- | " + "--- | " * (len(s["contenders"]) + 1),
    ]
    cells: dict[tuple, dict] = {}
    for x in r["summary"]:
        cells.setdefault((x["workload"], x["temperature"]), {})[x["contender"]] = x
    for (workload, t), row in cells.items():
        out = [workload, f"{t:g}"]
        for c in s["contenders"]:
            x = row[c]
            acc = "" if x["acceptance"] is None else f", {x['acceptance']:.2f}"
            out.append(f"{x['tps']:.0f} ({x['vs_plain']:.2f}x{acc})")
        rounds = row["hybrid"]["hybrid_rounds"]
        out.append(f"{rounds['prompt-lookup']} / {rounds['model']}")
        lines.append("| " + " | ".join(out) + " |")
    return lines


def sampled_bound(r: dict) -> list[str]:
    s = r["settings"]
    lines = [
        f"**What bounds sampled speculation** (`python -m bench.sampled_bound`; demo pair, "
        f"{s['dtype']}, {s['prompts']} prompts x {s['seeds']} seeds x {s['max_tokens']} tokens; "
        "[json](results/sampled_bound.json), [plot](results/sampled_bound.png)): a one-token "
        "draft is accepted with probability sum min(p, q), so k = 1 pays only above "
        "R(1) / R(0) - 1, whatever the sampling overhead",
        "",
        "| T | acceptance reachable (sum min(p, q) on the target's text) | k = 1 acceptance in "
        "the loop | R(0) | R(1) | acceptance k = 1 needs | k = 1 / plain at that bound | "
        "k = 1 / plain measured |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in r["cells"]:
        t = f"{c['temp']:g}" + (f" (top-p {c['top_p']}, top-k {c['top_k']})" if c["temp"]
                                else " (greedy: argmax agreement)")
        lines.append(
            f"| {t} | {c['acceptance_own_text']:.2f} | {c['acceptance_k1_loop']:.2f} | "
            f"{c['round_ms']['0']:.2f} ms | {c['round_ms']['1']:.2f} ms | "
            f"{c['break_even_acceptance']:.2f} | {c['k1_bound_vs_plain']:.2f}x | "
            f"{c['k1_tok_s'] / c['plain_tok_s']:.2f}x |")
    return lines


def seeded(r: dict) -> list[str]:
    s, m = r["settings"], r["machine"]
    lines = [
        f"**What a seed's coupling costs in acceptance** (`python -m bench.seeded`; demo pair, "
        f"{s['dtype']}, {s['prompts']} prompts x {s['samples']} runs x {s['max_tokens']} tokens "
        "per contender, top-p 0.8 and top-k 20 at T = 0.7; "
        f"{m['device']}; [json](results/seeded.json), [plot](results/seeded.png)): draft tokens "
        "accepted / drafted without a seed (min(1, p/q) rejection sampling) and with one "
        "(Gumbel-max coupling: a seeded text is plain decoding's whatever drafts it)",
        "",
        "| T | k | unseeded acceptance | seeded acceptance | seeded / unseeded | tokens a round, "
        "unseeded | seeded |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in r["cells"]:
        a, b = c["rejection"], c["seeded"]
        lines.append(f"| {c['temp']:g} | {c['k']} | {a['acceptance']:.3f} | {b['acceptance']:.3f} "
                     f"| {c['ratio']:.2f} | {a['tokens_per_round']:.2f} | "
                     f"{b['tokens_per_round']:.2f} |")
    return lines


def hybrid_models(r: dict) -> list[str]:
    m, t = r["machine"], r["target"]
    runs = r["runs"]

    def tps(contender: str, batch: int, alpha: float = 0.0) -> float:
        return next(x["tok_s"] for x in runs if x["contender"] == contender
                    and x["batch"] == batch and (contender in ("mlx_lm", "plain")
                                                 or x["alpha"] == alpha))

    lines = [
        f"**Hybrid target (recurrent + attention layers)** (`python -m bench.hybrid_models`; a "
        f"random Qwen3.5-shaped target: {t['num_hidden_layers']} layers of Qwen3.5-0.8B's shapes, "
        f"{t['num_hidden_layers'] * 3 // 4} Gated DeltaNet and {t['num_hidden_layers'] // 4} "
        f"attention, vocabulary {t['vocab_size']}; {r['draft']} draft; {r['dtype']}, "
        f"{r['max_tokens']} tokens, greedy, each contender its own process; {m['device']}; "
        "[json](results/hybrid_models.json), [plot](results/hybrid_models.png)): tok/s over "
        "our plain decoding",
        "",
        "| B | mlx-lm plain | ours plain | k = 1 | k = 2 | k = 3 | k = 4 | auto | alpha |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = tps("plain", 1)
    for alpha in (0.5, 0.9):
        cells = [f"{tps(str(k), 1, alpha) / base:.2f}x" for k in (1, 2, 3, 4)]
        lines.append(f"| 1 | {tps('mlx_lm', 1) / base:.2f}x | 1.00x ({base:.1f} tok/s) | "
                     + " | ".join(cells) + f" | {tps('auto', 1, alpha) / base:.2f}x | {alpha} |")
    base4 = tps("plain", 4)
    lines.append(f"| 4 | {tps('mlx_lm', 4) / base4:.2f}x | 1.00x ({base4:.1f} tok/s) | | "
                 f"{tps('2', 4, 0.9) / base4:.2f}x | | | {tps('auto', 4, 0.9) / base4:.2f}x "
                 "| 0.9 |")
    lines += ["", "Rolling back the recurrent layers after a verify of k + 1 positions (to "
              "k // 2 + 1 of them; one sequence; medians of 20):", "",
              "| k | verify forward, ms | rollback, ms | rollback / verify | tape, MB |",
              "| --- | --- | --- | --- | --- |"]
    for c in r["rollback"]:
        lines.append(f"| {c['k']} | {c['verify_ms']:.1f} | {c['rollback_ms']:.2f} | "
                     f"{c['rollback_ms'] / c['verify_ms']:.1%} | {c['tape_bytes'] / 1e6:.1f} |")
    lines += ["", "What the tape holds per sequence during a round (projected from the layer "
              "shapes, bfloat16 inputs, float32 states), against writing every verified "
              "position's state:", "",
              "| Qwen3.5 shape | k | tape, MB | a state per position, MB |",
              "| --- | --- | --- | --- |"]
    for p in r["projected"]:
        lines.append(f"| {p['shape']} | {p['k']} | {p['tape_MB']:.0f} | "
                     f"{p['states_per_position_MB']:.0f} |")
    return lines


PROMPT_CACHE_HEAD = [
    "**Prompt cache, second turn of a conversation** (median of the runs; the whole turn "
    "includes decoding the reply)",
    "",
    "| pair | turn-2 prompt tokens | prefill without | with the cache | speedup | whole turn |",
    "| --- | --- | --- | --- | --- | --- |",
]


def main() -> None:
    parts = []
    for name, render in [
        ("demo_training", render_demo.training),
        ("demo_retrain", render_demo.retrain),
        ("demo_derepeat", render_demo.derepeat),
        ("demo_quality", render_demo.quality),
        ("demo_pair", head_to_head("Demo pair, ours vs mlx-lm")),
        ("demo_pair", best_k),
        ("auto", render_auto.auto),
        ("auto_250M", render_auto.auto),
        ("auto_fresh", render_auto.fresh),
        ("auto_fresh_policy", render_auto.in_one_process),
        ("auto_fresh_prompts", render_auto.in_one_process),
        ("auto_warm_policy", render_auto.in_one_process),
        ("sampled_bound", sampled_bound),
        ("seeded", seeded),
        ("shapes_0.5B_1.5B", head_to_head("Qwen2.5 shapes 0.5B -> 1.5B, oracle draft")),
        ("shapes_0.5B_3B", head_to_head("Qwen2.5 shapes 0.5B -> 3B, oracle draft")),
        ("blas", blas),
        ("adaptive", adaptive),
        ("bounded_memory", bounded_memory),
        ("row_consistency", row_consistency),
        ("bitwise", render_numerics.bitwise),
        ("plain", plain),
        ("draft_vocab", draft_vocab),
        ("distributed", distributed),
        ("server", server),
        ("server_8", server),
        ("batch", batch),
        ("batch_shapes", batch_shapes),
        ("hybrid", hybrid),
        ("hybrid_models", hybrid_models),
        ("train_heads", render_heads.train_heads),
        ("drafters", render_heads.drafters),
        ("train_dflash", render_blocks.train_dflash),
        ("dflash_reference", render_blocks.dflash_reference),
        ("acceptance_rules", render_blocks.acceptance_rules),
        ("dflash_shapes", render_blocks.dflash_shapes),
        ("trees", render_blocks.trees),
        ("tree_shapes", render_blocks.tree_shapes),
        ("peers", render_blocks.peers),
        ("vision", render_blocks.vision),
    ]:
        data = _load(name)
        if data is not None:
            parts += render(data) + [""]
    rows = [row for name in ("prompt_cache", "prompt_cache_shapes") if (data := _load(name))
            for row in prompt_cache(data)]
    if rows:
        parts += PROMPT_CACHE_HEAD + rows + [""]
    readme = ROOT / "results" / "README.md"
    text = readme.read_text()
    head, rest = text.split(START)
    _, tail = rest.split(END)
    body = "\n".join(parts)
    # links are written from the repository's root: this page lives in results/
    body = re.sub(r"\]\(results/", "](", body).replace("](docs/", "](../docs/")
    readme.write_text(head + START + "\n" + body + END + tail)


if __name__ == "__main__":
    main()

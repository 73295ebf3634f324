"""results/README.md's sections for k="auto": against plain and fixed k in one process
(results/auto.json, auto_250M.json), in fresh processes (auto_fresh.json), and with a fresh or a
warm policy in one process (auto_fresh_policy.json, auto_fresh_prompts.json,
auto_warm_policy.json). Called by render_readme.py."""

from __future__ import annotations

from pathlib import Path


def auto(r: dict) -> list[str]:
    s = r["settings"]
    name = s.get("name", "auto")
    if s.get("target"):  # another pair than the demo's: name it and give the whole command
        pair = (f"{Path(s['draft']).name} -> {Path(s['target']).name} (random weights, oracle "
                "draft)")
        command = (f"python -m bench.auto --target $S/{Path(s['target']).name} --draft "
                   f"$S/{Path(s['draft']).name} --alphas {' '.join(map(str, s['alphas']))} "
                   f"--prompts {s['prompts']} --max-tokens {s['max_tokens']} --temps "
                   f"{' '.join(map(str, s['temps']))} --repeats {s['repeats']} --name {name}")
    else:
        pair, command = "demo pair", f"python -m bench.auto --repeats {s['repeats']}"
    lines = [
        f"**k=\"auto\" vs plain and fixed k, {pair}** (`{command}`; "
        f"{s['dtype']}, {s['prompts']} prompts x {s['max_tokens']} tokens x "
        f"{s['repeats']} repeats, contenders interleaved, medians; "
        + (f"T > 0 with top-p {s['top_p']}, top-k {s['top_k']}; " if "top_p" in s else "")
        + "warm = the pair's policy trained by earlier generations, cold = a fresh policy; "
        f"[json](results/{name}.json), [plot](results/{name}.png))",
        "",
        "| draft | plain | " + " | ".join(f"k={k}" for k in s["ks"]) +
        " | auto warm | auto cold | warm / best fixed | warm / plain | cold / best fixed | "
        "cold / plain |",
        "| --- | --- | " + " | ".join("---" for _ in s["ks"]) + " | --- | --- | --- | --- | --- "
        "| --- |",
    ]
    for c in r["cells"]:
        real = "its draft (random weights)" if s.get("target") else "real"
        name = (f"{real}, T={c['temp']}" if c["draft"] == "real" else f"oracle alpha={c['alpha']}")
        v = c["vs_plain"]
        lines.append(
            f"| {name} | 1.00x | " + " | ".join(f"{v[f'k={k}']:.2f}x" for k in s["ks"]) +
            f" | {v['auto warm']:.2f}x | {v['auto cold']:.2f}x | "
            f"{c['auto_warm_vs_best_fixed']:.2f} | {c['auto_warm_vs_plain']:.2f} | "
            f"{c['auto_cold_vs_best_fixed']:.2f} | {c['auto_cold_vs_plain']:.2f} |")
    return lines


def fresh(r: dict) -> list[str]:
    s, m = r["settings"], r["machine"]
    names = list(r["cells"][0]["tok_s"])
    lines = [
        f"**k=\"auto\" in fresh processes** (`python -m bench.auto --fresh`; demo pair, "
        f"{s['dtype']}, one prompt x {s['max_tokens']} tokens, every contender in its own "
        f"process, median of {s['repeats']}; T=0.7 with top-p 0.8, top-k 20; {m['device']}, "
        f"BLAS: {m['blas']}; [json](results/auto_fresh.json), [plot](results/auto_fresh.png)). "
        "Decode tokens/s (ratio to plain: medians of each run's tokens/s over plain decoding's "
        "in the same process, before and after it, where the JSON has them).",
        "",
        "| draft, T | " + " | ".join(names) + " | best fixed k | "
        + " | ".join(f"{n} / best fixed" for n in names if n.startswith("auto")) + " |",
        "| --- | " + "--- | " * (len(names) + 1 + sum(n.startswith("auto") for n in names)),
    ]
    for c in r["cells"]:
        cells = [f"{c['tok_s'][n]:.0f} ({c['vs_plain'][n]:.2f}x)" for n in names]
        autos = [f"{c['vs_best_fixed'][n]:.2f}" for n in names if n.startswith("auto")]
        lines.append(f"| {c['cell']}, {c['temp']:g} | " + " | ".join(cells)
                     + f" | {c['best_fixed']} | " + " | ".join(autos) + " |")
    if all("ttft_ms" in c for c in r["cells"]):
        lines += [
            "",
            "Time to the first token from the call, ms (median; in brackets the median of each "
            "run's over plain decoding's in its process), and tokens/s from the call to the last "
            "token (the prefills in) as a ratio to plain decoding's and to the best fixed k's:",
            "",
            "| draft, T | " + " | ".join(f"{n} TTFT" for n in names) + " | "
            + " | ".join(f"{n} end to end / plain, / best fixed" for n in names
                         if n.startswith("auto")) + " |",
            "| --- | " + "--- | " * (len(names) + sum(n.startswith("auto") for n in names)),
        ]
        for c in r["cells"]:
            ttft = [f"{c['ttft_ms'][n]:.1f} ({c['ttft_vs_own_plain'][n]:.2f})" for n in names]
            e2e = [f"{c['e2e_vs_plain'][n]:.2f}, {c['e2e_vs_best_fixed'][n]:.2f}"
                   for n in names if n.startswith("auto")]
            lines.append(f"| {c['cell']}, {c['temp']:g} | " + " | ".join(ttft) + " | "
                         + " | ".join(e2e) + " |")
    return lines


def in_one_process(r: dict) -> list[str]:
    s, m = r["settings"], r["machine"]
    names = list(r["cells"][0]["tok_s"])
    every = not s.get("warm") and len(s["prompts"]) > 1  # `--fresh-prompts`
    name = ("auto_warm_policy" if s.get("warm") else "auto_fresh_prompts" if every else
            "auto_fresh_policy")
    what = (f"a warm policy, in one process** (`python -m bench.auto --warm-policy`; demo pair, "
            f"{s['dtype']}, {len(s['prompts'])} prompts in turn x {s['max_tokens']} tokens, "
            f"{s['rounds']} rounds of every contender in shuffled order, the pair's policy kept "
            "from two earlier generations of each prompt on" if s.get("warm") else
            f"a fresh policy, in one process** (`python -m bench.auto "
            f"{'--fresh-prompts' if every else '--fresh-policy'}`; demo pair, {s['dtype']}, "
            + (f"{len(s['prompts'])} prompts in turn, one a round," if every else "one prompt x")
            + f" {s['max_tokens']} tokens, {s['rounds']} rounds of every contender in shuffled "
            "order, the policy cleared before each auto generation")
    file = "file" in r["cells"][0]
    if file:
        what += ("; \"auto, file\": a new process's policy (nothing in memory) that reads the "
                 "policy file a previous one wrote and then writes it")
    lines = [
        f"**k=\"auto\" with {what}; tokens/s from the call to the last token, means; "
        f"{m['device']}, BLAS: {m['blas']}; [json](results/{name}.json), "
        f"[plot](results/{name}.png)). In brackets: 95% bootstrap intervals.",
        "",
        "| draft, T | " + " | ".join(names) + " | auto / plain | auto / best fixed k | "
        "auto drafted (median tokens) |"
        + (" auto, file / plain | auto, file / best fixed k | auto, file drafted |" if file
           else ""),
        "| --- | " + "--- | " * (len(names) + 3 + 3 * file),
    ]
    for c in r["cells"]:
        cells = [f"{c['tok_s'][n]:.0f} ({c['vs_plain'][n]:.2f}x)" for n in names]
        lo, hi = c["auto_vs_plain_95"]
        blo, bhi = c["auto_vs_best_fixed_95"]
        line = (f"| {c['cell']}, {c['temp']:g} | " + " | ".join(cells)
                + f" | {c['auto_vs_plain']:.3f} [{lo:.3f}, {hi:.3f}] | "
                f"{c['auto_vs_best_fixed']:.3f} [{blo:.3f}, {bhi:.3f}] ({c['best_fixed']}) | "
                f"{c['auto_drafted_median']:g} |")
        if file:
            f = c["file"]
            (lo, hi), (blo, bhi) = f["vs_plain_95"], f["vs_best_fixed_95"]
            line += (f" {f['vs_plain']:.3f} [{lo:.3f}, {hi:.3f}] | {f['vs_best_fixed']:.3f} "
                     f"[{blo:.3f}, {bhi:.3f}] | {f['drafted_median']:g} |")
        lines.append(line)
    return lines

"""results/README.md's sections for block drafters: the demo target's DFlash drafter
(results/train_dflash.json), ours against the reference's MLX path (dflash_reference.json), and
what a block costs on 4B shapes (dflash_shapes.json). Called by render_readme.py."""

from __future__ import annotations


def train_dflash(r: dict) -> list[str]:
    s = r["settings"]
    passes = r.get("passes") or [r]
    first = passes[0]["held_out"]
    width = len(first["after"]["agreement"])
    lines = [
        f"**The demo target's DFlash drafter** (`python -m training.train_dflash`, "
        f"{len(passes)} pass(es), {sum(p['minutes'] for p in passes):.0f} min; {s['layers']} "
        f"layers reading target layers {r['layers_read']}, block {s['block_size']}; the "
        "commands in training/pipeline.sh; [json](results/train_dflash.json), "
        "[plot](results/train_dflash.png)): top-1 agreement with the target per block position, "
        f"teacher-forced on 256 held-out stdlib windows (anchor at {first['anchor']}), and the "
        "KL from the target in nats",
        "",
        "| drafter | KL | " + " | ".join(str(i + 1) for i in range(width)) + " |",
        "| --- | --- |" + " --- |" * width,
        f"| initialisation | {first['before']['kl']:.2f} | "
        + " | ".join(f"{v:.2f}" for v in first["before"]["agreement"]) + " |",
    ]
    for i, p in enumerate(passes):
        after = p["held_out"]["after"]
        lines.append(f"| after pass {i + 1} | {after['kl']:.2f} | "
                     + " | ".join(f"{v:.2f}" for v in after["agreement"]) + " |")
    return lines


def dflash_reference(r: dict) -> list[str]:
    s, m = r["settings"], r["machine"]
    lines = [
        f"**DFlash, ours against the reference** (`python -m bench.dflash_reference`; "
        f"{s['reference']}'s MLX `stream_generate` at block {s['block_size']} beside our "
        f"`generate` at k = {s['block_size'] - 1}, the demo target and demo/dflash, one "
        f"sequence, {s['prompts']}, {s['max_tokens']} tokens; {s['dtype']}, {m['device']}; "
        f"median of {s['repeats']} processes; greedy tokens equal the reference's: "
        f"{'yes' if r['greedy_equal_reference'] else 'NO'}, plain decoding's: "
        f"{'yes' if r['greedy_equal_plain'] else 'NO'}; [json](results/dflash_reference.json), "
        "[plot](results/dflash_reference.png))",
        "",
        "| contender | greedy tok/s | vs plain | tau | T = 0.7 tok/s | vs plain | tau |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for contender in s["contenders"]:
        cells = []
        for t in s["temperatures"]:
            x = next(y for y in r["summary"] if (y["contender"], y["temperature"])
                     == (contender, t))
            cells += [f"{x['tps']:.0f}", f"{x['vs_plain']:.2f}x", f"{x['tau']:.2f}"]
        lines.append(f"| {contender} | " + " | ".join(cells) + " |")
    ratio = ", ".join(f"{'greedy' if float(t) == 0 else 'T = ' + t} {v:.2f}x"
                      for t, v in r["ours_vs_reference"].items())
    lines += ["", f"Ours at the reference's block over its tokens/s: {ratio}."]
    if "auto_vs_reference" in r:
        auto = ", ".join(f"{'greedy' if float(t) == 0 else 'T = ' + t} {v:.2f}x"
                         for t, v in r["auto_vs_reference"].items())
        lines[-1] += (f" Ours with k = \"auto\" (the block length, plain rounds included, "
                      f"chosen from measured costs and acceptance): {auto}.")
    return lines


def acceptance_rules(r: dict) -> list[str]:
    s = r["settings"]
    return [
        f"**Acceptance by rule, the same drafter** (`python -m bench.acceptance_rules`; "
        f"{s['drafter']}, T = {s['temperature']}, exact per position along the target's own "
        f"continuations, {r['positions']} positions, {s['dtype']}; "
        "[json](results/acceptance_rules.json), [plot](results/acceptance_rules.png)): the "
        "probability that a proposal is accepted under our min(1, p/q) and under token matching "
        "(mlx-vlm's and oMLX's DFlash rule at T > 0, which does not run here on the demo "
        "target)",
        "",
        "| min(1, p/q) | token match | ratio |",
        "| --- | --- | --- |",
        f"| {r['min_p_q']:.3f} | {r['token_match']:.3f} | {r['ratio']:.2f}x |",
    ]


def dflash_shapes(r: dict) -> list[str]:
    s = r["settings"]
    lines = [
        "**What a DFlash block costs on 4B shapes** (`python -m bench.dflash_shapes`; random "
        f"weights, {s['dtype']}, a {s['draft_layers']}-layer drafter, block {s['block_size']}, "
        f"after a {s['prompt']}-token prompt, median of {s['repeats']}; "
        "[json](results/dflash_shapes.json), [plot](results/dflash_shapes.png)). A model, not a "
        f"measurement of speed-up: {s['model']}.",
        "",
        "| target shape | t_1 (ms) | block forward / t_1 | t_v(16) / t_1 | speed-up at tau 3 / 5 "
        "/ 7 (modelled) | tau to break even |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in r["runs"]:
        p = run["predicted_speedup"]
        lines.append(f"| {run['shape']} | {run['t_1_ms']:.0f} | {run['block_over_step']:.2f} | "
                     f"{run['verify16_over_step']:.2f} | {p['3']:.2f}x / {p['5']:.2f}x / "
                     f"{p['7']:.2f}x | {run['break_even_tau']:.2f} |")
    return lines


def trees(r: dict) -> list[str]:
    s = r["settings"]
    lines = [
        f"**Candidate trees against chains** (`python -m bench.trees`; demo pair, {s['dtype']}, "
        f"{s['prompts']} held-out prompts x {s['max_tokens']} tokens, T = 0 and 0.7 (unseeded); "
        "[json](results/trees.json), [plot](results/trees.png)): tokens per target forward "
        "(tau) at N draft positions verified per round, a chain of k = N against a tree of "
        "budget N (DDTree's, 15 deep, for the block drafter; for the others their chain of "
        "max(2, N // 2) drafts and its likeliest siblings); every greedy output equal to plain "
        "decoding's",
        "",
        "| drafter | T | " + " | ".join(f"chain / tree, N = {n}" for n in s["positions"]) + " |",
        "| --- | --- | " + " | ".join("---" for _ in s["positions"]) + " |",
    ]
    for temperature, drafters in r["tau"].items():
        for name, shapes in drafters.items():
            cells = [f"{shapes['chain'][str(n)]['tau']:.2f} / {shapes['tree'][str(n)]['tau']:.2f}"
                     for n in s["positions"]]
            lines.append(f"| {name} | {temperature.split('=')[1]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"What a tree round's parts cost ({s['cost_settings']}; median of {s['repeats']}, ms, "
        "share of the whole round in brackets):",
        "",
        "| batch | round | tree verify | chain verify, same positions | tree / chain verify | "
        "grow trees | layout | compaction |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for batch, c in r["costs"].items():
        sh = c["shares"]
        lines.append(
            f"| {batch.split('=')[1]} | {c['round']:.1f} | {c['tree verify']:.1f} "
            f"({sh['tree verify']:.0%}) | {c['chain verify']:.1f} | "
            f"{c['tree / chain verify']:.2f}x | {c['grow trees']:.2f} ({sh['grow trees']:.0%}) "
            f"| {c['layout']:.2f} ({sh['layout']:.0%}) | {c['compaction']:.2f} "
            f"({sh['compaction']:.0%}) |")
    if "speed" in r:
        lines += [
            "",
            f"Tokens per second here (greedy, the same prompts, prefill included; each contender "
            f"its own process, medians of {s['speed_repeats']} interleaved runs):",
            "",
            "| contender | tok/s | vs plain | tau |",
            "| --- | --- | --- | --- |",
        ]
        lines += [f"| {name} | {v['tps']:.1f} | {v['vs_plain']:.2f}x | {v['tau']:.2f} |"
                  for name, v in r["speed"].items()]
    return lines


def tree_shapes(r: dict) -> list[str]:
    s = r["settings"]
    ns = [str(n) for n in s["ns"]]
    shapes = ", ".join(f"{run['shape']} {run['measured_layers']} of {run['layers']} layers"
                       for run in r["runs"])
    lines = [
        f"**A tree verify on Qwen3-4B and Qwen3.5-4B shapes** (`python -m bench.tree_shapes`; "
        f"random weights, {s['dtype']}, B = {s['batch']}, {shapes} measured and the rest "
        "extrapolated, a binary tree (depth log2 n); Qwen3.5's Gated DeltaNet layers run along "
        "each branch, depth by depth; [json](results/tree_shapes.json), "
        "[plot](results/tree_shapes.png)): t_v(n) / t_1 with the tree mask and causal",
        "",
        "| shape | verify | " + " | ".join(f"n = {n}" for n in ns) + " |",
        "| --- | --- | " + " | ".join("---" for _ in ns) + " |",
    ]
    for run in r["runs"]:
        t_v = run["t_v_ms"]
        t_1 = t_v["causal"]["1"]
        for kind in ("causal", "tree"):
            lines.append(f"| {run['shape']} | {kind} | "
                         + " | ".join(f"{t_v[kind][n] / t_1:.2f}" for n in ns) + " |")
    lines += ["", "The two verifies of each n run back to back; on this shared 2-core machine one "
                  "verify's repeated runs differ by up to 25% (at n = 1 both are one computation), "
                  "so ratios within that are level."]
    for run in r["runs"]:
        speed = run.get("model", {}).get("speedup")
        if speed:
            cells = ", ".join(f"N = {n}: chain {v['chain']:.2f}x (tau {v['tau_chain']:.2f}), "
                              f"tree {v['tree']:.2f}x (tau {v['tau_tree']:.2f})"
                              for n, v in speed.items())
            lines += ["", f"{run['shape']}, modelled, not measured (speed-up = tau t_1 / "
                          f"(t_block + t_v(N + 1)), t_block {run['model']['t_block_ms']:.0f} ms "
                          f"from dflash_shapes, tau the demo DFlash drafter's, greedy): {cells}."]
    lines += ["", "The demo drafter's tau is far below a published drafter's; the tree's gain "
                  "over the chain is the ratio to read."]
    return lines


def peers(r: dict) -> list[str]:
    s = r["settings"]
    lines = [
        f"**Ours, mlx-lm and mlx-vlm on hybrid and dense fixtures** (`python -m bench.peers`; "
        f"tiny random models in the hub's layouts (Qwen3.5 with its vision tower and MTP "
        f"tensors, Qwen3-Next, Qwen3), {s['dtype']}, {s['prompts']} prompts x {s['tokens']} "
        f"tokens, each contender a process of its own, median of {s['repeats']} interleaved "
        f"runs, mlx-vlm {s['mlx_vlm']} in its own environment, MKL for all; "
        "[json](results/peers.json), [plot](results/peers.png)): decode tokens/s, and the ratio "
        "to ours plain",
        "",
        "| fixture | contender | tok/s | vs ours | greedy == ours |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key, cell in r["cells"].items():
        for name, v in cell.items():
            same = {None: "", True: "yes", False: "**no**"}[v.get("same_as_ours")]
            lines.append(f"| {key} | {name} | {v['tok_s']:.0f} | {v['vs_ours']:.2f}x | {same} |")
    return lines


def vision(r: dict) -> list[str]:
    s = r["settings"]
    images = " and ".join(map(str, s["image_positions"]))
    tokens = " and ".join(map(str, s["prompt_tokens"]))
    lines = [
        f"**Prompts with an image: ours and mlx-vlm** (`python -m bench.vision`; a tiny random "
        f"Qwen3.5 vision-language checkpoint with its MTP layer, {s['dtype']}, {s['prompts']} "
        f"prompts of one image ({images} image positions of {tokens} tokens) x {s['tokens']} "
        f"tokens, each contender a process of its own, median of {s['repeats']} interleaved "
        f"runs, mlx-vlm {s['mlx_vlm']}, MKL for both; [json](results/vision.json), "
        "[plot](results/vision.png)): decode tokens/s and prefill seconds (mlx-vlm's prefill in "
        "both), with the ratios to ours plain",
        "",
        "| temperature | contender | tok/s | vs ours | prefill s | vs ours | greedy == ours |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, cell in r["cells"].items():
        for name, v in cell.items():
            same = {None: "", True: "yes", False: "**no**"}[v.get("same_as_ours")]
            lines.append(f"| {key} | {name} | {v['tok_s']:.0f} | {v['vs_ours']:.2f}x | "
                         f"{v['prefill_s']:.3f} | {v['prefill_vs_ours']:.2f}x | {same} |")
    return lines

"""results/README.md's sections for the heads that read the target: the demo target's trained
heads (results/train_heads.json) and every drafter side by side (results/drafters.json).
Called by render_readme.py."""

from __future__ import annotations


def train_heads(r: dict) -> list[str]:
    lines = [
        "**The demo target's heads** (`python -m training.train_heads`, the passes its json lists; "
        "trained on the target's own distributions, teacher-forced, over the demo's training "
        "text and the target's own greedy continuations of it: the MTP layer one step ahead, "
        "the EAGLE-3 head over 3 chained steps; "
        "[json](results/train_heads.json), [plot](results/train_heads.png)): top-1 agreement "
        "with the target, teacher-forced, on held-out stdlib code (from initialisation) and "
        "along the target's greedy text after 24 held-out code prompts (at the start of each pass "
        "that measured it, and at the end)",
        "",
        "| head | parameters (own) | passes: steps x batch x tokens | train time | stdlib code "
        "| target's greedy text |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, label in (("mtp", "MTP layer (demo/target/mtp.safetensors)"),
                        ("eagle3", "EAGLE-3, 2,048-token draft vocabulary (demo/eagle3/)")):
        if name not in r:
            continue
        h, s = r[name], r[name]["settings"]
        passes = h.get("passes") or [{"steps": s["steps"], "train_seconds": h["train_seconds"],
                                      "held_out_before": h["held_out_before"]}]
        steps = " + ".join(str(p["steps"]) for p in passes)
        seconds = sum(p["train_seconds"] for p in passes)
        trail = [p["held_out_before"].get("greedy_agreement") for p in passes] + [
            h["held_out_after"].get("greedy_agreement")]
        text = " -> ".join(f"{v:.2f}" for v in trail if v is not None) or "-"
        lines.append(f"| {label} | {h['parameters'] / 1e6:.2f}M | ({steps}) x {s['batch']} x "
                     f"{s['seq']} | {seconds / 60:.1f} min | "
                     f"{h['held_out_before']['top1_agreement']:.2f} -> "
                     f"{h['held_out_after']['top1_agreement']:.2f} | {text} |")
    if "draft_model" in r:  # the reference: the demo's draft model, measured the same way
        d = r["draft_model"]
        lines.append(f"| the 0.9M draft model (reference, not trained here) | - | - | - | "
                     f"{d['top1_agreement']:.2f} | {d['greedy_agreement']:.2f} |")
    return lines


def drafters(r: dict) -> list[str]:
    s, m = r["settings"], r["machine"]
    cells = [(t, b) for t in s["temperatures"] for b in s["batches"]]

    def label(t: float, b: int) -> str:
        return f"{'greedy' if t == 0 else f'T = {t}'}, B = {b}"

    lines = [
        f"**Every drafter on the demo target** (`python -m bench.drafters`; {s['dtype']}, "
        f"{s['max_tokens']} tokens per prompt, {s['prompts']}; T = 0.7 with top-p 0.8, top-k "
        f"20; one process per drafter and setting, median of {s['repeats']}; {m['device']}; "
        "greedy outputs equal plain decoding's: "
        f"{'yes' if r['greedy_outputs_equal_plain'] else 'NO'}; [json](results/drafters.json), "
        "[plot](results/drafters.png)): the best fixed k's tokens/s over plain decoding's, "
        "with its acceptance, mean accepted length per drafting round and tau (tokens per "
        "target forward)",
        "",
        "| drafter | " + " | ".join(label(t, b) for t, b in cells) + " |",
        "| --- |" + " --- |" * len(cells),
    ]
    for contender in s["contenders"]:
        row = []
        for t, b in cells:
            rows = [x for x in r["summary"] if x["contender"] == contender
                    and (x["temperature"], x["batch"]) == (t, b)]
            best = max(rows, key=lambda x: x["tps"])
            if contender == "none":
                row.append(f"1.00x ({best['tps']:.0f} tok/s)")
            else:
                tau = f", tau {best['tau']:.2f}" if best.get("tau") is not None else ""
                row.append(f"{best['vs_plain']:.2f}x (k = {best['k']}, {best['acceptance']:.2f}, "
                           f"{best['mean_accepted']:.2f}{tau})")
        lines.append(f"| {contender} | " + " | ".join(row) + " |")
    lines += ["", "Acceptance per draft position at k = 4, greedy (the same greedy text either "
              "way: B = 1 over the first 3 prompts, B = 8 over all 8):", "",
              "| drafter | B = 1: 1 | 2 | 3 | 4 | B = 8: 1 | 2 | 3 | 4 |",
              "| --- |" + " --- |" * 8]
    for contender in s["contenders"][1:]:
        per = []
        for batch in (1, 8):
            row = next(x for x in r["summary"] if x["contender"] == contender and x["k"] == 4
                       and (x["temperature"], x["batch"]) == (0.0, batch))
            per += [f"{p:.2f}" if p is not None else "-" for p in row["per_position"][:4]]
        lines.append(f"| {contender} | " + " | ".join(per) + " |")
    c = r["head_costs"]
    lines += ["", f"What a head's step costs beside the target's (random Qwen3.5-shaped target, "
              f"{c['target_layers']} layers of Qwen3.5-0.8B's shapes, vocabulary {c['vocab']}, "
              f"after a {c['prompt']}-token prompt, median of {c['repeats']}): target step "
              f"{c['target_ms']:.1f} ms, MTP layer step {c['mtp_ms']:.1f} ms "
              f"({c['mtp_vs_target']:.2f}x), EAGLE-3 step {c['eagle3_ms']:.1f} ms "
              f"({c['eagle3_vs_target']:.2f}x)."]
    return lines

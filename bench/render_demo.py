"""results/README.md's sections for the demo pair: its training (results/demo_training.json), its
chat/editing retrain (demo_retrain.json), its repair (demo_derepeat.json) and its acceptance on
held-out prompts (demo_quality.json). Called by render_readme.py."""

from __future__ import annotations


def derepeat(r: dict) -> list[str]:
    old, new, passes = r["old"], r["new"], r["passes"]
    first = passes[0]["settings"]
    minutes = sum(p["seconds"]["total"] for p in passes) / 60
    draft_steps = sum(p["settings"]["draft_steps"] for p in passes)
    lines = [
        f"**Demo pair repaired** ({len(passes)} runs of `python -m training.derepeat_demo`, "
        f"{minutes:.0f} min on 2 CPU threads in all: the target {first['target_steps']} steps of "
        f"its objective plus unlikelihood (token-level x {first['unlikelihood']}, sequence-level "
        f"on its own greedy text x {first['sequence_unlikelihood']}), the draft {draft_steps} "
        "steps distilled on the mixture and on the new target's greedy text; the commands in "
        "[json](results/demo_derepeat.json), [plot](results/demo_derepeat.png)); old pair -> new",
        "",
        "| measure | old | new |",
        "| --- | --- | --- |",
        f"| draft greedy acceptance, k = 4, 24 held-out code prompts x 64 tokens | "
        f"{old['greedy_acceptance_k4']:.2f} | {new['greedy_acceptance_k4']:.2f} |",
        f"| longest run of one token in greedy text (those prompts; README's prompts) | "
        f"{max(old['longest_runs'])}; {max(old['readme_longest_runs'])} | "
        f"{max(new['longest_runs'])}; {max(new['readme_longest_runs'])} |",
    ]
    for name in old["held_out_loss_nats"]:
        lines.append(f"| target held-out loss, {name} (nats) | "
                     f"{old['held_out_loss_nats'][name]:.3f} | "
                     f"{new['held_out_loss_nats'][name]:.3f} |")
    lines.append(f"| copy accuracy, held-out edits | {old['copy_accuracy']:.3f} | "
                 f"{new['copy_accuracy']:.3f} |")
    lines += ["", "Greedy text of the README's prompts, 48 tokens:", "",
              "| prompt | old | new |", "| --- | --- | --- |"]
    for prompt in new["samples"]:
        cells = [_cell(x["samples"][prompt]) for x in (old, new)]
        lines.append(f"| `{_cell(prompt)}` | {cells[0]} | {cells[1]} |")
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "⏎").replace("`", "'")[:160]


def training(r: dict) -> list[str]:
    loss = r["held_out_loss_nats"]
    p = r["parameters"]
    return [
        f"**Demo pair training** (`{r['command']}`, {r['seconds']['total'] / 60:.0f} min on "
        f"{r['machine']['threads']} CPU threads; [json](results/demo_training.json)): target "
        f"{p['target'] / 1e6:.2f}M parameters, held-out loss {loss['target']:.3f} nats; draft "
        f"{p['draft'] / 1e6:.2f}M, {loss['draft']:.3f} nats; uniform "
        f"{r['uniform_loss_nats']:.3f} nats.",
    ]


def retrain(r: dict) -> list[str]:
    old, new = r["old"], r["new"]
    lines = [
        f"**Demo pair retrained on code + chat + edits** (`{r['command']}`, "
        f"{r['seconds']['total'] / 60:.0f} min on {r['machine']['threads']} CPU threads; "
        f"{r['corpus']['chat_exchanges']} chat and {r['corpus']['editing_exchanges']} editing "
        "exchanges built from the training files; held-out sets from the held-out files; "
        "[json](results/demo_retrain.json), [plot](results/demo_retrain.png)); old pair -> new",
        "",
        "| held-out set | target loss (nats) | draft acceptance sum(min(p, q)), T = 1 | "
        "draft/target greedy agreement |",
        "| --- | --- | --- | --- |",
    ]
    for name in old["held_out_loss_nats"]:
        lines.append(
            f"| {name} | {old['held_out_loss_nats'][name]:.3f} -> "
            f"{new['held_out_loss_nats'][name]:.3f} | {old['acceptance_t1'][name]:.3f} -> "
            f"{new['acceptance_t1'][name]:.3f} | {old['greedy_agreement'][name]:.3f} -> "
            f"{new['greedy_agreement'][name]:.3f} |")
    lines += ["", f"Copy accuracy (the target's top-1 on the answer of held-out editing "
                  f"exchanges, teacher-forced): {old['copy_accuracy']:.3f} -> "
                  f"{new['copy_accuracy']:.3f}."]
    return lines


def quality(r: dict) -> list[str]:
    s = r["settings"]
    plain = r["plain"]["tokens_per_second"]
    lines = [
        f"**Demo pair, held-out prompts** (`python -m bench.demo_quality`; {s['prompts']} prompts "
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

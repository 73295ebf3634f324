"""results/README.md's section for the demo pair's repair (results/demo_derepeat.json). Called by
render_readme.py."""

from __future__ import annotations


def derepeat(r: dict) -> list[str]:
    old, new, passes = r["old"], r["new"], r["passes"]
    first = passes[0]["settings"]
    minutes = sum(p["seconds"]["total"] for p in passes) / 60
    draft_steps = sum(p["settings"]["draft_steps"] for p in passes)
    lines = [
        f"**Demo pair repaired** ({len(passes)} runs of `python bench/derepeat_demo.py`, "
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

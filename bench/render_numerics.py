"""results/README.md's section for the numerics contract: what the bit-for-bit mode costs and
buys (results/bitwise.json). Called by render_readme.py."""

from __future__ import annotations


def bitwise(r: dict) -> list[str]:
    s, m = r["settings"], r["machine"]
    lines = [
        f"**Bit-for-bit mode** (`python -m bench.bitwise`; demo pair, {s['dtype']}, greedy, "
        f"{s['max_tokens']} tokens after each of {s['prompts']} held-out prompts, one process "
        f"per contender, {m['device']}, BLAS {m['blas'].split(' (')[0]}; "
        "[json](results/bitwise.json), [plot](results/bitwise.png)): `bitwise=True` runs every "
        f"target forward at {s['rows']} positions. Against plain decoding in the same mode: "
        "prompts with equal tokens, and the largest log-probability difference at any position.",
        "",
        "| contender | default tok/s | bitwise tok/s | bitwise / default | equal tokens "
        "(default, bitwise) | max log-prob difference (default, bitwise) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in dict.fromkeys(x["contender"] for x in r["runs"]):
        d, b = (next(x for x in r["runs"] if x["contender"] == name and x["mode"] == mode)
                for mode in ("default", "bitwise"))
        diffs = [f"{x['max_logprob_difference_vs_plain']:.1e}"
                 if x["max_logprob_difference_vs_plain"] else "0" for x in (d, b)]
        lines.append(f"| {name} | {d['tps']:.0f} | {b['tps']:.0f} | {b['vs_default']:.2f}x | "
                     f"{d['prompts_equal_plain']}/{s['prompts']}, "
                     f"{b['prompts_equal_plain']}/{s['prompts']} | {diffs[0]}, {diffs[1]} |")
    return lines

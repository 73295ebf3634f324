"""Prompts with images: ours (mlx-vlm's prefill, our decode) against mlx-vlm's own generation, plain
and with the checkpoint's MTP layer, each contender in a process of its own.

    python -m bench.vision       # ~5 minutes on a 2-core machine; results/vision.json, .png

Fixture, built once with transformers into ~/.cache/tinydraft-mlx/peers/qwen3.5-vision (as
bench/peers.py's qwen3.5: random weights at 0.2, float32, hidden 128, 4 layers, 3 Gated DeltaNet
and 1 attention, an MTP layer under the hub's names): the Qwen vision tokens added to the demo
tokenizer, a one-block vision tower, images up to 448 x 448 pixels in 16-pixel patches merged
2 x 2 (196 image positions for a 448 x 448 image).

Prompts: PROMPTS chat messages, each one image (448 x 448 and 448 x 336 random pixels) and a line
of text. Contenders: ours plain, ours MTP k = 1 and "auto" (`stream_generate(images=...)`);
mlx-vlm plain and its MTP drafter at k = 1 (`generate_step` with the processor's inputs). Each
(temperature, contender) runs in a fresh process: load, one warm-up generation, then the prompts
x TOKENS tokens; prefill seconds = call to first token; decode tokens/s = the tokens over the time
from each prompt's first token to its last, summed. Order rotates over REPEATS rounds; medians
reported; every greedy output must equal ours plain.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.peers import CACHE, ROOT, _add_mtp, _rates, _text_config

FIXTURE = CACHE / "qwen3.5-vision"
TEMPERATURES = (0.0, 0.7)
PROMPTS, TOKENS, REPEATS = 2, 384, 3
CONTENDERS = ("ours", "ours-mtp-1", "ours-mtp-auto", "mlx-vlm", "mlx-vlm-mtp-1")
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}"
    "{{ p['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = "Describe the picture, then write a function that parses it:"


def build() -> Path:
    """The fixture's directory (built on first use)."""
    if (FIXTURE / "done").exists():
        return FIXTURE
    import torch
    import transformers as tf

    shutil.rmtree(FIXTURE, ignore_errors=True)
    tok = tf.AutoTokenizer.from_pretrained(ROOT / "tinydraft_mlx" / "demo" / "target")
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = TEMPLATE
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    text = {**_text_config("qwen3.5"), "vocab_size": 4104}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=128, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    torch.manual_seed(0)
    model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
        video_token_id=ids[3]))
    model.eval().save_pretrained(FIXTURE)
    config = json.loads((FIXTURE / "config.json").read_text())
    config["text_config"]["full_attention_interval"] = 4  # as the hub's configs carry it
    (FIXTURE / "config.json").write_text(json.dumps(config, indent=1))
    tok.save_pretrained(FIXTURE)
    (FIXTURE / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
        "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 32 * 32,
        "max_pixels": 448 * 448, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    _add_mtp(FIXTURE)
    (FIXTURE / "done").write_text("")
    return FIXTURE


def _pictures() -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (h, 448, 3), dtype=np.uint8))
            for h in (448, 336)][:PROMPTS]


MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]


def _image_positions() -> list[tuple[int, int]]:
    """(image positions, prompt tokens) of each prompt, as the fixture's processor makes them."""
    import mlx_vlm.models.qwen3_5  # noqa: F401  (registers the processor)
    import numpy as np
    from mlx_vlm.utils import load_processor, prepare_inputs

    processor = load_processor(FIXTURE)
    text = processor.tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                   add_generation_prompt=True)
    out = []
    for picture in _pictures():
        ids = np.array(prepare_inputs(processor, images=[picture], prompts=[text])["input_ids"][0])
        out.append((int((ids == processor.image_token_id).sum()), len(ids)))
    return out


def _ours(contender: str, temperature: float) -> dict:
    from bench.common import machine  # noqa: I001  (before mlx.core: the BLAS preload)
    from tinydraft_mlx import load_models, stream_generate

    mtp = contender.startswith("ours-mtp")
    target, head, tok = load_models(str(FIXTURE), "mtp" if mtp else "none")
    k = contender.rsplit("-", 1)[1] if mtp else 1
    k = k if k == "auto" else int(k)

    def run(picture, n):
        out = stream_generate(target, head if mtp else None, tok, MESSAGES, images=[picture],
                              k=k, max_tokens=n, temperature=temperature)
        return ((r.token, r.from_draft) for r in out)

    return _measure(run, machine())


def _mlx_vlm(contender: str, temperature: float) -> dict:
    import mlx.core as mx
    import mlx_vlm
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load_model, load_processor, prepare_inputs

    mx.set_default_device(mx.cpu)
    model = load_model(FIXTURE)
    processor = load_processor(FIXTURE)
    kw: dict = {}
    if contender.startswith("mlx-vlm-mtp"):
        from mlx_vlm.speculative.drafters import load_drafter

        drafter, kind = load_drafter(str(FIXTURE), "mtp")
        k = int(contender.rsplit("-", 1)[1])
        kw = dict(draft_model=drafter, draft_kind=kind, draft_block_size=k + 1)
    text = processor.tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                   add_generation_prompt=True)

    def run(picture, n):
        inputs = prepare_inputs(processor, images=[picture], prompts=[text])
        extra = {k: v for k, v in inputs.items()
                 if k not in ("input_ids", "pixel_values", "attention_mask")}
        for token, _ in generate_step(inputs["input_ids"], model, inputs["pixel_values"],
                                      inputs["attention_mask"], max_tokens=n,
                                      temperature=temperature, **extra, **kw):
            yield int(token), False

    return _measure(run, {"mlx": mx.__version__, "mlx_vlm": mlx_vlm.__version__,
                          "blas": os.environ.get("LD_PRELOAD", "reference")})


def _measure(run, machine: dict) -> dict:
    pictures = _pictures()
    list(run(pictures[0], 16))  # warm-up
    rate, outs, extra = _rates(run(picture, TOKENS) for picture in pictures)
    return {"rate": rate, "outs": outs, **extra, "machine": machine}


def worker(contender: str, temperature: float) -> dict:
    if contender.startswith("mlx-vlm"):
        return _mlx_vlm(contender, temperature)
    return _ours(contender, temperature)


def _run(contender: str, temperature: float) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), TINYDRAFT_POLICY_FILE="off")
    if contender.startswith("mlx-vlm"):
        from tinydraft_mlx.engine.backend import MKL_THREADS, mkl_candidates

        env["LD_PRELOAD"] = mkl_candidates()[0]  # the BLAS ours runs on
        env.setdefault("MKL_NUM_THREADS", MKL_THREADS)
    done = subprocess.run([sys.executable, "-m", "bench.vision", "--worker", contender,
                           str(temperature)], env=env, cwd=ROOT, check=True,
                          capture_output=True, text=True, timeout=900)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    import mlx_vlm

    from bench.common import machine, save

    start = time.time()
    build()
    runs: dict = {}
    last: dict = {}
    for repeat in range(REPEATS):
        for temperature in TEMPERATURES:
            names = CONTENDERS[repeat % len(CONTENDERS):] + CONTENDERS[: repeat % len(CONTENDERS)]
            for name in names:
                out = _run(name, temperature)
                key = f"T={temperature}"
                runs.setdefault(key, {}).setdefault(name, []).append(
                    (round(out["rate"], 1), round(out["prefill_s"], 4)))
                last.setdefault(key, {})[name] = out
                print(key, name, round(out["rate"], 1), round(out["prefill_s"], 3), flush=True)
    report = {"machine": machine(), "settings": {
        "prompts": PROMPTS, "tokens": TOKENS, "repeats": REPEATS, "dtype": "float32",
        "mlx_vlm": mlx_vlm.__version__,
        "image_positions": [n for n, _ in _image_positions()],
        "prompt_tokens": [n for _, n in _image_positions()],
        "seconds": round(time.time() - start)}, "cells": {}}
    for key, by_name in runs.items():
        plain = last[key]["ours"]["outs"]
        cell = {}
        for name, values in by_name.items():
            seen = last[key][name]
            cell[name] = {"tok_s": statistics.median(v[0] for v in values),
                          "prefill_s": statistics.median(v[1] for v in values),
                          "runs": values, "from_draft": seen["from_draft"],
                          "same_as_ours": seen["outs"] == plain if key == "T=0.0" else None}
            if name.startswith("mlx-vlm"):
                cell[name]["machine"] = seen["machine"]
        base = cell["ours"]
        for v in cell.values():
            v["vs_ours"] = round(v["tok_s"] / base["tok_s"], 3)
            v["prefill_vs_ours"] = round(v["prefill_s"] / base["prefill_s"], 3)
        report["cells"][key] = cell
    print(save(report, "vision", plot))


def plot(report: dict, path: Path) -> None:
    from bench.common import finish_figure, pyplot

    plt = pyplot()
    cells = report["cells"]
    fig, axes = plt.subplots(1, 2 * len(cells), figsize=(3.4 * 2 * len(cells), 4.2))
    for i, (key, cell) in enumerate(cells.items()):
        names = list(cell)
        colours = ["C0" if n.startswith("ours") else "C2" for n in names]
        for ax, field, label in ((axes[2 * i], "tok_s", "decode tokens/s"),
                                 (axes[2 * i + 1], "prefill_s", "prefill seconds")):
            ax.bar(range(len(names)), [cell[n][field] for n in names], color=colours)
            ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{key}: {label} (median)", fontsize=9)
    finish_figure(plt, fig, path, report, "Prompts with an image: ours and mlx-vlm",
                  "each contender a process of its own; tiny random Qwen3.5, CPU", 9)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker(sys.argv[2], float(sys.argv[3]))))
    else:
        sys.exit(main())

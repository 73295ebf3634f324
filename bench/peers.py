"""Ours against mlx-lm and mlx-vlm on hybrid and dense targets: plain decoding and MTP drafting,
greedy and sampled, each contender in a process of its own.

    python -m bench.peers        # ~15 minutes on a 2-core machine; results/peers.json, .png

Fixtures, built once with transformers into ~/.cache/tinydraft-mlx/peers (random weights,
initializer range 0.2, float32, the demo target's tokenizer of 4,096 ids, hidden 128, 4 layers):
- qwen3.5: Qwen3.5 as the hub ships it (`Qwen3_5ForConditionalGeneration`: the text model under
  `text_config` with multimodal rope parameters, a one-block vision tower): 3 Gated DeltaNet
  layers and 1 attention layer, and an MTP layer under the hub's names (`mtp.*` inside
  model.safetensors) that agrees with the target part of the time: a copy of the attention layer
  with 1% noise, the target's other layers' writes to the residual stream zeroed (their work
  still runs: a zero weight is multiplied like any other);
- qwen3-next: Qwen3-Next (Gated DeltaNet, gated attention, MoE MLPs) of the same size;
- qwen3: dense Qwen3 of the same size.

Contenders: ours (`speculative.decode`, the token loop `generate` runs), mlx-lm's
`generate_step`, mlx-vlm's `generate_step` (in an environment of its own, bench/.peers/vlm,
which the script makes when absent; the same MKL preloaded as ours), plain at T = 0 and 0.7; on
qwen3.5 ours with the MTP layer at k = 1, 3 and "auto", and mlx-vlm's own MTP drafter (its
`load_drafter` of the same tensors; block size k + 1) at k = 1 and 3. Each (fixture,
temperature, contender) runs in a fresh process (k="auto" learning in it alone: no policy
file): load, one warm-up generation, then PROMPTS prompts x TOKENS tokens; decode
tokens/s = the tokens over the time from each prompt's first token to its last, summed. The
contenders' order rotates over REPEATS rounds; the medians are reported, and every greedy
output must equal ours plain (the same model, read by three libraries).
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

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "tinydraft-mlx" / "peers"
VLM_ENV = ROOT / "bench" / ".peers" / "vlm"
VLM_VERSION = "0.7.10"
FIXTURES = ("qwen3.5", "qwen3-next", "qwen3")
TEMPERATURES = (0.0, 0.7)
PROMPTS, TOKENS, REPEATS = 4, 256, 3
PLAIN = ("ours", "mlx-lm", "mlx-vlm")
MTP = ("ours-mtp-1", "ours-mtp-3", "ours-mtp-auto", "mlx-vlm-mtp-1", "mlx-vlm-mtp-3")
# the MTP fixture (module docstring); damped x0.01 the other layers' writes still move the
# attention layer's input enough that the head agrees on 0 of 63 drafts (x0: 24 of 40, k = 1)
DAMP, NOISE, MIX = 0.0, 0.01, 0.02


# -- fixtures ----------------------------------------------------------------------------------
def _text_config(kind: str) -> dict:
    common = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=4096, tie_word_embeddings=False,
                  initializer_range=0.2)
    if kind == "qwen3":
        return common
    gdn = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
               linear_value_head_dim=32, full_attention_interval=4)
    if kind == "qwen3-next":
        return {**common, **gdn, "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}
    return {**common, **gdn, "rope_parameters": {
        "rope_type": "default", "type": "default", "rope_theta": 1e7,
        "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1], "mrope_interleaved": True}}


def build(kind: str) -> Path:
    """The fixture's directory (built on first use)."""
    out = CACHE / kind
    if (out / "done").exists():
        return out
    import torch
    import transformers as tf

    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(0)
    text = _text_config(kind)
    if kind == "qwen3.5":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=128, patch_size=16, spatial_merge_size=2,
                      temporal_patch_size=2, in_channels=3)
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(
            text_config=text, vision_config=vision, tie_word_embeddings=False))
    elif kind == "qwen3-next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**text))
    else:
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**text))
    model.eval().save_pretrained(out)
    if kind != "qwen3.5":  # the top-level keys the hub's configs carry (transformers 5 nests
        config = json.loads((out / "config.json").read_text())  # them in rope_parameters)
        rope = config.get("rope_parameters") or {}
        config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        if kind == "qwen3-next":
            config.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
        (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "tinydraft_mlx" / "demo" / "target" / name, out / name)
    if kind == "qwen3.5":
        _add_mtp(out)
    (out / "done").write_text("")
    return out


def _add_mtp(directory: Path) -> None:
    """The MTP layer under the hub's names, inside model.safetensors (module docstring): the
    attention layer copied with NOISE, fc = [I | MIX I], the other layers' writes x DAMP."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    path = directory / "model.safetensors"
    weights = load_file(str(path))
    body = "model.language_model."
    attention = 3  # full_attention_interval 4: layers 0-2 Gated DeltaNet, 3 attention
    for name in list(weights):
        layer = name[len(body + "layers."):].split(".")[0] if name.startswith(
            body + "layers.") else None
        if layer is not None and int(layer) != attention and name.endswith(
                ("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * DAMP
    rng = np.random.default_rng(0)

    def noisy(v):
        return (v * (1 + NOISE * rng.standard_normal(v.shape))).astype(v.dtype)

    prefix = f"{body}layers.{attention}."
    size = 128
    embed = weights[body + "embed_tokens.weight"]
    rms = float(np.sqrt(np.mean(embed ** 2)))
    mtp = {f"mtp.layers.0.{k[len(prefix):]}": noisy(v) for k, v in weights.items()
           if k.startswith(prefix)}
    mtp["mtp.fc.weight"] = noisy(np.concatenate([np.eye(size), MIX * np.eye(size)],
                                                axis=1).astype(np.float32))
    # Qwen3.5's norms store (scale - 1)
    mtp["mtp.pre_fc_norm_embedding.weight"] = np.full(size, rms - 1.0, np.float32)
    mtp["mtp.pre_fc_norm_hidden.weight"] = np.zeros(size, np.float32)
    mtp["mtp.norm.weight"] = noisy(weights[body + "norm.weight"])
    save_file({**weights, **mtp}, str(path), metadata={"format": "pt"})


def vlm_python() -> Path:
    """mlx-vlm's environment's python (made when absent: mlx-vlm is not our dependency)."""
    python = VLM_ENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VLM_ENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"mlx-vlm=={VLM_VERSION}",
                        "mlx[cpu]"], check=True)
    return python


# -- workers (one contender, one fixture, one temperature) ----------------------------------
def _rates(runs) -> tuple[float, list[list[int]], dict]:
    """Decode tokens/s over `runs` (per prompt: an iterator of (token, drafted) pairs), their
    tokens, drafted-token counts and the mean prefill seconds (from the iterator's first request
    to its first token)."""
    tokens, seconds, outs, drafted, prefill = 0, 0.0, [], 0, 0.0
    for run in runs:
        begin, stamps, ids = time.perf_counter(), [], []
        for token, from_draft in run:
            stamps.append(time.perf_counter())
            ids.append(int(token))
            drafted += bool(from_draft)
        tokens, seconds = tokens + len(ids) - 1, seconds + stamps[-1] - stamps[0]
        prefill += stamps[0] - begin
        outs.append(ids)
    return tokens / seconds, outs, {"from_draft": drafted, "prefill_s": prefill / len(outs)}


def _ours(directory: Path, contender: str, temperature: float, prompts: list) -> dict:
    from bench.common import machine  # noqa: I001  (before mlx.core: the BLAS preload)
    from tinydraft_mlx import SamplingParams, load_models
    from tinydraft_mlx.engine.speculative import decode

    mtp = contender.startswith("ours-mtp")
    target, head, _ = load_models(str(directory), "mtp" if mtp else "none")
    k = contender.rsplit("-", 1)[1] if mtp else 1
    k = k if k == "auto" else int(k)

    def run(ids, n):
        sampling = SamplingParams(temperature) if temperature else SamplingParams()
        return ((t.id, t.from_draft) for t in decode(target, head if mtp else None, ids, k=k,
                                                      max_tokens=n, sampling=sampling))

    list(run(prompts[0], 16))
    rate, outs, extra = _rates(run(ids, TOKENS) for ids in prompts)
    return {"rate": rate, "outs": outs, **extra, "machine": machine()}


def _mlx_lm(directory: Path, temperature: float, prompts: list) -> dict:
    from bench.common import machine  # noqa: I001  (before mlx.core: the BLAS preload)
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model, _ = load(str(directory))
    sampler = make_sampler(temperature)

    def run(ids, n):
        return ((t, False) for t, _ in generate_step(mx.array(ids), model, max_tokens=n,
                                                      sampler=sampler))

    list(run(prompts[0], 16))
    rate, outs, extra = _rates(run(ids, TOKENS) for ids in prompts)
    return {"rate": rate, "outs": outs, **extra, "machine": machine()}


def _mlx_vlm(directory: Path, contender: str, temperature: float, prompts: list) -> dict:
    import mlx.core as mx
    import mlx_vlm
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load_model

    mx.set_default_device(mx.cpu)
    model = load_model(directory)
    kw: dict = {}
    if contender.startswith("mlx-vlm-mtp"):
        from mlx_vlm.speculative.drafters import load_drafter

        drafter, kind = load_drafter(str(directory), "mtp")  # the checkpoint's own tensors
        k = int(contender.rsplit("-", 1)[1])
        kw = dict(draft_model=drafter, draft_kind=kind, draft_block_size=k + 1)

    def run(ids, n):
        for token, _ in generate_step(mx.array([ids]), model, None, None, max_tokens=n,
                                      temperature=temperature, **kw):
            yield int(token), False

    list(run(prompts[0], 16))
    rate, outs, extra = _rates(run(ids, TOKENS) for ids in prompts)
    return {"rate": rate, "outs": outs, **extra,
            "machine": {"mlx": mx.__version__, "mlx_vlm": mlx_vlm.__version__,
                        "blas": os.environ.get("LD_PRELOAD", "reference")}}


def worker(contender: str, kind: str, temperature: float, prompts_file: str) -> dict:
    prompts = json.loads(Path(prompts_file).read_text())
    directory = CACHE / kind
    if contender.startswith("mlx-vlm"):
        return _mlx_vlm(directory, contender, temperature, prompts)
    if contender == "mlx-lm":
        return _mlx_lm(directory, temperature, prompts)
    return _ours(directory, contender, temperature, prompts)


def _run(contender: str, kind: str, temperature: float, prompts_file: Path) -> dict:
    # k="auto" learns in the process alone (no policy file from earlier runs)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), TINYDRAFT_POLICY_FILE="off")
    python = sys.executable
    if contender.startswith("mlx-vlm"):
        from tinydraft_mlx.engine.backend import MKL_THREADS, mkl_candidates

        python = str(vlm_python())
        env["LD_PRELOAD"] = mkl_candidates()[0]  # the BLAS ours runs on
        env.setdefault("MKL_NUM_THREADS", MKL_THREADS)
    done = subprocess.run([python, "-m", "bench.peers", "--worker", contender, kind,
                           str(temperature), str(prompts_file)], env=env, cwd=ROOT, check=True,
                          capture_output=True, text=True, timeout=900)
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the race ----------------------------------------------------------------------------------
def contenders(kind: str) -> tuple[str, ...]:
    return PLAIN + MTP if kind == "qwen3.5" else PLAIN


def main() -> None:
    from bench.common import machine, save
    from bench.demo_quality import held_out_prompts
    from tinydraft_mlx import load_models

    start = time.time()
    for kind in FIXTURES:
        build(kind)
    vlm_python()
    _, _, tok = load_models(str(CACHE / FIXTURES[0]), "none")
    prompts = [tok.encode(p) for p in held_out_prompts(PROMPTS, seed=0)]
    prompts_file = CACHE / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    rates: dict = {}
    extras: dict = {}
    for repeat in range(REPEATS):
        for kind in FIXTURES:
            for temperature in TEMPERATURES:
                names = contenders(kind)
                names = names[repeat % len(names):] + names[: repeat % len(names)]
                for name in names:
                    out = _run(name, kind, temperature, prompts_file)
                    key = f"{kind} T={temperature}"
                    rates.setdefault(key, {}).setdefault(name, []).append(round(out["rate"], 1))
                    extras.setdefault(key, {})[name] = {
                        "from_draft": out["from_draft"], "outs": out["outs"],
                        "machine": out["machine"]}
                    print(key, name, round(out["rate"], 1), flush=True)
    report = {"machine": machine(), "settings": {
        "fixtures": list(FIXTURES), "temperatures": list(TEMPERATURES), "prompts": PROMPTS,
        "tokens": TOKENS, "repeats": REPEATS, "dtype": "float32", "mlx_vlm": VLM_VERSION,
        "seconds": round(time.time() - start)}, "cells": {}}
    for key, by_name in rates.items():
        cell = {}
        plain = extras[key]["ours"]["outs"]
        for name, values in by_name.items():
            seen = extras[key][name]
            cell[name] = {"tok_s": statistics.median(values), "runs": values,
                          "from_draft": seen["from_draft"],
                          "same_as_ours": seen["outs"] == plain if key.endswith("=0.0")
                          else None}
            if name.startswith("mlx-vlm"):
                cell[name]["machine"] = seen["machine"]
        base = cell["ours"]["tok_s"]
        for name in cell:
            cell[name]["vs_ours"] = round(cell[name]["tok_s"] / base, 3)
        report["cells"][key] = cell
    print(save(report, "peers", plot))


def plot(report: dict, path: Path) -> None:
    from bench.common import finish_figure, pyplot

    plt = pyplot()
    cells = report["cells"]
    fig, axes = plt.subplots(1, len(cells), figsize=(3.2 * len(cells), 4.2), sharey=False)
    for ax, (key, cell) in zip(axes, cells.items()):
        names = list(cell)
        ax.bar(range(len(names)), [cell[n]["tok_s"] for n in names],
               color=["C0" if n.startswith("ours") else "C1" if n.startswith("mlx-lm")
                      else "C2" for n in names])
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
        ax.set_title(key, fontsize=9)
    axes[0].set_ylabel("decode tokens/s (median)")
    finish_figure(plt, fig, path, report, "Ours, mlx-lm and mlx-vlm on hybrid and dense fixtures",
                  "each contender a process of its own; tiny random models, float32, CPU", 9)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5])))
    else:
        sys.exit(main())

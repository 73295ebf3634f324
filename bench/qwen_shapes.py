"""Random-weight checkpoints with the real Qwen2.5 shapes, for measuring costs (t_d, t_1, t_v(n))
where the real weights cannot be downloaded.

    python -m bench.qwen_shapes 0.5B 1.5B 3B    # writes ~/.cache/tinydraft-mlx/shapes/<size>/
    python -m bench.qwen_shapes 250M 40M         # a small pair for bench/auto.py

Weights are float32 N(0, 0.02), written one tensor at a time (a 3B model is 12 GB), with the
bundled demo tokenizer so any two shapes form a valid target/draft pair. Outputs stay outside git.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

DEMO_TOKENIZER = Path(__file__).resolve().parents[1] / "tinydraft_mlx" / "demo" / "target"
CACHE = Path(os.environ.get("TINYDRAFT_SHAPES")
             or Path.home() / ".cache" / "tinydraft-mlx" / "shapes")

# hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings (the published configs)
SHAPES = {
    "0.5B": (896, 24, 14, 2, 4864, 151936, True),
    "1.5B": (1536, 28, 12, 2, 8960, 151936, True),
    "3B": (2048, 36, 16, 2, 11008, 151936, True),
    "7B": (3584, 28, 28, 4, 18944, 152064, False),
    # not published: a 250M-parameter target (0.5B's layers, 8 of them) and a 40M draft, a
    # Qwen2-shaped pair this CPU decodes fast enough for k="auto"'s benchmarks (bench/auto.py)
    "250M": (896, 8, 14, 2, 4864, 151936, True),
    "40M": (256, 2, 4, 2, 1024, 151936, True),
}


def config(size: str) -> dict:
    hidden, layers, heads, kv, inter, vocab, tied = SHAPES[size]
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "intermediate_size": inter, "vocab_size": vocab, "tie_word_embeddings": tied,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
        "hidden_act": "silu", "torch_dtype": "float32",
    }


def layer_tensors(cfg: dict, i: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head
    shapes = {
        "self_attn.q_proj.weight": (h, h), "self_attn.q_proj.bias": (h,),
        "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    out = {f"model.layers.{i}.{k}": rng.normal(0, 0.02, s).astype(np.float32)
           for k, s in shapes.items()}
    out[f"model.layers.{i}.input_layernorm.weight"] = np.ones(h, np.float32)
    out[f"model.layers.{i}.post_attention_layernorm.weight"] = np.ones(h, np.float32)
    return out


def write(size: str, seed: int = 0) -> Path:
    directory = CACHE / size
    if (directory / "model.safetensors.index.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    cfg = config(size)
    rng = np.random.default_rng(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    weight_map = {}

    def shard(name: str, tensors: dict) -> None:
        save_file(tensors, str(directory / name))
        weight_map.update({k: name for k in tensors})

    head = {"model.embed_tokens.weight": rng.normal(0, 0.02, (vocab, h)).astype(np.float32),
            "model.norm.weight": np.ones(h, np.float32)}
    if not cfg["tie_word_embeddings"]:
        head["lm_head.weight"] = rng.normal(0, 0.02, (vocab, h)).astype(np.float32)
    shard("model-embed.safetensors", head)
    for i in range(cfg["num_hidden_layers"]):
        shard(f"model-layer{i:02d}.safetensors", layer_tensors(cfg, i, rng))
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in DEMO_TOKENIZER.glob("tokenizer*.json"):
        shutil.copy(f, directory / f.name)
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", nargs="+", choices=sorted(SHAPES))
    for size in ap.parse_args().sizes:
        print(write(size))


if __name__ == "__main__":
    main()

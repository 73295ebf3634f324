"""Checkpoints rewritten in the layouts the hub ships them in (tests/fixtures.py builds them in
transformers' own)."""

from __future__ import annotations

from pathlib import Path


def nest_as_hub(target_dir: Path, hub: Path, family: str, interval: bool = True) -> Path:
    """The flat Qwen3.5 checkpoint in `target_dir` copied to `hub` in the hub's (vision-language)
    layout: the text model's config under `text_config` (model_type "<family>_text";
    `full_attention_interval` where `interval`, else only `layer_types`), the body's tensors
    under `model.language_model.`."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(target_dir, hub)
    text = json.loads((hub / "config.json").read_text())
    text["model_type"] = f"{family}_text"
    if interval:
        text["full_attention_interval"] = text["layer_types"].index("full_attention") + 1
    nested = {"model_type": family, "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": text, "tie_word_embeddings": text.get("tie_word_embeddings", False),
              "vision_config": {"depth": 1, "hidden_size": 16}}
    (hub / "config.json").write_text(json.dumps(nested))
    weights = load_file(str(hub / "model.safetensors"))
    save_file({("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in weights.items()}, str(hub / "model.safetensors"))
    return hub

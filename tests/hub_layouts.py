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


def _with_tower(cls: type, config, tower: str, out: Path) -> dict:
    """`cls(config)` (a transformers model, built with seed 0) with its vision tower's matrices
    drawn at 0.2, saved to `out`; its tensors as saved."""
    import torch
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for p in getattr(model.model, tower).parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.2)
    model.eval().save_pretrained(out)
    return load_file(str(out / "model.safetensors"))


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# renders {"type": "image"} parts as Qwen's templates do
VISION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_vision(root: Path, target_dir: Path, draft_dir: Path, mtp: dict) -> tuple[Path, Path]:
    """A Qwen3.5 vision-language checkpoint in the hub's layout (root/vision/target) whose
    language model is the flat Qwen3.5 text checkpoint in `target_dir` (its MTP tensors `mtp`,
    hub-named, beside them), with a one-block vision tower (initialised at 0.2, so that images
    change the output), the Qwen vision tokens added to the tokenizer (their rows of the LM head
    zeroed), a chat template rendering
    image parts, and an image processor config (16-pixel patches merged 2 x 2, at most 64 x 64
    pixels); and root/vision/draft: the text draft in `draft_dir` widened to the target's
    vocabulary (its embeddings and head padded with the target's rows), so that it can read the
    image tokens."""
    import json
    import shutil

    import numpy as np
    import transformers as tf
    from safetensors.numpy import load_file, save_file

    out, draft_out = root / "vision" / "target", root / "vision" / "draft"
    tokenizer = tf.AutoTokenizer.from_pretrained(target_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VISION_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = json.loads((target_dir / "config.json").read_text())
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                               "mrope_interleaved": True}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=text["hidden_size"], patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3, num_position_embeddings=64,
                  initializer_range=0.2)
    config = tf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False,
                              vision_start_token_id=ids[0], vision_end_token_id=ids[1],
                              image_token_id=ids[2], video_token_id=ids[3])
    weights = _with_tower(tf.Qwen3_5ForConditionalGeneration, config, "visual", out)
    for name, value in load_file(str(target_dir / "model.safetensors")).items():
        hub = "model.language_model." + name[len("model."):] if name.startswith("model.") \
            else name
        assert hub in weights and weights[hub].shape == value.shape, name
        weights[hub] = value
    weights.update(mtp)
    head = weights["lm_head.weight"].copy()
    head[ids] = 0.0  # the vision tokens are read, never written
    weights["lm_head.weight"] = head
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    written = json.loads((out / "config.json").read_text())
    written["text_config"]["full_attention_interval"] = text["layer_types"].index(
        "full_attention") + 1  # as the hub's configs carry it
    (out / "config.json").write_text(json.dumps(written, indent=1))
    tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
        "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 32 * 32,
        "max_pixels": 64 * 64, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    shutil.copytree(draft_dir, draft_out)
    tokenizer.save_pretrained(draft_out)
    width = text["vocab_size"]
    draft = load_file(str(draft_out / "model.safetensors"))
    target = load_file(str(target_dir / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = draft[name].shape[0]
        draft[name] = np.concatenate([draft[name], target[name][rows:width]])
    save_file(draft, str(draft_out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((draft_out / "config.json").read_text())
    config["vocab_size"] = width
    (draft_out / "config.json").write_text(json.dumps(config, indent=1))
    return out, draft_out


GEMMA_VISION_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def build_gemma_vision(root: Path, target_dir: Path) -> Path:
    """A Gemma 3 vision-language checkpoint in the hub's layout (root/gemma_vision) whose
    language model is the Gemma 3 text checkpoint in `target_dir` (its sliding window widened
    to 128 so that a prompt with an image fits it), with a one-layer SigLIP tower (32 x 32
    pixels in 8-pixel patches, pooled to 4 image tokens; initialised at 0.2), the image tokens
    added to the tokenizer (`boi_token` etc., as the hub's tokenizer config names them), the
    hub's top-level keys in the text config (rope_theta, rope_local_base_freq,
    sliding_window_pattern, mm_tokens_per_image; vocab_size at the top, where mlx-lm reads it)
    and a Gemma 3 image processor config."""
    import json

    import transformers as tf
    from safetensors.numpy import load_file, save_file

    out = root / "gemma_vision"
    tokenizer = tf.AutoTokenizer.from_pretrained(target_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA_VISION_TOKENS})
    tokenizer.chat_template = GEMMA_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(GEMMA_VISION_TOKENS)
    text = json.loads((target_dir / "config.json").read_text())
    text["sliding_window"] = 128
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8, vision_use_head=False)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                             boi_token_index=ids[0], eoi_token_index=ids[1],
                             image_token_index=ids[2], tie_word_embeddings=False)
    weights = _with_tower(tf.Gemma3ForConditionalGeneration, config, "vision_tower", out)
    for name, value in load_file(str(target_dir / "model.safetensors")).items():
        weights["language_model." + name] = value
    tower = "vision_tower."  # the hub's checkpoints nest SigLIP under vision_model
    weights = {(tower + "vision_model." + k[len(tower):] if k.startswith(tower) else k): v
               for k, v in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    written = json.loads((out / "config.json").read_text())
    written["vocab_size"] = text["vocab_size"]
    written["text_config"].update(mm_tokens_per_image=4, rope_theta=1e6,
                                  rope_local_base_freq=1000.0, sliding_window_pattern=6,
                                  tie_word_embeddings=False)
    written["text_config"]["rope_parameters"]["full_attention"]["rope_theta"] = 1e6
    (out / "config.json").write_text(json.dumps(written, indent=1))
    tokenizer.save_pretrained(out)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["extra_special_tokens"] = dict(zip(
        ("boi_token", "eoi_token", "image_token"), GEMMA_VISION_TOKENS))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": 32, "width": 32}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "do_pan_and_scan": False, "do_resize": True, "do_rescale": True, "do_normalize": True,
        "resample": 2, "rescale_factor": 1 / 255}))
    (out / "processor_config.json").write_text(json.dumps({
        "image_seq_length": 4, "processor_class": "Gemma3Processor"}))
    return out

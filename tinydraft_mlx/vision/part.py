"""A vision-language checkpoint's vision side, loaded by mlx-vlm beside the mlx-lm target.

mlx-lm loads a vision-language checkpoint's language model alone (it drops the vision tower's
tensors); mlx-vlm loads all of it. `load_vision` loads mlx-vlm's model lazily and points its
language model's parameters at the target's arrays wherever the two agree (same name, or a
tied target's embeddings for mlx-vlm's LM head; same shape), provided every one-dimensional
tensor shared is equal after the cast to the target's dtype (the norms, which each library's
loader may store shifted): the language model's weights are held once and mlx-vlm's prefill
runs the very weights the target decodes with. Where a norm disagrees nothing is shared, and an
array without a counterpart stays mlx-vlm's own (more memory, the same outputs).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

EXTRA = "pip install 'tinydraft-mlx[vision]'"
_ATTR = "_tinydraft_vision"


class VisionError(ValueError):
    """A vision-language request this target or installation cannot serve (one sentence)."""


@dataclass
class Vision:
    """The vision side of a target: mlx-vlm's model of its checkpoint (`model`: vision tower,
    `get_input_embeddings`, `language_model`), its processor, and how many of the language
    model's arrays are the target's own (`shared` of `total`)."""

    model: nn.Module
    processor: Any
    path: Path
    shared: int
    total: int
    # one prompt at a time through the processor (its tokenizer pads, which a fast tokenizer
    # refuses while another thread holds it: the server plans requests on several threads)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def image_token(self) -> str:
        """The text that stands for one image in a prompt, before the processor expands it
        (Gemma 3's processor expands its `boi_token`, Qwen's its `image_token`)."""
        mark = getattr(self.processor, "boi_token", None) or getattr(
            self.processor, "image_token", None)
        return str(mark or "<image>")

    @property
    def image_token_id(self) -> int:
        """The token id the expanded image positions carry."""
        value = getattr(self.processor, "image_token_id", None)
        if value is None:
            config = self.model.config
            value = getattr(config, "image_token_id", None) or getattr(
                config, "image_token_index", None)
        if value is None:
            raise VisionError(f"{self.path} names no image token id")
        return int(value)


def has_vision_tower(path: str | Path) -> bool:
    """Whether the checkpoint directory's config describes a vision tower (`vision_config`)."""
    config = Path(path) / "config.json"
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def available() -> bool:
    """Whether mlx-vlm can be imported."""
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        return False
    return True


def load_vision(target: nn.Module, path: str | Path) -> Vision:
    """mlx-vlm's model and processor of the checkpoint directory `path` whose language model
    `target` is, attached to `target` (`vision_of`). VisionError (one sentence) without
    mlx-vlm or a vision tower."""
    path = Path(path)
    if not has_vision_tower(path):
        raise VisionError(f"{path} is not a vision-language checkpoint (its config has no "
                          "vision_config)")
    if not available():
        raise VisionError(f"images need mlx-vlm, which is not installed: {EXTRA}")
    from mlx_vlm.utils import load_model, load_processor

    model = load_model(path, lazy=True)
    processor = load_processor(path)
    shared, total = _share(target, model.language_model)
    vision = Vision(model, processor, path, shared, total)
    attach(target, vision)
    return vision


def _share(target: nn.Module, language: nn.Module) -> tuple[int, int]:
    """Point `language`'s parameters at `target`'s where they agree (module docstring; a tied
    target's embeddings serve mlx-vlm's separate LM head, as Gemma 3's do); returns (arrays
    shared, arrays in `language`)."""
    ours = dict(tree_flatten(target.parameters()))
    theirs = tree_flatten(language.parameters())
    pairs = []
    for name, value in theirs:
        names = [name, f"language_model.{name}"]
        if name.startswith("lm_head."):  # a tied head: the embeddings' arrays
            tied = "model.embed_tokens." + name[len("lm_head."):]
            names += [tied, f"language_model.{tied}"]
        mine = next((ours[n] for n in names if n in ours), None)
        if mine is not None and mine.shape == value.shape:
            pairs.append((name, value, mine))
    small = [(v.astype(m.dtype), m) for _, v, m in pairs if v.ndim == 1]
    if small and not all(mx.array_equal(v, m).item() for v, m in small):
        return 0, len(theirs)
    language.update(tree_unflatten([(name, mine) for name, _, mine in pairs]))
    return len(pairs), len(theirs)


def attach(target: nn.Module, vision: Vision) -> None:
    """Remember `vision` as `target`'s vision side."""
    target.__dict__[_ATTR] = vision


def vision_of(target: nn.Module) -> Vision | None:
    """The vision side attached to `target`, None where it has none."""
    return target.__dict__.get(_ATTR)

"""A prompt with images, as the engine and mlx-vlm take it.

Where each image goes: chat messages mark it with a content part {"type": "image"} (an
{"type": "image", "image": X} part brings the image itself; the others take `images` in
order); a string prompt with the processor's image token (Qwen's `<|image_pad|>`) once per
image. The text is rendered by the tokenizer's chat template (or `chat_template`), then mlx-vlm's
processor expands each image token to the image's positions and computes its pixel inputs.

The prompt cache's key is the prompt's ids with each image position replaced by a string naming
the image's digest (SHA-256 of its RGB pixels and size) and the position within the image: two
prompts share a cached prefix only where their images are the same pixels.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .part import Vision, VisionError

ImageLike = Any  # a path, encoded bytes, a PIL image, or an (H, W, 3) uint8 array


@dataclass
class VisionPrompt:
    """ids: the prompt's token ids (image positions expanded); keys: the prompt cache's key
    (module docstring); inputs: what mlx-vlm's `get_input_embeddings` takes beside the ids
    (pixel values, the images' grids); positions: the index of every image position."""

    ids: list[int]
    keys: list[Any]
    inputs: dict[str, mx.array]
    positions: list[int]

    def images_from(self, start: int) -> bool:
        """Whether any image position lies at or after `start`."""
        return bool(self.positions) and self.positions[-1] >= start

    def reusable(self, common: int) -> int:
        """How much of a cached common prefix of `common` positions a prefill may start after:
        all of it when no image follows it (the rest is text, which the target prefills), else
        up to the first image (mlx-vlm's prefill starts where no image lies behind it)."""
        if not self.images_from(common):
            return common
        return min(common, self.positions[0])


def has_image_parts(prompt: Any) -> bool:
    """Whether chat messages carry {"type": "image"} content parts."""
    return isinstance(prompt, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"])
        for m in prompt)


def load_image(image: ImageLike, where: str) -> Any:
    """`image` as an RGB PIL image; VisionError naming `where` if it is none of the kinds."""
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(image, Image.Image):
            picture = image
        elif isinstance(image, (bytes, bytearray)):
            picture = Image.open(io.BytesIO(image))
        elif isinstance(image, (str, Path)):
            picture = Image.open(Path(image).expanduser())
        elif isinstance(image, np.ndarray) and image.ndim == 3 and image.shape[-1] == 3:
            picture = Image.fromarray(image.astype(np.uint8))
        else:
            raise VisionError(f"{where} must be a path, encoded image bytes, a PIL image or an "
                              f"(H, W, 3) array (got {type(image).__name__})")
        return picture.convert("RGB")
    except (OSError, UnidentifiedImageError) as err:
        raise VisionError(f"{where} is not an image that can be read ({err})") from None


def digest(picture: Any) -> str:
    """The image's identity for a prompt cache: SHA-256 of its size and RGB pixels."""
    h = hashlib.sha256(f"{picture.size}".encode())
    h.update(picture.tobytes())
    return h.hexdigest()[:16]


def _render(vision: Vision, prompt: Any, images: list, chat_template: str | None) -> str:
    """The prompt's text with one image token per image; images carried by message parts are
    appended to `images` in order (`images` given alone fill the bare {"type": "image"}
    parts)."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
        raise VisionError("a prompt with images must be a string or chat messages (token ids "
                          "carry no images)")
    given, carried, messages = list(images), [], []
    for m in prompt:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    if "image" in part:
                        carried.append(part["image"])
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            m = {**m, "content": parts}
        messages.append(m)
    if carried and given:
        raise VisionError("give the images either in the messages' image parts or in images, "
                          "not both")
    images[:] = carried or given
    tokenizer = getattr(vision.processor, "tokenizer", vision.processor)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=chat_template)


def vision_prompt(vision: Vision, prompt: Any, images: list[ImageLike],
                  chat_template: str | None = None) -> VisionPrompt:
    """The `VisionPrompt` of `prompt` (a string, or chat messages through the chat template)
    and its `images`; VisionError (one sentence) where they do not match."""
    from mlx_vlm.utils import prepare_inputs

    images = list(images)
    with vision.lock:
        text = _render(vision, prompt, images, chat_template)
    marked = text.count(vision.image_token)
    if marked != len(images):
        where = "image parts in the messages" if not isinstance(prompt, str) else \
            f"{vision.image_token!r} marks in the prompt"
        raise VisionError(f"the prompt has {marked} {where} for {len(images)} images")
    pictures = [load_image(image, f"images[{j}]") for j, image in enumerate(images)]
    with vision.lock:
        inputs = prepare_inputs(vision.processor, images=pictures or None, prompts=[text])
    ids = [int(i) for i in np.array(inputs["input_ids"][0])]
    token = vision.image_token_id
    positions = [j for j, i in enumerate(ids) if i == token]
    keys: list[Any] = list(ids)
    runs = spans(positions)
    if len(runs) != len(pictures):
        raise VisionError(f"the processor gave {len(runs)} image spans for {len(pictures)} "
                          "images")
    for picture, (first, last) in zip(pictures, runs):
        name = digest(picture)
        for at in range(first, last):
            keys[at] = f"image:{name}:{at - first}"
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    extra["mask"] = inputs.get("attention_mask", mx.ones((1, len(ids)), dtype=mx.int32))
    return VisionPrompt(ids, keys, extra, positions)


def spans(positions: list[int]) -> list[tuple[int, int]]:
    """Each image's [first, last + 1): runs of consecutive image positions."""
    out: list[tuple[int, int]] = []
    for at in positions:
        if out and out[-1][1] == at:
            out[-1] = (out[-1][0], at + 1)
        else:
            out.append((at, at + 1))
    return out

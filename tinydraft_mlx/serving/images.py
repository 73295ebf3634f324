"""Images in requests: OpenAI's `image_url` content parts and Anthropic's `image` blocks, read as
the bytes of the image (base64, inline: this server fetches no URL), and the prompt they make
with the rendered chat text (`tinydraft_mlx.vision`). Each message's image becomes a
{"type": "image"} part where it stood, which the model's chat template renders as its image
token."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from ..engine.sampling import ParameterError
from ..generation.api import vision_prefill
from ..vision import VisionError, vision_of
from .errors import bad

EXTRA = "pip install 'tinydraft-mlx[vision]'"


def _decoded(data: str, param: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad(param, f"{param} is not valid base64") from None


def data_url(url: str, param: str) -> bytes:
    """The image in an OpenAI `image_url.url`: a data URL (data:image/png;base64,...)."""
    if not url.startswith("data:"):
        raise bad(param, f"{param} must be a data URL (data:image/...;base64,...): this "
                  f"server fetches no URL (got {url[:40]!r})")
    head, _, data = url.partition(",")
    if not head.endswith(";base64"):
        raise bad(param, f"{param} must carry its image in base64 (data:image/...;base64,...)")
    return _decoded(data, param)


def anthropic_source(source: Any, param: str) -> bytes:
    """The image in an Anthropic image block's `source` ({"type": "base64", "media_type",
    "data"})."""
    if not isinstance(source, dict) or source.get("type") != "base64":
        kind = source.get("type") if isinstance(source, dict) else type(source).__name__
        raise bad(param, f'{param} must be {{"type": "base64", "media_type", "data"}}: this '
                  f"server fetches no URL (got type {kind!r})")
    data = source.get("data")
    if not isinstance(data, str):
        raise bad(f"{param}.data", f"{param}.data must be the image in base64")
    return _decoded(data, f"{param}.data")


def check_reads_images(target: Any, param: str) -> None:
    """400 naming `param` where the served model reads no images."""
    if vision_of(target) is None:
        raise bad(param, "this model reads no images: serve a vision-language checkpoint, with "
                  f"mlx-vlm installed ({EXTRA})")


def vision_prompt_of(target: Any, text: str, images: list[bytes], param: str) -> Any:
    """The `VisionPrefill` of the rendered chat `text` (one image token per image) and the
    request's images; 400 naming `param` where the model reads no images or they do not fit."""
    check_reads_images(target, param)
    try:
        return vision_prefill(target, text, images)
    except (VisionError, ParameterError) as err:
        raise bad(param, str(err)) from None

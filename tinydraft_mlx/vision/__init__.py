"""Targets that see images: a vision-language checkpoint's prompt is prefilled by mlx-vlm's model
of it (its vision tower, its input embeddings, its language model with the positions it gives
image tokens), then decoded by the engine on the mlx-lm target, with any drafter.

- `part.py`: the checkpoint's vision side (mlx-vlm's model and processor), loaded beside the
  target, its language model sharing the target's arrays (`attach`, `vision_of`).
- `prompt.py`: a prompt and its images as token ids, mlx-vlm's pixel inputs and a prompt cache's
  key (image positions keyed by the image's digest).
- `prefill.py`: the prefill: mlx-vlm's language model over the prompt into its own cache, handed
  to the engine's cache (keys moved to the positions the target decodes at), with the states a
  head drafter reads.

mlx-vlm is an optional dependency (`pip install 'tinydraft-mlx[vision]'`); without it text
generation is unchanged and images are refused in one line.
"""

from __future__ import annotations

from .part import Vision, VisionError, attach, has_vision_tower, load_vision, vision_of
from .prefill import VisionPrefill
from .prompt import VisionPrompt, has_image_parts, vision_prompt

__all__ = ["Vision", "VisionError", "VisionPrefill", "VisionPrompt", "attach", "has_image_parts",
           "has_vision_tower", "load_vision", "vision_of", "vision_prompt"]

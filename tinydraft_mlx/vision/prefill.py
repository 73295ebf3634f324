"""The prefill of a prompt with images, by mlx-vlm, handed to the engine's cache.

mlx-vlm's `get_input_embeddings` puts the vision tower's features at the image positions and
gives the positions its language model runs them at; its language model then runs the prompt up
to the end of its last image into a cache of mlx-vlm's own, in chunks of `PREFILL_STEP`, as
mlx-vlm's own generation does. The cache is then handed over: each attention layer's keys and
values, each recurrent layer's window and state, the engine's cache holding afterwards exactly
what mlx-vlm's held; the text after the last image is the target's own prefill (the engine's
first round feeds the last token, as for any prompt). A cached prefix (a prompt cache's, never
with an image in it: `VisionPrompt.reusable`) is handed to mlx-vlm's cache first.

Positions. Models with multimodal RoPE (Qwen2-VL and after, Qwen3.5) give an image's positions
its height and width, not one position per token, so text after an image runs at position
index + delta (`rope_deltas`, negative), where mlx-lm's text model runs it at its index. RoPE
scores depend only on the distance between a query's and a key's positions, so every prompt key
is rotated by -delta once here (the layer's own RoPE module, applied at offset -delta to each
key as a sequence of one): the target then decodes at its own positions and every distance is
mlx-vlm's. Text-only prompts never come here (delta 0).

Image attention. Gemma 3's image tokens attend to every position of their own image during the
prefill (transformers' `token_type_ids` mask), mlx-vlm's language model runs them causally: for
the model types in `WHOLE_IMAGE` each chunk gets that mask (causal, and each image position
sees its whole image; chunks end outside images), so the prompt's states are transformers'. One
mask serves every layer, so the images must lie within the sliding window (refused otherwise);
the text after them, the target's prefill, may run past it.

The states a head drafter reads (the target's final states, a layer's output) come from the same
forward (mlx-vlm's `return_hidden` / `capture_layer_ids`) into the engine's open capture, so an
MTP layer or an EAGLE-3 head reads the image positions as the target saw them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..engine.cache import Cache, cache_length
from ..engine.cache.recurrent import RecurrentCache
from ..engine.forward import PREFILL_STEP
from ..engine.hidden import FINAL, body, record, watched
from .part import Vision, VisionError
from .prompt import VisionPrompt, spans

Progress = Any  # f(processed, total) or None
# model types whose image positions attend to their whole image in the prefill (Gemma 3's
# token_type_ids mask in transformers); the others' attend causally
WHOLE_IMAGE = ("gemma3",)


class VisionPrefill:
    """The prefill of one `VisionPrompt` (module docstring): `covers(start)` says whether the
    prompt from `start` on needs it (an image lies there), `prefill(target, cache, end)` fills
    the cache from its length to the end of the last image (the target prefills the rest)."""

    def __init__(self, vision: Vision, prompt: VisionPrompt) -> None:
        self.vision, self.prompt = vision, prompt
        language = vision.model.language_model
        window = getattr(getattr(language, "config", None), "sliding_window", None)
        stop = prompt.positions[-1] + 1 if prompt.positions else 0
        if self._spans() and window and stop > window:  # one mask serves every layer
            raise VisionError(f"this prompt's last image ends at position {stop}, past the "
                              f"sliding window of {window}: images must lie within the first "
                              f"{window} positions of a prompt")

    def _spans(self) -> list[tuple[int, int]] | None:
        """Each image's positions where they attend to their whole image (`WHOLE_IMAGE`)."""
        kind = getattr(self.vision.model.config, "model_type", None)
        return spans(self.prompt.positions) if kind in WHOLE_IMAGE else None

    def covers(self, start: int) -> bool:
        return self.prompt.images_from(start)

    def prefill(self, target: nn.Module, cache: Cache, end: int,
                progress: Progress = None) -> int:
        """Fill `cache` from its length to the end of the prompt's last image (at most `end`);
        returns how many positions it filled (the target prefills the text after it)."""
        start = cache_length(cache)
        end = min(end, self.prompt.positions[-1] + 1)
        if self.prompt.positions and start > self.prompt.positions[0]:
            raise VisionError("a prefill with images must start before the first image "
                              f"(the cache holds {start} tokens, the image starts at "
                              f"{self.prompt.positions[0]})")
        model, language = self.vision.model, self.vision.model.language_model
        ids = mx.array([self.prompt.ids], dtype=mx.int32)
        inputs = dict(self.prompt.inputs)
        features = model.get_input_embeddings(ids, inputs.pop("pixel_values", None), **inputs)
        embeds = features.inputs_embeds
        kwargs = {k: v for k, v in features.to_dict().items()
                  if k != "inputs_embeds" and v is not None}
        deltas = kwargs.get("rope_deltas")
        shift = 0 if deltas is None else int(mx.array(deltas).reshape(-1)[0].item())
        seen = watched(target)  # mlx-vlm returns layer outputs by layer, then the final states
        after = sorted(t[1] for t in seen if t != FINAL)
        tags = [("after", j) for j in after] + ([FINAL] if FINAL in seen else [])
        if tags:
            kwargs.update(return_hidden=FINAL in tags, capture_layer_ids=after or None)
        theirs = _their_cache(language)
        blocks = self._spans()
        _reset(language)
        try:
            if start:
                _hand(cache, theirs, start)
            for a, b in _chunks(start, end, blocks or []):
                if blocks is not None:
                    kwargs["mask"] = _whole_image_mask(a, b, blocks)
                out = language(ids[:, a:b], inputs_embeds=embeds[:, a:b], cache=theirs,
                               **kwargs)
                states = list(getattr(out, "hidden_states", None) or [])[: len(tags)]
                if len(states) == len(tags):
                    record(tags, states)
                mx.eval([c.state for c in theirs] + states)
                if progress is not None:
                    progress(b - start)
        finally:
            _reset(language)
        _take(theirs, cache, target, end, shift)
        return end - start


def _chunks(start: int, end: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[a, b) chunks of at most PREFILL_STEP positions from `start` to `end`, each extended to
    the end of an image it would cut."""
    out, a = [], start
    while a < end:
        b = min(end, a + PREFILL_STEP)
        b = max([b] + [last for first, last in spans if first < b < last])
        out.append((a, b))
        a = b
    return out


def _whole_image_mask(a: int, b: int, spans: list[tuple[int, int]]) -> mx.array:
    """(b - a, b) booleans: row i (position a + i) sees position j where j <= a + i or both lie
    in one image."""
    rows = mx.arange(a, b)[:, None]
    cols = mx.arange(b)[None, :]
    seen = cols <= rows
    for first, last in spans:
        if first < b and last > a:
            inside = (rows >= first) & (rows < last) & (cols >= first) & (cols < last)
            seen = seen | inside
    return seen


def _their_cache(language: nn.Module) -> list:
    make = getattr(language, "make_cache", None)
    if callable(make):
        return make()
    from mlx_vlm.models.cache import make_prompt_cache

    return make_prompt_cache(language)


def _reset(language: nn.Module) -> None:
    """mlx-vlm's language models keep the last prompt's positions on the module."""
    for name in ("_position_ids", "_rope_deltas"):
        if hasattr(language, name):
            setattr(language, name, None)


def _kv(layer: Any, where: str) -> tuple[mx.array, mx.array]:
    """A KV layer's keys and values in position order; VisionError where it dropped some."""
    keys, values = layer.state[:2]
    n = layer.offset
    if keys.shape[2] < n:
        raise VisionError(f"{where} holds {keys.shape[2]} of the prompt's {n} positions (a "
                          "sliding window shorter than the prompt): prompts with images must "
                          "fit the window")
    return keys[..., :n, :], values[..., :n, :]


def _hand(ours: Cache, theirs: list, length: int) -> None:
    """Our cached prefix (no image in it) into mlx-vlm's fresh cache."""
    for i, (mine, other) in enumerate(zip(ours, theirs)):
        if isinstance(mine, RecurrentCache):
            other.cache = list(mine.cache)
        else:
            keys, values = _kv(mine, f"layer {i}'s cache")
            other.update_and_fetch(keys[..., :length, :], values[..., :length, :])


def _take(theirs: list, ours: Cache, target: nn.Module, end: int, shift: int) -> None:
    """mlx-vlm's cache, holding the prompt to `end`, into ours; keys rotated by -shift."""
    layers = list(getattr(body(target), "layers", []))
    moved = []
    for i, (other, mine) in enumerate(zip(theirs, ours)):
        if isinstance(mine, RecurrentCache):
            moved.append((mine, list(other.cache)))
            continue
        keys, values = _kv(other, f"mlx-vlm's layer {i}")
        if shift:
            keys = _rotate(keys, _rope(layers[i] if i < len(layers) else None, i, shift),
                           -shift)
        moved.append((mine, (keys, values)))
    mx.eval([m[1] for m in moved])
    for mine, held in moved:  # nothing of ours changes before every layer is ready
        if isinstance(mine, RecurrentCache):
            mine.cache, mine.offset, mine.tape, mine.cut = held, end, [], None
        else:
            mine.trim(mine.offset)
            mine.update_and_fetch(*held)


def _rope(layer: nn.Module | None, index: int, shift: int) -> nn.RoPE:
    for name in ("self_attn", "attention", "attn"):
        rope = getattr(getattr(layer, name, None), "rope", None)
        if isinstance(rope, nn.RoPE):
            return rope
    raise VisionError(f"this prompt's images move the target's positions by {shift}, and its "
                      f"layer {index} has no plain RoPE to move its keys with")


def _rotate(keys: mx.array, rope: nn.RoPE, offset: int) -> mx.array:
    """Every key rotated by the same `offset` positions (each as a sequence of one)."""
    b, h, n, d = keys.shape
    return rope(keys.reshape(b, h * n, 1, d), offset=offset).reshape(b, h, n, d)

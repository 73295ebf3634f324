"""The target's final hidden states, for drafters that read them (an MTP layer).

What a head reads is what the target's LM head reads: the output of the body's final norm (the
states vLLM and SGLang hand to Qwen3-Next / Qwen3.5 / DeepSeek MTP layers). `watch(model)` swaps
that norm's class, once, for a subclass that appends its output to the list of the `capture()`
open on this thread (outside one it is a pass-through), so every forward path (the eager one,
the compiled step, the chunked prefill, a batch's forward) yields them without a second copy of
mlx-lm's model code. A compiled step records inside its trace and returns the states as one more
output (forward.py), so a watched model's traces are dropped once, when it becomes watched.

Cost: none in compute (the norm runs anyway); a captured state is kept only as long as the
caller holds it ((positions, hidden size) per forward: a verify of k + 1 positions, or a prefill
chunk).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

_local = threading.local()  # .seen: the open capture's list on this thread
_WATCHED = "_tinydraft_watched"
_CLASSES: dict[type, type] = {}
NORMS = ("norm", "norm_f", "final_layernorm")  # the body's final norm, by mlx-lm's names


def text_model(model: nn.Module) -> nn.Module:
    """The language model inside a multimodal wrapper (Qwen3.5's `language_model`), else the
    model itself."""
    inner = getattr(model, "language_model", None)
    return inner if isinstance(inner, nn.Module) else model


def body(model: nn.Module) -> nn.Module | None:
    """The decoder stack of an mlx-lm model (`.model`, or `.backbone`), None if it has none."""
    text = text_model(model)
    for name in ("model", "backbone"):
        part = getattr(text, name, None)
        if isinstance(part, nn.Module):
            return part
    return None


def final_norm(model: nn.Module) -> nn.Module | None:
    """The module whose output the LM head reads, None where it cannot be found."""
    stack = body(model)
    for name in NORMS if stack is not None else ():
        norm = getattr(stack, name, None)
        if isinstance(norm, nn.Module):
            return norm
    return None


def _watching(cls: type) -> type:
    made = _CLASSES.get(cls)
    if made is None:
        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            seen = getattr(_local, "seen", None)
            if seen is not None:
                seen.append(out)
            return out

        made = _CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return made


def watch(model: nn.Module) -> bool:
    """Make the model's final hidden states capturable (idempotent); False where the model has
    no final norm this module knows."""
    if model.__dict__.get(_WATCHED):
        return True
    norm = final_norm(model)
    if norm is None:
        return False
    norm.__class__ = _watching(type(norm))
    model.__dict__[_WATCHED] = True
    from . import forward  # a compiled step traced before now would not record

    forward.reset(model)
    return True


def watched(model: nn.Module) -> bool:
    """Whether `watch(model)` has run."""
    return bool(getattr(model, "__dict__", {}).get(_WATCHED))


@contextmanager
def capture() -> Iterator[list[mx.array]]:
    """A list that receives the (..., L, D) output of every watched norm run on this thread
    inside the block (a compiled step's too: forward.py adds its returned states)."""
    outer = getattr(_local, "seen", None)
    seen: list[mx.array] = []
    _local.seen = seen
    try:
        yield seen
    finally:
        _local.seen = outer


def record(states: list[mx.array]) -> None:
    """Hand states computed elsewhere (a compiled step's outputs) to the open capture, if any."""
    seen = getattr(_local, "seen", None)
    if seen is not None:
        seen.extend(states)


def active() -> list[mx.array] | None:
    """The open capture's list on this thread, None outside one."""
    return getattr(_local, "seen", None)

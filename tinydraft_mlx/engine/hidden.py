"""The target's hidden states, for drafters that read them (an MTP layer, an EAGLE-3 head).

Two kinds of states are read: the final one, what the target's LM head reads (the output of the
body's final norm: the states vLLM and SGLang hand to Qwen3-Next / Qwen3.5 / DeepSeek MTP
layers), tagged FINAL; and the residual stream after a decoder layer j, tagged ("after", j)
(EAGLE-3's low / mid / high states: "layer i" in vLLM's and speculators' terms is the input of
layer i, the output of layer i - 1). `watch(model, after=...)` swaps those modules' classes,
once, for subclasses that append (tag, output) to the list of the `capture()` open on this
thread (outside one they are pass-throughs), so every forward path (the eager one, the compiled
step, the chunked prefill, a batch's forward) yields them without a second copy of mlx-lm's
model code. Why a class swap and not a wrapper module: the watched modules sit inside
mlx-lm's model tree, and a wrapper would change their parameter paths (what loading, saving,
quantization predicates and `model.update` address) and their identity for code that holds
them; the subclass keeps both and only adds the recording after `__call__`. A compiled step
records inside its trace and returns the states as more outputs (forward.py), its traces keyed
by the set of watched modules (`watched`), so a `watch` never needs to reach up into it.

`StateHead` is what such a drafter is: a module over its target, called as a draft model is but
with the states beside the ids (`head(tokens, cache, hidden=states)` -> (logits over the
target's vocabulary, the states its next step reads)), which says what it reads from a capture
(`read`). Cost: none in compute (the modules run anyway); a captured state is kept only as long
as the caller holds it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn

FINAL = "final"
_local = threading.local()  # .seen: the open capture's list on this thread
_WATCHED = "_tinydraft_watched"  # per model: the set of tags it records
_CLASSES: dict[tuple[type, Any], type] = {}
NORMS = ("norm", "norm_f", "final_layernorm")  # the body's final norm, by mlx-lm's names

Seen = list[tuple[Any, mx.array]]


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


def embeddings(model: nn.Module) -> nn.Module:
    """The model's token embeddings (what a head shares with its target); ValueError where
    its decoder stack has none."""
    stack = body(model)
    if stack is None or not hasattr(stack, "embed_tokens"):
        raise ValueError(f"{type(model).__name__} has no token embeddings a head can share")
    return stack.embed_tokens


def final_norm(model: nn.Module) -> nn.Module | None:
    """The module whose output the LM head reads, None where it cannot be found."""
    stack = body(model)
    for name in NORMS if stack is not None else ():
        norm = getattr(stack, name, None)
        if isinstance(norm, nn.Module):
            return norm
    return None


def _recording(cls: type, tag: Any) -> type:
    made = _CLASSES.get((cls, tag))
    if made is None:
        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            seen = getattr(_local, "seen", None)
            if seen is not None:
                seen.append((tag, out))
            return out

        made = _CLASSES[cls, tag] = type(cls.__name__, (cls,), {"__call__": __call__})
    return made


def watch(model: nn.Module, after: tuple[int, ...] = ()) -> bool:
    """Make the model's final states, and the outputs of decoder layers `after`, capturable
    (idempotent); False where a module to watch cannot be found (nothing changes then)."""
    tags = {FINAL, *(("after", j) for j in after)}
    done = model.__dict__.setdefault(_WATCHED, set())
    if tags <= done:
        return True
    norm, layers = final_norm(model), list(getattr(text_model(model), "layers", []))
    if norm is None or any(not 0 <= j < len(layers) for j in after):
        return False
    for tag in tags - done:
        module = norm if tag == FINAL else layers[tag[1]]
        module.__class__ = _recording(type(module), tag)
    done |= tags
    return True


def watched(model: nn.Module) -> frozenset:
    """The tags `model` records (none where it was never watched): a compiled step keys its
    traces by them (forward.py), so a step traced before a `watch` is not reused after it."""
    return frozenset(model.__dict__.get(_WATCHED, ()))


@contextmanager
def capture() -> Iterator[Seen]:
    """A list that receives (tag, output) from every watched module run on this thread inside
    the block (a compiled step's too: forward.py adds what it returned)."""
    outer = getattr(_local, "seen", None)
    seen: Seen = []
    _local.seen = seen
    try:
        yield seen
    finally:
        _local.seen = outer


def record(tags: list[Any], states: list[mx.array]) -> None:
    """Hand states computed elsewhere (a compiled step's outputs) to the open capture, if any."""
    seen = getattr(_local, "seen", None)
    if seen is not None:
        seen.extend(zip(tags, states))


def active() -> list[mx.array]:
    """The arrays of the open capture on this thread ([] outside one)."""
    return [a for _, a in getattr(_local, "seen", None) or []]


def gathered(seen: Seen, tag: Any) -> list[mx.array]:
    """Every state of `tag` in a capture, in order (a chunked prefill's chunks)."""
    return [a for t, a in seen if t == tag]


class StateHead(nn.Module):
    """A drafter that reads its target's states (see the module docstring). Subclasses set
    `kind` (its drafter name) and implement `__call__`, `read` and `make_cache`.
    `step_inputs`: its keyword inputs beside the ids (a compiled step takes them as inputs)."""

    kind = "head"
    step_inputs = ("hidden",)

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "target", target)  # shared, not a parameter of the head

    def read(self, seen: Seen) -> list[mx.array]:
        """The (..., L, D') states this head reads, per forward of a capture, in order."""
        raise NotImplementedError

    def target_states(self, ids: list[int]) -> mx.array:
        """What this head reads over `ids`, (1, len(ids), D'), from one uncached forward."""
        with capture() as seen:
            self.target(mx.array([ids]))
        return self.read(seen)[-1]

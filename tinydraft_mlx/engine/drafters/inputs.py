"""A draft model that cannot embed every token of the sequence it reads.

A draft's embeddings may have fewer rows than the target's vocabulary: Gemma 3 4B's image token
(id 262,144) lies past gemma-3-1b's 262,144 rows, and a vision-language target's prompt holds
hundreds of them; a target may also emit an id of its padded vocabulary. Looking such an id up
reads past the table (MLX does not check). `guard(model, width)` makes the draft read id 0
there instead: its proposals after such a token are worse, never wrong (the target verifies
every one). The embedding module's class is swapped for a subclass (as `hidden.watch` does),
so its parameters, a tied head's `as_linear` and a compiled step that traces it are unchanged.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..hidden import embeddings

_CLASSES: dict[type, type] = {}


def _clamped(cls: type) -> type:
    made = _CLASSES.get(cls)
    if made is None:
        def __call__(self, x: mx.array) -> mx.array:
            rows = self.weight.shape[0]
            return cls.__call__(self, mx.where(x < rows, x, 0))

        made = _CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return made


def guard(model: nn.Module, width: int | None) -> bool:
    """Make `model`'s embeddings read id 0 for ids past their rows where the target's vocabulary
    (`width`) is wider (idempotent); whether it did."""
    try:
        table = embeddings(model)
    except ValueError:
        return False
    if width is None or table.weight.shape[0] >= width:
        return False
    if type(table) not in _CLASSES.values():
        table.__class__ = _clamped(type(table))
    return True

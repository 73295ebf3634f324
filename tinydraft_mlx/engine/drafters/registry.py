"""Drafters by name, and the one resolver that turns the user's `draft` argument into a `Source`:
a registered name, a model or a head, a `PromptLookup`, a `Hybrid`, a plug-in, or None.

Built-in names: "none", "prompt-lookup", "model" (the batch's or server's draft model), "hybrid"
(it with prompt lookup), "mtp" (the MTP layer attached to the target), "eagle3" (an EAGLE-3 head
given as the draft), "dflash" (a DFlash / DFlash2 block drafter given as the draft). A plug-in
registers its own (`register_drafter`); the server offers every name its models can draft with,
and the exactness tests run over every registered name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.nn as nn

from ..hidden import StateHead
from ..sampling import ParameterError
from .dflash import DFLASH
from .eagle import EAGLE3
from .lookup import NO_DRAFT, PROMPT_LOOKUP, PromptLookup
from .mtp import MTP, head_of
from .protocol import Source
from .sources import (
    HYBRID,
    MODEL,
    HeadDraft,
    Hybrid,
    HybridDraft,
    LookupDraft,
    NoDraft,
    model_source,
)

Maker = Callable[[Any, Any], "Source | None"]  # (draft model, target) -> a source, or None
_NAMED: dict[str, Maker] = {}


def register_drafter(name: str, make: Maker) -> None:
    """Name a drafter: `draft=name` (the API, batches, the server's `draft` field) then resolves
    to `make(model, target)`, a fresh `Source` for one sequence (model: the batch's or server's
    draft model, or None; target: the target model), or None where these models cannot draft
    that way. The server offers every name its models can draft with; the exactness tests run
    over every registered name."""
    if not isinstance(name, str) or not name or name != name.strip().lower():
        raise ParameterError("name", "a non-empty lower-case string", name)
    _NAMED[name] = make


def unregister_drafter(name: str) -> None:
    """Forget a name given with `register_drafter` (KeyError for an unknown one)."""
    del _NAMED[name]


def registered_drafters() -> list[str]:
    """Every drafter name, in the order they were registered."""
    return list(_NAMED)


def drafter_names(model: Any = None, target: Any = None) -> list[str]:
    """The names these models can draft with (`model`: a draft model or a head, or None)."""
    return [name for name, make in _NAMED.items() if make(model, target) is not None]


def _head(model: Any) -> HeadDraft | None:
    return HeadDraft(model) if isinstance(model, StateHead) else None


register_drafter(NO_DRAFT, lambda model, target: NoDraft())
register_drafter(PROMPT_LOOKUP, lambda model, target: LookupDraft(PromptLookup()))
register_drafter(MODEL, lambda model, target: model_source(model))
register_drafter(HYBRID, lambda model, target: None if model is None and head_of(target) is None
                 else HybridDraft(Hybrid(model if model is not None else head_of(target))))
register_drafter(MTP, lambda model, target: _head(head_of(target)))
register_drafter(EAGLE3, lambda model, target: _head(model) if getattr(model, "kind", None)
                 == EAGLE3 else None)
register_drafter(DFLASH, lambda model, target: model.source() if getattr(model, "kind", None)
                 == DFLASH else None)


def resolve_drafter(draft: object, model: nn.Module | None = None,
                    target: nn.Module | None = None) -> Source:
    """The source for a `draft` argument: None (plain decoding), a registered name
    (`registered_drafters()`: "none", "prompt-lookup", "model", "hybrid", "mtp", "eagle3" and
    plug-ins; "model" and "hybrid" use `model`, the batch's draft model, "mtp" the MTP layer
    attached to `target`), a model or a head, a `PromptLookup`, a `Hybrid`, a plug-in drafter
    (an object whose `source()` makes a fresh `Source`), or a source already resolved (returned
    as it is). ParameterError for anything else."""
    allowed = f'a model, a registered name ({", ".join(_NAMED)}), a Hybrid, a PromptLookup or None'
    if draft is None:
        return NoDraft()
    if isinstance(draft, str):
        make = _NAMED.get(draft.lower())
        if make is None:
            raise ParameterError("draft", allowed, draft)
        source = make(model, target)
        if source is not None:
            return source
        if draft.lower() in (MODEL, HYBRID):
            raise ParameterError("draft", f'not "{draft}" in a decoder without a draft model',
                                 draft)
        if draft.lower() == MTP:
            raise ParameterError("draft", '"mtp" with a target whose MTP layer is loaded '
                                 '(load_models(draft="mtp"))', draft)
        raise ParameterError("draft", f'"{draft}" with models that can draft so', draft)
    if callable(getattr(draft, "source", None)):  # a plug-in drafter
        return draft.source()
    if all(callable(getattr(draft, name, None)) for name in ("host_proposal", "settle")):
        return draft  # a source already resolved (ours, or a plug-in's)
    if isinstance(draft, PromptLookup):
        return LookupDraft(draft)
    if isinstance(draft, Hybrid):
        return HybridDraft(draft)
    if callable(draft):  # a model: anything mlx-lm-like, model(tokens, cache=...) -> logits
        return model_source(draft)
    raise ParameterError("draft", allowed, type(draft).__name__)


def draft_model(draft: object, target: nn.Module | None = None) -> nn.Module | None:
    """The draft model behind a `draft` argument whose cache a caller may keep: None for prompt
    lookup, plain decoding and a head of the target (its cache goes with the target states it
    has not read: chains.HeadCache)."""
    if isinstance(draft, str) and draft.lower() in (MTP, EAGLE3, DFLASH):
        return None
    source = resolve_drafter(draft, target=target)
    return None if source.reads_target else source.model

"""Drafters: the protocol every drafter implements (protocol.py), the built-in ones (sources.py;
the target's MTP layer, mtp.py; EAGLE-3 heads, eagle.py; prompt lookup, lookup.py), the
registry of names and the resolver of a `draft` argument (registry.py), and the batch's
proposer with its chains of draft steps (proposals.py, chains.py).
"""

from .chains import HeadCache
from .lookup import NO_DRAFT, PROMPT_LOOKUP, PromptLookup
from .proposals import Drafting, Proposals, point_mass
from .protocol import HostDrafter, HostProposal, Source
from .registry import (
    draft_model,
    drafter_names,
    register_drafter,
    registered_drafters,
    resolve_drafter,
    unregister_drafter,
)
from .sources import HYBRID, MODEL, Hybrid, HybridDraft, LookupDraft, ModelDraft, NoDraft

__all__ = ["HYBRID", "MODEL", "NO_DRAFT", "PROMPT_LOOKUP", "Drafting", "HeadCache",
           "HostDrafter", "HostProposal", "Hybrid", "HybridDraft", "LookupDraft", "ModelDraft",
           "NoDraft", "PromptLookup", "Proposals", "Source", "draft_model", "drafter_names",
           "point_mass", "register_drafter", "registered_drafters", "resolve_drafter",
           "unregister_drafter"]

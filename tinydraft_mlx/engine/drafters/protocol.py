"""The drafter protocol: what every drafter answers (`Source`, one sequence's drafter), a
proposal made on the host with its distribution (`HostProposal`), and what a drafter without a
model answers (`HostDrafter`, a base for prompt lookup, plain decoding and host plug-ins).

The round, the forward pass, prompt caches, batches, the server and the check tool ask a drafter
only through `Source`; none of them tests what kind of drafter it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from ..cache import Cache
from .chains import Chain


@dataclass(frozen=True)
class HostProposal:
    """A proposal made on the host with the distribution it was drawn from: `tokens` (k ids)
    and `q`, (k, Vq) with row i the distribution token i was sampled from (a drafter that
    proposes deterministically returns plain ids instead: point masses)."""

    tokens: list[int]
    q: mx.array


class Source(Protocol):
    """The drafter protocol: one sequence's drafter, everything the round, the forward, prompt
    caches, batches, the server and the check tool ask of it (they never test its type).

    - `name`: how stats, metrics and the server name it; `drafts`: False for plain decoding;
      `policy_key`: what k="auto" keeps its learning under; `max_k`: the most tokens it can
      propose in one round (None: no limit of its own; a block drafter's block_size - 1);
      `block`: the positions of the one draft forward that proposes a whole round (a block
      drafter's block_size), None where each proposed token costs a draft step.
    - Proposing: `begin(seq)` once the row joins (seq grows in place); each round
      `host_proposal(k)`: ids proposed on the host (or a `HostProposal` with its q), or None
      where its model's batched chain drafts the row; for a candidate tree, `host_tree(k,
      budget)`: several deterministic continuations, best first ([]: the host proposal verifies
      as a chain); `settle(keep)` ends the round (the first `keep` tokens of the sequence are
      accepted).
    - Its model (`model`, None for a host-only drafter): `chain(caches, chunk, width)` makes the
      batch's chain for it (chains.py); `attach(target)` checks that it may draft for `target`
      and prepares it; `reads_target`: whether its chain reads the target's states (the verify
      and the prefill then capture them).
    - Its one-sequence cache: `row_cache(given, max_kv_size, margin)` (None without a model);
      `cache_in_file`: whether a prompt cache file keeps it (else a loaded one starts anew).
    - The check tool: `first_logits(ids)` its logits for the token after `ids` (None without a
      model); `prime(cache, ids)` fills a fresh cache with what precedes one step after `ids`
      and returns that step's extra inputs.
    """

    name: str
    drafts: bool
    max_k: int | None
    block: int | None
    model: nn.Module | None
    policy_key: object
    reads_target: bool
    cache_in_file: bool

    def begin(self, seq: list[int]) -> None: ...

    def host_proposal(self, k: int) -> list[int] | HostProposal | None: ...

    def host_tree(self, k: int, budget: int) -> list[list[int]]: ...

    def settle(self, keep: int) -> None: ...

    def attach(self, target: nn.Module) -> None: ...

    def chain(self, caches: Any, chunk: int, width: int | None) -> Chain: ...

    def row_cache(self, given: Cache | None, max_kv_size: int | None,
                  margin: int) -> Cache | None: ...

    def first_logits(self, ids: list[int]) -> mx.array | None: ...

    def prime(self, cache: Cache, ids: list[int]) -> dict[str, mx.array]: ...


class HostDrafter:
    """What a drafter without a model answers (a base for host-only drafters: prompt lookup,
    plain decoding, and plug-ins that propose on the host): no chain, no cache."""

    name, drafts, model, policy_key, max_k, block = "host", True, None, None, None, None
    reads_target, cache_in_file = False, True

    def begin(self, seq: list[int]) -> None:
        pass

    def host_proposal(self, k: int) -> list[int] | HostProposal | None:
        return []

    def host_tree(self, k: int, budget: int) -> list[list[int]]:
        return []

    def settle(self, keep: int) -> None:
        pass

    def attach(self, target: nn.Module) -> None:
        pass

    def chain(self, caches: Any, chunk: int, width: int | None) -> Chain:
        raise ValueError(f"{self.name} drafts on the host: it has no chain")

    def row_cache(self, given: Cache | None, max_kv_size: int | None,
                  margin: int) -> Cache | None:
        return None

    def first_logits(self, ids: list[int]) -> mx.array | None:
        return None

    def prime(self, cache: Cache, ids: list[int]) -> dict[str, mx.array]:
        return {}

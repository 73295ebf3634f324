"""A sequence in the engine's batch: what a round emits (`Token`), what a sequence leaves behind
(`Finished`), and the row the rounds keep for it (`Row`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from .cache import Cache
from .drafters import Source
from .policy import Acceptance, TreeChoice
from .sampling import Processor, SamplingParams
from .stats import GenerationStats
from .trees import Tree

__all__ = ["Finished", "OwnPrefill", "Row", "Token"]


class OwnPrefill(Protocol):
    """A prompt's own prefill, where the target's forward over its ids is not the prompt (a
    prompt with images: vision/prefill.py). `covers(start)`: whether the prompt from position
    `start` on needs it; `prefill(target, cache, end, progress)` fills the one-sequence cache
    from its length towards position `end` as far as it must (a prompt with images: to its last
    image), hands a head's states to the open capture, and returns how many positions it
    filled; the target's own prefill does the rest."""

    def covers(self, start: int) -> bool: ...

    def prefill(self, target: Any, cache: Cache, end: int,
                progress: Callable[[int], None] | None = None) -> int: ...


@dataclass(frozen=True)
class Token:
    """One generated token. `from_draft`: a draft proposal the target accepted. `logprobs`: the
    target's log-probabilities at this position, (V,), after logits processors and before any
    warp (lazy: computed only if read). `finish_reason`: "eos" or "length" on the last token,
    else None. `stats`: the generation's live statistics object."""

    id: int
    from_draft: bool
    stats: GenerationStats
    logprobs: mx.array | None = None
    finish_reason: str | None = None


@dataclass
class Finished:
    """What a sequence leaves behind: its generated ids, statistics, and (when asked for at
    insert) its one-sequence caches holding prompt + generated[:-1]."""

    uid: int
    tokens: list[int]
    stats: GenerationStats
    target_cache: Cache | None = None
    draft_cache: Cache | None = None


@dataclass
class Row:
    """One sequence. `seq` is prompt + emitted; in the batch its target row holds seq[:-1].
    `tree`: the node budget of its candidate trees (None: it drafts chains)."""

    uid: int
    seq: list[int]
    prompt_len: int
    source: Source
    k_cap: int
    sampling: SamplingParams
    key: mx.array
    eos: frozenset[int]
    max_tokens: int
    processors: Sequence[Processor]
    stats: GenerationStats
    logprobs: bool
    keep_caches: bool
    acceptance: Acceptance | None = None  # k="auto": this row's regime's, shared by its pair
    target_cache: Cache | None = None  # one-sequence caches while the prompt is prefilled
    draft_cache: Cache | None = None
    round_k: int = 0
    draft_key: mx.array | None = None  # this round's keys (None when greedy)
    verify_key: mx.array | None = None
    tree: int | None = None  # a candidate tree's node budget (trees.py); None: a chain
    choice: TreeChoice | None = None  # k="auto" with a budget: which tree or chain, per round
    budget: int | None = None  # this round's tree budget (None: a chain)
    shape: Tree | None = None  # this round's tree
    draft_end: int | None = None  # after a tree round: how far a draft model's view still holds
    prefill: OwnPrefill | None = None  # the prompt's own prefill (None: the target's forward)

    @property
    def generated(self) -> int:
        return len(self.seq) - self.prompt_len

    def split(self) -> None:
        """This round's keys, where the row draws with keys of its own: an unseeded sampled row
        splits two for a drafting round (draft, verify) and one for a plain step with logits
        processors; otherwise its draws are the batch's shared ones or its seed's noise."""
        s = self.sampling
        if s.greedy or s.seed is not None or not (self.round_k or self.processors):
            self.draft_key = self.verify_key = None
        elif self.round_k:
            self.key, self.draft_key, self.verify_key = mx.random.split(self.key, 3)
        else:
            self.key, self.verify_key = mx.random.split(self.key)

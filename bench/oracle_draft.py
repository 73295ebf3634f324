"""A draft with controlled acceptance for benchmarks: it runs a real draft model (paying its full
forward cost) and then, at each position, proposes the target's own greedy continuation with
probability alpha and a token the target will reject otherwise.

It is a plain model callable (`model(inputs, cache=cache)` -> logits, `.layers` for cache sizing),
so it drives tinydraft_mlx.generate and mlx-lm's speculative_generate_step alike. The decision at a
position is a pure function of (seed, position), so rolling back and re-drafting a position, or
another engine drafting it, gives the same proposal: contenders see the same alpha.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class OracleDraft:
    def __init__(self, draft, reference: list[int], alpha: float, seed: int = 0, target=None):
        """reference: prompt + the target's greedy continuation (known in advance). With
        `target`, the right proposal after every position of the reference is the target's
        argmax there (one forward), inside the prompt too: the draft then agrees with the target
        on the prompt as it does later (k="auto" takes that agreement as evidence); without it,
        inside the prompt the right proposal is the prompt's next token."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1] (got {alpha})")
        self.draft, self.reference, self.alpha, self.seed = draft, list(reference), alpha, seed
        self.right = list(self.reference[1:])
        if target is not None:
            logits = target(mx.array(self.reference[:-1], dtype=mx.int32)[None])
            self.right = np.array(mx.argmax(logits[0], axis=-1)).tolist()
        self.layers = draft.layers
        self.args = draft.args

    def _proposal(self, position: int, key: tuple = ()) -> int | None:
        """The token to propose after absolute `position`, or None past the reference; the
        decision is a pure function of (seed, *key, position)."""
        if position + 1 >= len(self.reference):
            return None
        right = self.right[position]
        u = np.random.default_rng([self.seed, *key, position]).random()
        return right if u < self.alpha else (right + 1) % self.args.vocab_size

    def _sequence(self, logits: mx.array, start: int, key: tuple = ()) -> mx.array:
        """(L, V) proposals of one sequence whose first input sits at `start`: a decisive one-hot
        in the draft's dtype where the reference decides, else the draft's own logits."""
        width = logits.shape[-1]
        rows = []
        for j in range(logits.shape[0]):
            token = self._proposal(start + j, key)
            rows.append(logits[j] if token is None else
                        mx.where(mx.arange(width) == token, 30.0, -30.0).astype(logits.dtype))
        return mx.stack(rows)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        start = cache[0].offset if cache else 0
        logits = self.draft(inputs, cache=cache)  # (1, L, V): the real cost
        # the output must still depend on the forward pass, or lazy evaluation would skip its cost
        return mx.depends([self._sequence(logits[0], start)[None]], [logits])[0]


class BatchOracleDraft(OracleDraft):
    """The same for a batch whose rows all decode one prompt (so one reference serves every
    row): each row draws its own decisions, a pure function of (seed, row, position), so rows
    accept different numbers of drafts (ragged rollback, as real batches) and a row re-drafting a
    position gets the same proposal. Called with a `BatchCache`'s layers (B rows, each at its own
    length) or, while a row prefills, with one sequence's caches (decided as row 0)."""

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        batch = getattr(cache[0], "batch", None) if cache else None
        starts = list(batch.lengths) if batch is not None else \
            [cache[0].offset if cache else 0] * inputs.shape[0]
        logits = self.draft(inputs, cache=cache)  # (B, L, V): the real cost
        rows = [self._sequence(logits[b], start, (b,)) for b, start in enumerate(starts)]
        return mx.depends([mx.stack(rows)], [logits])[0]

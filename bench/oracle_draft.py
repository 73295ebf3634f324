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
        self._decided: dict[tuple, np.ndarray] = {}

    def _tokens(self, key: tuple = ()) -> np.ndarray:
        """The proposal after every position of the reference but its last, decided once per
        `key`: at each position a pure function of (seed, *key, position). Decided up front, so
        that a call costs the draft's forward and one vectorised selection: decided row by row
        (a generator and a where over the vocabulary per row) a 60-token catch-up cost 8.6 ms
        where the draft's forward takes 4.5 (demo pair), and the looks k="auto" takes after
        plain rounds were judged on the oracle's overhead, not the draft's."""
        tokens = self._decided.get(key)
        if tokens is None:
            n = len(self.reference) - 1
            u = np.array([np.random.default_rng([self.seed, *key, p]).random() for p in range(n)])
            right = np.array(self.right[:n], dtype=np.int64)
            tokens = self._decided[key] = np.where(
                u < self.alpha, right, (right + 1) % self.args.vocab_size).astype(np.int32)
        return tokens

    def _sequence(self, logits: mx.array, start: int, key: tuple = ()) -> mx.array:
        """(L, V) proposals of one sequence whose first input sits at `start`: a decisive one-hot
        in the draft's dtype where the reference decides (a prefix of the rows), else the
        draft's own logits."""
        tokens = self._tokens(key)[start : start + logits.shape[0]]
        if tokens.size == 0:
            return logits
        decided = mx.where(mx.arange(logits.shape[-1])[None] == mx.array(tokens)[:, None],
                           30.0, -30.0).astype(logits.dtype)
        if tokens.size == logits.shape[0]:
            return decided
        return mx.concatenate([decided, logits[tokens.size :]])

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

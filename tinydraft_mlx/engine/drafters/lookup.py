"""Prompt-lookup drafting: no draft model; propose what followed the latest earlier occurrence of
the current suffix in prompt + output (editing, quoting and code refactoring repeat a lot).

The proposal is deterministic given the sequence, so as a draft distribution it is the point mass
on the proposed token: the greedy rule uses it as any draft, and the stochastic rule accepts it
with probability p(d) and otherwise resamples from p with d removed, which keeps sampling exact.
"""

from __future__ import annotations

from ..sampling import check_int

PROMPT_LOOKUP = "prompt-lookup"  # the draft argument that selects this drafter
NO_DRAFT = "none"  # the draft argument for plain decoding
STARTS = 8  # the latest continuations kept per n-gram (a candidate tree's branches)


class PromptLookup:
    """The drafter: settings only; each generation gets its own `NgramIndex` from `index(seq)`.

    max_ngram / min_ngram: suffix lengths tried, longest first (a longer match predicts better).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        check_int("min_ngram", min_ngram, 1)
        check_int("max_ngram", max_ngram, min_ngram)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def index(self, seq: list[int]) -> NgramIndex:
        return NgramIndex(seq, self.min_ngram, self.max_ngram)

    def __repr__(self) -> str:
        return f"PromptLookup(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"


class NgramIndex:
    """For each n-gram of `seq` that has a continuation, where its latest STARTS continuations
    start (latest last).

    Holds a reference to `seq` (the decode loop's growing list) and catches up on new tokens when
    asked for a proposal: O(max_ngram) work per token, O(1) lookups.
    """

    def __init__(self, seq: list[int], min_ngram: int, max_ngram: int) -> None:
        self.seq, self.min_ngram, self.max_ngram = seq, min_ngram, max_ngram
        self.follows: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # continuations seq[1:indexed] are registered

    def _catch_up(self) -> None:
        seq = self.seq
        for end in range(max(self.indexed, 1), len(seq)):  # n-grams ending just before `end`
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                starts = self.follows.setdefault(tuple(seq[end - n : end]), [])
                starts.append(end)
                if len(starts) > STARTS:
                    del starts[0]
        self.indexed = max(self.indexed, len(seq))

    def propose(self, k: int) -> list[int]:
        """Up to k tokens continuing the longest suffix of `seq` seen earlier; [] if none."""
        self._catch_up()
        seq = self.seq
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            starts = self.follows.get(tuple(seq[-n:]))
            if starts:
                return seq[starts[-1] : starts[-1] + k]
        return []

    def continuations(self, k: int, most: int) -> list[list[int]]:
        """Up to `most` different continuations of up to k tokens, best first: the longest
        matching suffix's, latest first, then shorter suffixes' (`propose`'s is the first)."""
        self._catch_up()
        seq, out = self.seq, []
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            for start in reversed(self.follows.get(tuple(seq[-n:]), [])):
                found = seq[start : start + k]
                if found and found not in out:
                    out.append(found)
                if len(out) == most:
                    return out
        return out

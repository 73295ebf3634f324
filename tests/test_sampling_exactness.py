"""End to end: at temperature 1 with top-p, the first two speculative tokens follow the oracle's
exact two-step distribution.

The oracle enumerates P(a, b) = p1(a) p2(b | a), each factor warped by the independent NumPy warp
(tests/reference.py) from transformers fp32 logits. Our samples come from N independent seeds of
`generate(k=2)`, whose first round drafts two tokens, so both the accept path and the residual
resampling path shape the pair. The same for k="auto" (a plain round, then k = 1) and for
prompt-lookup drafts (point-mass proposals).
Bound: Pearson's chi-square over outcomes (cells with expected count < 5 pooled) against the
Wilson-Hilferty 1 - 3.2e-5 quantile, and any outcome the warp rules out fails outright. The same
samples scored against the distribution without top-p must exceed the threshold, which shows the
test can detect a wrong warp.
"""

from collections import Counter

import numpy as np
import pytest

from tests.reference import chi2_statistic, chi2_threshold, warp_np
from tinydraft_mlx import generate

N = 2500
PROMPT = "def parse_args(self, args=None):"


def _two_step(oracle, ids, **warp_kw):
    p1 = warp_np(oracle.logits(ids)[-1], **warp_kw)
    joint = {}
    for a in np.flatnonzero(p1):
        p2 = warp_np(oracle.logits(ids + [int(a)])[-1], **warp_kw)
        for b in np.flatnonzero(p2):
            joint[(int(a), int(b))] = p1[a] * p2[b]
    return joint


class _PlainThenOne:
    """k="auto" schedule for the test: a plain round, then k = 1 (what the real policy does on
    most machines, but not on all: this makes it certain)."""

    def __init__(self, *args, **kwargs):
        self.rounds = 0

    def choose(self, limit):
        self.rounds += 1
        return 0 if self.rounds == 1 else min(1, limit)

    def update(self, k, accepted, seconds):
        pass


def _case(name, pair, oracle):
    """(draft, k, prompt ids) for each drafter. The prompt-lookup prompt P ends with a trigram
    that occurred earlier followed by tokens (a, b), so the first round drafts a and b as point
    masses (accepted with probability p(d), else resampled); a is made likely after P."""
    target, draft, tok = pair
    ids = tok.encode(PROMPT)
    if name == "model":
        return draft, 2, ids
    if name == "auto":
        return draft, "auto", ids
    # the copied token should be likely where it is proposed: iterate a <- argmax p(. | P(a))
    a, b = oracle.greedy(ids, 2)[0]
    for _ in range(4):
        a = int(np.argmax(oracle.logits(ids + [a, b] + ids[-3:])[-1]))
    return "prompt-lookup", 2, ids + [a, b] + ids[-3:]


@pytest.mark.parametrize("drafter", ["model", "auto", "prompt-lookup"])
@pytest.mark.parametrize("warp_kw", [dict(temperature=1.0, top_p=0.8)])
def test_first_two_tokens_follow_oracle(pair, oracle, warp_kw, drafter, monkeypatch):
    import tinydraft_mlx.speculative as spec

    monkeypatch.setattr(spec, "shared_policy", lambda *args: _PlainThenOne())
    target, _, tok = pair
    draft, k, ids = _case(drafter, pair, oracle)
    exact = _two_step(oracle, ids, **warp_kw)
    assert 10 < len(exact) < 2000  # a real distribution, small enough to be sampled well
    counts, from_draft = Counter(), Counter()
    for seed in range(N):
        out, stats = generate(target, draft, tok, ids, k=k, max_tokens=3, seed=seed,
                              top_p=warp_kw["top_p"], temperature=warp_kw["temperature"])
        counts[tuple(out[:2])] += 1
        from_draft[stats.accepted] += 1
    assert from_draft[0] > 0 and from_draft[1] + from_draft[2] > 0, from_draft  # both paths
    stat, df = chi2_statistic(counts, exact, N)
    assert stat < chi2_threshold(df), (stat, df)

    untruncated = _two_step(oracle, ids, temperature=warp_kw["temperature"])
    wrong_stat, wrong_df = chi2_statistic(counts, untruncated, N)
    assert wrong_stat > chi2_threshold(wrong_df)


def test_same_seed_same_output_and_seeds_differ(pair):
    target, draft, tok = pair
    runs = [generate(target, draft, tok, PROMPT, k=3, max_tokens=24, temperature=1.0, seed=s)[0]
            for s in (11, 11, 12)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]

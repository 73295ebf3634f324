"""End to end: at temperature 1 with top-p, the first two speculative tokens follow the oracle's
exact two-step distribution, with a seed (the Gumbel-max coupling of engine/sampling/seeded.py) and
without one (min(1, p/q) rejection sampling).

The oracle enumerates P(a, b) = p1(a) p2(b | a), each factor warped by the independent NumPy warp
(tests/reference.py) from transformers fp32 logits. Our samples are N rows (in batches of ROWS,
each from a copy of the prompt's prefilled caches) drafting in their first round, so both the
accept path and the residual resampling path shape the pair: k="auto" (a plain round, then
k = 1), a draft whose vocabulary is wider than the target's (its mass beyond the target's width
is always rejected), and a bounded cache (`max_kv_size` below the prompt's length: the exact
joint then comes from a brute-force windowed forward pass, tests/reference.py, and the unbounded
joint must be rejected), seeded. Every registered drafter (a draft model, prompt lookup, the
hybrid, the heads, plug-ins) is sampled the same way in tests/test_drafters.py.
Bound: Pearson's chi-square over outcomes (cells with expected count < 5 pooled) against the
Wilson-Hilferty 1 - 3.2e-5 quantile, and any outcome the warp rules out fails outright. The same
samples scored against the distribution without top-p must exceed the threshold, which shows the
test can detect a wrong warp.
"""

import pytest

from tests.reference import check_first_two_tokens, two_step_joint, windowed_logits
from tests.scripted import scripted
from tinydraft_mlx import BatchDecoder, Hybrid, SamplingParams, generate
from tinydraft_mlx.generation.prompt_cache import MARGIN

pytestmark = pytest.mark.usefixtures("cpu_fp32")

N = 2500
ROWS = 125  # rows per batch: N / ROWS batches
PROMPT = "def parse_args(self, args=None):"
WINDOW = 12  # max_kv_size of the bounded case; its prompt is longer


def _case(name, pair, load):
    """(draft model, k, prompt ids, max_kv_size) for each case."""
    target, draft, tok = pair
    ids = tok.encode(PROMPT)
    if name == "auto":
        return draft, "auto", ids, None
    if name == "wide":
        return load("target", "wide_draft")[1], 2, ids, None
    assert name == "bounded"
    return draft, 2, tok.encode("x = 1\n" + PROMPT), WINDOW


@pytest.mark.parametrize("drafter,seeded", [("auto", False), ("wide", False), ("bounded", True)])
@pytest.mark.parametrize("warp_kw", [dict(temperature=1.0, top_p=0.8)])
def test_first_two_tokens_follow_oracle(pair, oracle, load, warp_kw, drafter, seeded,
                                        monkeypatch):
    scripted(monkeypatch, (1,))  # k="auto" drafting k = 1 (what the policy may well choose)
    target, _, tok = pair
    draft, k, ids, bound = _case(drafter, pair, load)
    if bound is not None:  # the window's exact joint; the unbounded one is what must be told apart
        assert len(ids) > WINDOW + 4
        exact = two_step_joint(lambda s: windowed_logits(target, s, WINDOW), ids, **warp_kw)
        wrong = two_step_joint(oracle.logits, ids, **warp_kw)
    else:  # the exact joint; without top-p is what must be told apart
        exact = two_step_joint(oracle.logits, ids, **warp_kw)
        wrong = two_step_joint(oracle.logits, ids, temperature=warp_kw["temperature"])
    assert 10 < len(exact) < 2000  # a real distribution, small enough to be sampled well

    def make():
        return BatchDecoder(target, draft, max_kv_size=bound, max_k=MARGIN - 1)

    check_first_two_tokens(make, ids, "model", N, exact, wrong, rows=ROWS, k=k,
                           sampling=lambda seed: SamplingParams(
                               warp_kw["temperature"], warp_kw["top_p"],
                               seed=seed if seeded else None))


@pytest.mark.parametrize("temperature,top_k", [(0.7, 20), (1.0, 0)])
def test_a_seed_fixes_the_text(pair, temperature, top_k, monkeypatch):
    """A seeded text is plain decoding's with that seed: the same with any drafter, any k
    (fixed, or k="auto" with any schedule), alone or beside other sequences in a batch."""
    from tinydraft_mlx import batch_generate

    target, draft, tok = pair
    kw = dict(max_tokens=24, temperature=temperature, top_k=top_k, seed=7)
    plain, _ = generate(target, None, tok, PROMPT, **kw)
    drafted = 0
    for source, k in [(draft, 1), (draft, 4), ("prompt-lookup", 3), (Hybrid(draft), 2)]:
        out, stats = generate(target, source, tok, PROMPT, k=k, **kw)
        assert out == plain, (source, k)
        drafted += stats.drafted
    assert drafted > 0
    scripted(monkeypatch, (0, 3, 1, 0, 2))  # k="auto" choosing anything, round after round
    assert generate(target, draft, tok, PROMPT, k="auto", **kw)[0] == plain
    outs = batch_generate(target, draft, tok, ["x = [", PROMPT, "import os"], k=2,
                          max_tokens=24, temperature=temperature, top_k=top_k, seed=[1, 7, 2])
    assert outs[1][0] == plain
    assert generate(target, None, tok, PROMPT, **{**kw, "seed": 8})[0] != plain


def test_same_seed_same_output_and_seeds_differ(pair):
    target, draft, tok = pair
    runs = [generate(target, draft, tok, PROMPT, k=3, max_tokens=24, temperature=1.0, seed=s)[0]
            for s in (11, 11, 12)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]

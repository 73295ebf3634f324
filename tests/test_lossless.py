"""Greedy speculative output equals the transformers CPU fp32 oracle, token for token.

The fixture pair (tests/fixtures.py) is a 4-layer target with a 2-layer draft of narrower logit
width, sharing one tokenizer, written by transformers 5 and loaded through load_models. Runs on
the CPU in float32, the oracle's device and precision.
"""


import mlx.core as mx
import pytest

from tests.fixtures import TARGET_WIDTH
from tests.scripted import scripted
from tinydraft_mlx import Hybrid, PromptLookup, generate
from tinydraft_mlx.engine.drafters import HybridDraft

pytestmark = pytest.mark.usefixtures("cpu_fp32")

PROMPTS = [
    "def parse_args(self, args=None, namespace=None):",
    "import os\nimport sys\n\nclass Encoder(object):",
    "    for line in text.splitlines():\n        if",
    "# Copyright 2001 by the Python Software Foundation",
]
NEW_TOKENS = 48
MIN_MARGIN = 1e-3  # frameworks agree to ~1e-5 in fp32; a greedy match is meaningful above this


@pytest.fixture(scope="module")
def references(pair, oracle):
    """The oracle's greedy continuation of each prompt, checked to be a meaningful reference."""
    _, _, tok = pair
    refs = {}
    for text in PROMPTS:
        ids = tok.encode(text)
        ref, margin = oracle.greedy(ids, NEW_TOKENS, eos=tok.eos_token_id)
        assert len(ref) == NEW_TOKENS, "fixture stopped early"
        assert len(set(ref)) >= 8, f"degenerate reference {ref}"
        assert margin > MIN_MARGIN, f"near-tie on the path ({margin:.2e}): fixture unusable"
        refs[text] = (ids, ref)
    return refs


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_matches_oracle(pair, references, k):
    target, draft, tok = pair
    total_accepted = 0
    for ids, ref in references.values():
        out, stats = generate(target, draft, tok, ids, k=k, max_tokens=NEW_TOKENS)
        assert out == ref
        assert stats.generated == NEW_TOKENS and stats.finish_reason == "length"
        total_accepted += stats.accepted
    assert total_accepted > 0  # the draft really contributed tokens


def test_plain_decoding_matches_oracle(pair, references):
    target, _, tok = pair
    for ids, ref in references.values():
        out, stats = generate(target, None, tok, ids, max_tokens=NEW_TOKENS)
        assert out == ref
        assert stats.drafted == 0 and stats.rounds == NEW_TOKENS


def test_string_prompt_matches_oracle(pair, references):
    target, draft, tok = pair
    text = PROMPTS[0]
    out, _ = generate(target, draft, tok, text, k=3, max_tokens=NEW_TOKENS)
    assert out == references[text][1]


def test_identical_draft_accepts_everything(load, references):
    target, same, tok = load("target", "target")
    for ids, ref in references.values():
        out, stats = generate(target, same, tok, ids, k=4, max_tokens=NEW_TOKENS)
        assert out == ref
        assert stats.acceptance_rate == 1.0
        assert stats.per_position_acceptance == [1.0] * 4


def test_unrelated_draft_still_matches(load, references):
    target, unrelated, tok = load("target", "unrelated")
    accepted = drafted = 0
    for ids, ref in references.values():
        out, stats = generate(target, unrelated, tok, ids, k=4, max_tokens=NEW_TOKENS)
        assert out == ref
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
    assert accepted / drafted < 0.05


class _InputGuard:
    """The target, recording the largest id fed to it (a model as the decode loop sees one)."""

    def __init__(self, model):
        self.model, self.layers, self.args = model, model.layers, model.args
        self.max_id = -1

    def __call__(self, x, cache=None):
        self.max_id = max(self.max_id, int(x.max()))
        return self.model(x, cache=cache)


def test_draft_wider_than_target(load, references):
    """A draft whose vocabulary is wider than the target's proposes ids the target's embedding
    lacks: they must never reach the target (clamped for the verify pass, an out-of-bounds read
    otherwise), never be accepted, and the output must stay the oracle's."""
    target, wide, tok = load("target", "wide_draft")
    ids, _ = references[PROMPTS[0]]
    proposals = mx.argmax(wide(mx.array([ids]))[0], axis=-1)
    assert int(proposals.max()) >= TARGET_WIDTH, "fixture: the draft should propose such ids"
    guarded = _InputGuard(target)
    accepted = 0
    for ids, ref in references.values():
        for k in (1, 4):
            out, stats = generate(guarded, wide, tok, ids, k=k, max_tokens=NEW_TOKENS)
            assert out == ref
            accepted += stats.accepted
    assert guarded.max_id < TARGET_WIDTH
    assert accepted > 0  # in-range proposals are still accepted


@pytest.mark.parametrize("k", [2, 5, "auto"])
def test_prompt_lookup_matches_oracle(pair, references, k):
    """Unigram matches make lookup draft often here; a random model rarely copies, so this mostly
    exercises rejections. Accepted copies are covered on the trained demo pair (test_demo)."""
    target, _, tok = pair
    drafted = 0
    for ids, ref in references.values():
        out, stats = generate(target, PromptLookup(min_ngram=1), tok, ids, k=k,
                              max_tokens=NEW_TOKENS)
        assert out == ref
        drafted += stats.drafted
    if k != "auto":  # auto may (correctly) stop drafting when lookup keeps failing
        assert drafted > 0


@pytest.mark.parametrize("k", [2, 5])
def test_hybrid_matches_oracle(pair, references, k):
    """Prompt lookup (unigram matches: it proposes often, and is mostly rejected by this random
    pair) and the draft model in one generation: each round from one of them, the output the
    oracle's; both sources are used."""
    target, draft, tok = pair
    rounds = {"prompt-lookup": 0, "model": 0}
    for ids, ref in references.values():
        drafter = HybridDraft(Hybrid(draft, PromptLookup(min_ngram=1)))
        out, stats = generate(target, drafter, tok, ids, k=k, max_tokens=NEW_TOKENS)
        assert out == ref
        for source, recent in drafter.recent.items():
            rounds[source] += recent.rounds
    assert rounds["prompt-lookup"] > 0 and rounds["model"] > 0, rounds


SCHEDULE = (0, 0, 0, 0, 3, 1, 0, 8, 2, 0, 0, 5, 1, 1, 4)  # long plain stretches, k up to 8


@pytest.mark.parametrize("drafter", ["model", "prompt-lookup", "hybrid"])
def test_auto_with_any_schedule_matches_oracle(pair, references, drafter, monkeypatch):
    """k="auto" only changes k between rounds; any schedule of k must stay exact (the draft falls
    behind in plain stretches and catches up). A scripted schedule makes that independent of
    this machine's timings."""
    scripted(monkeypatch, SCHEDULE)
    target, draft, tok = pair
    for ids, ref in references.values():
        d = {"model": draft, "hybrid": Hybrid(draft, PromptLookup(min_ngram=1))}.get(
            drafter, drafter)
        out, stats = generate(target, d, tok, ids, k="auto", max_tokens=NEW_TOKENS)
        assert out == ref
        assert sum(stats.k_histogram.values()) == stats.rounds
        if drafter == "model":
            assert set(stats.k_histogram) >= {0, 1, 8} and len(stats.k_histogram) >= 4


def test_the_default_k_is_auto_and_matches_oracle(pair, references):
    """No k given: the API drafts with k="auto" (the default) and stays the oracle's greedy
    output."""
    target, draft, tok = pair
    for ids, ref in references.values():
        out, stats = generate(target, draft, tok, ids, max_tokens=NEW_TOKENS)
        assert out == ref and stats.k == "auto"


def test_auto_with_its_real_policy_matches_oracle(pair, references):
    target, draft, tok = pair
    for ids, ref in references.values():
        out, stats = generate(target, draft, tok, ids, k="auto", max_tokens=NEW_TOKENS)
        assert out == ref
        assert stats.policy is not None  # one policy per (target, draft) pair


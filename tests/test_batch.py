"""Batched speculative decoding (`BatchDecoder`, `batch_generate`): every sequence exact whatever
shares its batch.

Greedy: each sequence's tokens equal the transformers fp32 oracle's greedy continuation (fixture
pair, prompts of different lengths with clear top-1/top-2 margins on the path) and the same
prompt decoded alone, for B in {1, 2, 3, 8} and k in {1, 3, 6, auto}, with sequences finishing
early (EOS, max_tokens, a stop string) while others go on, sequences joining and leaving between
rounds, mixed draft kinds, bounded caches, logits processors (against mlx-lm's own plain loop),
prompt caches in and out, a pruned draft.
Sampling: the joint of the first two tokens of a sequence sampled inside batches of mixed
settings against the oracle's exact joint (chi-square, the bound of test_sampling_exactness).
Seeds: a seeded sequence's tokens do not depend on its batch.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from tests.reference import (
    assert_first_two,
    chi2_statistic,
    chi2_threshold,
    drain_first_two,
    insert_from,
    prefilled,
    warp_np,
)
from tests.scripted import scripted
from tests.test_api import PENALTIES, _reference_with_processors
from tinydraft_mlx import (
    BatchDecoder,
    Hybrid,
    ParameterError,
    PromptCache,
    PromptLookup,
    SamplingParams,
    batch_generate,
    generate,
)
from tinydraft_mlx.engine.cache import make_cache, rollback
from tinydraft_mlx.engine.cache.batch import BatchCache
from tinydraft_mlx.engine.forward import forward, forward_batch, prefill
from tinydraft_mlx.engine.speculative import decode

pytestmark = pytest.mark.usefixtures("cpu_fp32")

TEXTS = [
    "def parse_args(self, args=None, namespace=None):",
    "import os\nimport sys\n\nclass Encoder(object):",
    "    for line in text.splitlines():\n        if",
    "# Copyright 2001 by the Python Software Foundation",
    "x = ",
    "        return self._format_usage(usage, actions, groups, prefix)",
    "class",
    "import json",
]
NEW = 40
MIN_MARGIN = 1e-3
MAX_TOKENS = [40, 17, 40, 29, 40, 8, 33, 40]  # row i's max_tokens: rows finish at different times


@pytest.fixture(scope="module")
def refs(pair, oracle):
    """prompt ids and the oracle's greedy continuation (NEW tokens, clear margins) per text."""
    _, _, tok = pair
    out = []
    for text in TEXTS:
        ids = tok.encode(text)
        ref, margin = oracle.greedy(ids, NEW)
        assert len(set(ref)) >= 6 and margin > MIN_MARGIN, (text, margin)
        out.append((ids, ref))
    assert len({len(ids) for ids, _ in out}) >= 6  # prompts of different lengths
    return out


def _drain(decoder: BatchDecoder, uids: list[int]) -> dict[int, list[int]]:
    """Step until every sequence has finished; the tokens of `uids`."""
    out = {uid: [] for uid in uids}
    while len(decoder):
        for uid, tokens in decoder.step().items():
            if uid in out:
                out[uid] += [t.id for t in tokens]
    return out


def _solo(target, draft, ids, **kw) -> list[int]:
    return [t.id for t in decode(target, draft, ids, **kw)]


# -- the batch cache ------------------------------------------------------------------------------

@pytest.mark.parametrize("bound", [None, 24])
def test_batch_cache_rows_match_one_sequence_caches(pair, bound):
    """Ragged rows, each fed 3 tokens and rolled back by its own amount, over 14 rounds (the
    bounded rows wrap): logits equal one-sequence caches' to float rounding, and a row taken
    out continues as its own cache would."""
    target, _, _ = pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 300, n).tolist() for n in (3, 21, 12)]
    solo = [make_cache(target, bound, 4) for _ in prompts]
    batch = BatchCache(len(target.layers), bound, margin=4)
    for ids, cache in zip(prompts, solo):
        prefill(target, cache, ids)
    batch.add(solo[:1])
    batch.add(solo[1:])  # joining one by one or together
    for _ in range(14):
        x = rng.integers(0, 300, (3, 3))
        ours = forward_batch(target, mx.array(x), batch)
        for i, cache in enumerate(solo):
            theirs = forward(target, mx.array(x[i : i + 1]), cache)[0]
            assert mx.abs(ours[i] - theirs).max().item() < 1e-4
        keep = rng.integers(1, 4, 3)
        for cache, kept in zip(solo, keep):
            rollback(cache, cache[0].offset - 3 + int(kept))
        batch.rollback([n - 3 + int(kept) for n, kept in zip(batch.lengths, keep)])
        assert batch.lengths == [c[0].offset for c in solo]
    assert bound is None or min(batch.lengths) > bound  # the rings wrapped
    rest = batch.lengths[1:]
    row = batch.extract(1)
    x = mx.array([[7, 8]])
    assert mx.abs(forward(target, x, row) - forward(target, x, solo[1])).max().item() < 1e-4
    batch.remove([0])
    assert batch.lengths == rest


# -- greedy ---------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 6, "auto"])
@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_greedy_batch_equals_the_oracle_and_each_prompt_alone(pair, refs, size, k):
    """Row 1 ends at an EOS (a token its path emits), the others at their own max_tokens."""
    target, draft, tok = pair
    decoder = BatchDecoder(target, draft)
    rows = []
    for i in range(size):
        ids, ref = refs[i]
        eos = {ref[6]} if i == 1 else set()
        expect = ref[: MAX_TOKENS[i]]
        if eos:
            expect = ref[: ref.index(ref[6]) + 1]
        uid = decoder.insert(ids, draft="model", k=k, max_tokens=MAX_TOKENS[i],
                             eos_token_ids=eos)
        rows.append((uid, ids, eos, expect))
    out = _drain(decoder, [r[0] for r in rows])
    for i, (uid, ids, eos, expect) in enumerate(rows):
        assert out[uid] == expect
        assert out[uid] == _solo(target, draft, ids, k=k, max_tokens=MAX_TOKENS[i],
                                 eos_token_ids=eos)


def test_batch_mixes_draft_kinds_ks_and_plain_rows(pair, refs):
    """Model drafts at k 2 and 5, auto, prompt lookup, none, hybrid (its lookup on unigrams:
    lookup and model rounds mixed in one row): one batch, each row its oracle."""
    target, draft, tok = pair
    decoder = BatchDecoder(target, draft)
    kinds = [("model", 2), ("model", 5), ("model", "auto"), (PromptLookup(), 4), (None, 4),
             ("prompt-lookup", "auto"), ("hybrid", 3), (Hybrid(draft, PromptLookup(1, 1)), 4)]
    uids = [decoder.insert(refs[i][0], draft=kind, k=k, max_tokens=NEW)
            for i, (kind, k) in enumerate(kinds)]
    out = _drain(decoder, uids)
    for i, uid in enumerate(uids):
        assert out[uid] == refs[i][1], kinds[i]


@pytest.mark.parametrize("kind", ["model", None])
def test_sequences_join_and_leave_between_rounds(pair, refs, kind):
    """With kind None every round is plain and pipelined (the next round queued before this
    one is read): joining waits for the queued round, leaving drops the row from it."""
    target, draft, tok = pair
    decoder = BatchDecoder(target, draft, prefill_step=8)  # long prompts take several steps
    out: dict[int, list[int]] = {}
    first = [decoder.insert(refs[i][0], draft=kind, k=3, max_tokens=NEW) for i in (0, 1)]
    for uid in first:
        out[uid] = []
    later, gone = [], None
    for step in range(200):
        if step == 3:
            later = [decoder.insert(refs[i][0], draft=kind, k=2, max_tokens=NEW)
                     for i in (2, 5)]
            out.update({uid: [] for uid in later})
        queued = decoder._queued is not None
        if gone is None and len(out[first[1]]) >= 3 and (kind is not None or queued):
            gone = decoder.remove(first[1])  # plain rows: while a round is queued
            assert gone.tokens == out[first[1]] and gone.stats.finish_reason == "closed"
        for uid, tokens in decoder.step().items():
            assert uid != first[1] or gone is None
            assert uid not in later or step > 3
            out[uid] += [t.id for t in tokens]
        if not len(decoder):
            break
    assert gone is not None
    assert out[first[0]] == refs[0][1]
    assert out[later[0]] == refs[2][1] and out[later[1]] == refs[5][1]
    assert 0 < len(out[first[1]]) < NEW and out[first[1]] == refs[1][1][: len(out[first[1]])]


def test_bounded_batch_equals_bounded_decoding_alone(pair, refs):
    """max_kv_size below the prompts' length + output: each row as `generate` gives it with the
    same bound (itself checked against a windowed oracle in test_rotating_cache)."""
    target, draft, tok = pair
    prompts = [refs[i][0] for i in (0, 1, 5)]
    out = batch_generate(target, draft, tok, prompts, k=3, max_tokens=30, max_kv_size=16)
    for ids, (tokens, _) in zip(prompts, out):
        assert tokens == generate(target, draft, tok, ids, k=3, max_tokens=30,
                                  max_kv_size=16)[0]
        assert len(ids) + 30 > 16 + 8
    assert out[0][0] != refs[0][1][:30]  # the bound really changed the output


def test_processors_in_a_batch_match_mlx_lm_plain_loop(pair, refs):
    target, draft, tok = pair
    prompts = [refs[i][0] for i in (0, 2, 3)]
    out = batch_generate(target, draft, tok, prompts, k=3, max_tokens=24, **PENALTIES)
    for ids, (tokens, _) in zip(prompts, out):
        expected, margin = _reference_with_processors(target, ids, 24, **PENALTIES)
        assert margin > MIN_MARGIN
        assert tokens == expected


def test_batch_generate_stops_and_lists_per_prompt(pair, refs):
    target, draft, tok = pair
    prompts = [TEXTS[0], TEXTS[1], TEXTS[2]]
    stop_text = tok.decode(refs[1][1][8:10])
    out = batch_generate(target, draft, tok, prompts, k=4, max_tokens=[12, NEW, 20],
                         stop=[None, [stop_text], None])
    assert out[0][0] == refs[0][1][:12] and out[0][1].finish_reason == "length"
    assert out[2][0] == refs[2][1][:20]
    tokens, stats = out[1]
    assert stats.finish_reason == "stop"
    assert tokens == generate(target, draft, tok, prompts[1], k=4, max_tokens=NEW,
                              stop=stop_text)[0]
    assert len(tokens) < NEW


def test_prompt_caches_in_and_out_of_a_batch(pair, refs):
    target, draft, tok = pair
    caches = [PromptCache(target, draft) for _ in range(3)]
    prompts = [refs[i][0] for i in (0, 1, 2)]
    batch_generate(target, draft, tok, prompts, k=3, max_tokens=[10, 20, 15], prompt_cache=caches)
    for cache, ids, n in zip(caches, prompts, [10, 20, 15]):
        assert cache.tokens[: len(ids)] == ids and len(cache.tokens) == len(ids) + n
        assert cache.target_cache[0].offset == len(cache.tokens) - 1
        assert not cache.in_use
    follow = [c.tokens + refs[3][0] for c in caches]
    out = batch_generate(target, draft, tok, follow, k=3, max_tokens=12, prompt_cache=caches)
    for ids, (tokens, stats) in zip(follow, out):
        assert stats.cached_tokens == len(ids) - len(refs[3][0]) - 1  # all but the last
        assert tokens == generate(target, draft, tok, ids, k=3, max_tokens=12)[0]


def test_a_pruned_draft_in_a_batch(pair, refs):
    from tests.test_pruning import TEXT
    from tinydraft_mlx.engine.pruning import prune_draft
    from tinydraft_mlx.programs.vocab import count_tokens, save_counts

    target, draft, tok = pair
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "counts.json"
        save_counts(path, tok, count_tokens(tok, TEXT * 3))
        pruned = prune_draft(draft, tok, 40, path)
    prompts = [refs[i][0] for i in (0, 1, 2)]
    out = batch_generate(target, pruned, tok, prompts, k=3, max_tokens=NEW)
    assert [t for t, _ in out] == [refs[i][1] for i in (0, 1, 2)]
    assert sum(s.accepted for _, s in out) > 0


# -- sampling -----------------------------------------------------------------------------------

N = 2400
ROWS = 48  # sequences under test per batch, beside companions of other settings
PROMPT = "def parse_args(self, args=None):"


@pytest.mark.parametrize("seeded", [True, False])
def test_first_two_tokens_follow_the_oracle_inside_mixed_batches(pair, oracle, seeded):
    """Every batch: 48 sequences at T=1, top-p 0.8, k=2 and 4 companions at other settings
    (greedy, T=0.5, T=1.5 with top-k 20, prompt lookup at T=0.7, k=auto), all finishing at
    different times. The test sequences' first two tokens follow the exact joint; the joint
    without top-p is rejected (the samples can tell them apart). Seeded sequences draw with
    their own keys; unseeded ones (seed None) draw together from the decoder's key."""
    target, draft, tok = pair
    ids = tok.encode(PROMPT)
    joint, wrong = {}, {}
    p1, w1 = (warp_np(oracle.logits(ids)[-1], **kw) for kw in
              (dict(temperature=1.0, top_p=0.8), dict(temperature=1.0)))
    for a in np.flatnonzero(w1):
        last = oracle.logits(ids + [int(a)])[-1]
        p2, w2 = warp_np(last, temperature=1.0, top_p=0.8), warp_np(last, temperature=1.0)
        for b in np.flatnonzero(w2):
            wrong[(int(a), int(b))] = w1[a] * w2[b]
            if p1[a] > 0 and p2[b] > 0:
                joint[(int(a), int(b))] = p1[a] * p2[b]
    assert 10 < len(joint) < 2000
    companions = [(SamplingParams(), "model", 3), (SamplingParams(0.5, seed=1), "model", "auto"),
                  (SamplingParams(1.5, top_k=20), "model", 4),
                  (SamplingParams(0.7), "prompt-lookup", 2)]
    counts, paths = Counter(), Counter()
    cache = prefilled(lambda: BatchDecoder(target, draft), ids, "model")  # rows start from copies
    for batch in range(N // ROWS):
        decoder = BatchDecoder(target, draft)
        uids = []
        for j in range(ROWS):
            sampling = SamplingParams(1.0, top_p=0.8, seed=batch * ROWS + j if seeded else None)
            uids.append(insert_from(decoder, cache, ids, draft="model", k=2, max_tokens=3,
                                    sampling=sampling))
            if j % 12 == 0:
                s, kind, k = companions[(batch + j // 12) % len(companions)]
                decoder.insert(tok.encode(TEXTS[j // 12]), draft=kind, k=k,
                               max_tokens=2 + j // 6, sampling=s)
        drain_first_two(decoder, uids, counts, paths)
    assert_first_two(counts, paths, joint, wrong)  # both paths shape the pair


def test_unseeded_plain_rows_drawn_together_follow_the_oracle(pair, oracle):
    """Unseeded plain rows at a temperature alone are drawn in one categorical over the scaled
    logits: 2400 first tokens (rows of 48-row batches, beside a seeded and a top-p companion)
    against the oracle's softmax(x / 0.8); softmax(x / 1.1) must be rejected."""
    target, _, tok = pair
    ids = tok.encode(PROMPT)
    last = oracle.logits(ids)[-1]
    exact, wrong = (warp_np(last, temperature=t) for t in (0.8, 1.1))
    counts = Counter()
    for _ in range(50):
        decoder = BatchDecoder(target)
        uids = [decoder.insert(ids, max_tokens=1, sampling=SamplingParams(0.8))
                for _ in range(48)]
        decoder.insert(ids, max_tokens=2, sampling=SamplingParams(0.8, seed=3))
        decoder.insert(ids, max_tokens=2, sampling=SamplingParams(0.8, top_p=0.5))
        out = _drain(decoder, uids)
        counts.update(out[uid][0] for uid in uids)
    n = sum(counts.values())
    probs = {i: float(p) for i, p in enumerate(exact) if p > 0}
    stat, df = chi2_statistic(counts, probs, n)
    assert stat < chi2_threshold(df), (stat, df)
    wrong_stat, wrong_df = chi2_statistic(counts, {i: float(p) for i, p in enumerate(wrong)}, n)
    assert wrong_stat > chi2_threshold(wrong_df)
    assert len(counts) > 5


# -- seeds ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["model", "hybrid"])
def test_a_seeded_sequence_does_not_depend_on_its_batch(pair, refs, kind):
    """Alone, beside one other, among 7 others of mixed settings, joining late: the same tokens,
    and `generate`'s with that seed."""
    target, draft, tok = pair
    solo = draft if kind == "model" else Hybrid(draft)
    ids = refs[0][0]
    mine = SamplingParams(1.0, top_p=0.9, seed=1234)

    def run(others: int, late: bool) -> list[int]:
        decoder = BatchDecoder(target, draft)
        companions = [decoder.insert(refs[1 + i % 7][0], draft="model", k=1 + i % 4,
                                     max_tokens=10 + 5 * i,
                                     sampling=SamplingParams(0.3 + 0.2 * i, seed=i))
                      for i in range(others)]
        if late:
            for _ in range(3):
                decoder.step()
        uid = decoder.insert(ids, draft=kind, k=3, max_tokens=30, sampling=mine)
        return _drain(decoder, [uid, *companions])[uid]

    alone = run(0, False)
    assert len(set(alone)) > 5
    assert run(1, False) == alone
    assert run(7, False) == alone
    assert run(7, True) == alone
    assert alone == generate(target, solo, tok, ids, k=3, max_tokens=30, temperature=1.0,
                             top_p=0.9, seed=1234)[0]
    other = SamplingParams(1.0, top_p=0.9, seed=1235)
    decoder = BatchDecoder(target, draft)
    uid = decoder.insert(ids, draft="model", k=3, max_tokens=30, sampling=other)
    assert _drain(decoder, [uid])[uid] != alone


# -- arguments --------------------------------------------------------------------------------

def test_auto_rows_count_their_catch_ups(pair, refs, monkeypatch):
    """A k="auto" row that drafts again after plain rounds first catches its draft up on them
    (one batched forward, part of the round's graph): each such switch is counted in its
    statistics, as the one-sequence loop counts its own, and not timed (the batch's round is one
    graph); a plain row counts none. The schedule: 5 plain rounds, then 2 drafting (the draft,
    prefilled with the prompt, has then missed at least 3 tokens: a catch-up every time)."""
    calls = scripted(monkeypatch, (0, 0, 0, 0, 0, 2, 2))  # one call per round, in order
    target, draft, _ = pair
    decoder = BatchDecoder(target, draft)
    auto = [decoder.insert(refs[i][0], draft="model", k="auto", max_tokens=NEW) for i in (0, 2)]
    plain = decoder.insert(refs[1][0], draft=None, k=4, max_tokens=NEW)
    out: dict[int, list[int]] = {uid: [] for uid in [*auto, plain]}
    last = {}
    while len(decoder):
        for uid, tokens in decoder.step().items():
            out[uid] += [t.id for t in tokens]
            last[uid] = tokens[-1].stats
    for uid, i in zip(auto, (0, 2)):
        assert out[uid] == refs[i][1]
        stats = last[uid]
        rounds = [k for _, k in calls][: stats.rounds]  # both rows were there from the first
        switches = sum(1 for a, b in zip(rounds, rounds[1:]) if a == 0 and b > 0)
        assert switches >= 2 and stats.catch_ups == switches, (rounds, stats.catch_ups)
        assert stats.catch_up_seconds == 0.0
        summary = stats.summary()
        assert f"{switches} catch-ups" in summary and "catch-ups in" not in summary
    assert out[plain] == refs[1][1] and last[plain].catch_ups == 0


def test_auto_rows_of_different_pairs_choose_and_book_with_their_own_policies(pair, refs):
    """Two k="auto" rows of different pairs in one batch (the draft model; prompt lookup): each
    pair's policy books the batch's rounds (its costs at this batch size) and each pair's
    acceptance its own row's drafts, and the rows keep the oracle's greedy text."""
    from tinydraft_mlx import PromptLookup
    from tinydraft_mlx.engine.policy import batch_bucket, shared_policy

    target, draft, _ = pair
    lookup = PromptLookup()
    decoder = BatchDecoder(target, draft)
    model_row = decoder.insert(refs[0][0], draft="model", k="auto", max_tokens=NEW)
    lookup_row = decoder.insert(refs[1][0] * 2, draft=lookup, k="auto", max_tokens=NEW)
    out = _drain(decoder, [model_row, lookup_row])
    assert out[model_row] == refs[0][1]
    policies = [shared_policy(target, draft), shared_policy(target, repr(lookup))]
    assert policies[0] is not policies[1]
    for policy in policies:
        costs = policy.costs.get(batch_bucket(2))
        assert costs is not None and sum(costs.timed(k) for k in costs.timings) > 0
        assert sum(a.reached[0] for a in policy.regimes.values()) > 0


def test_batch_generate_refuses_bad_arguments(pair):
    target, draft, tok = pair
    cache = PromptCache(target, draft)
    bad = [
        (dict(prompts=[]), "prompts"),
        (dict(prompts="x"), "prompts"),
        (dict(max_tokens=[3, 4, 5]), "max_tokens"),
        (dict(seed=[1]), "seed"),
        (dict(prompt_cache=[cache, cache]), "prompt_cache"),
        (dict(k=0), "k"),
        (dict(temperature=-1), "temperature"),
        (dict(stop=[["a"], 3]), "stop"),
    ]
    for kwargs, name in bad:
        prompts = kwargs.pop("prompts", ["a b", "c d"])
        with pytest.raises(ParameterError, match=name):
            batch_generate(target, draft, tok, prompts, **kwargs)
    assert not cache.in_use


def test_batch_decoder_refuses_bad_sequences(pair, load):
    target, draft, tok = pair
    other = load("target", "wide_draft")[1]
    with pytest.raises(ParameterError, match='draft must be not "model"'):
        BatchDecoder(target).insert([1, 2], draft="model")
    decoder = BatchDecoder(target, draft)
    with pytest.raises(ParameterError, match="draft must be"):
        decoder.insert([1, 2], draft=other)  # a model the decoder does not hold
    with pytest.raises(ParameterError, match="prompt must be at least one token"):
        decoder.insert([], draft="model")
    assert len(decoder) == 0  # nothing half-inserted

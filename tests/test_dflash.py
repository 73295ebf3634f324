"""DFlash and DFlash2 block drafters (engine/drafters/dflash.py, blocks.py).

The drafter itself against z-lab's reference (`dflash` 0.1.0, PyTorch, CPU, float32): outputs it
computed on tiny random drafters in its own checkpoint layout, recorded with the script that made
them (tests/dflash_reference/make.py; the package pins versions that conflict with ours, so it
is not part of the test extra). Per-position logits equal to float32 rounding (max |diff| below
2e-5 on logits of magnitude ~10) whether the context arrives in one forward, partly cached, or
as rows of a batch with different cached and new lengths; DFlash2's candidates and the q its
selector samples from, along the reference's own sampled path.

Then the drafter in the engine, on the tiny Qwen3 target of conftest.py's `eagle` with a DFlash
drafter trained a little here on the target's own outputs (tests/fixtures.py's `write_dflash`):
greedy == the transformers fp32 oracle for k in {1, 3, 7} and "auto", one sequence and batches of
3 and 8 (mixed with other drafters' rows); the sampled first two tokens' joint against the
oracle's exact joint (chi-square, tests/reference.py's bound) alone and in a mixed batch; a seed
fixes the text (seeded speculative == seeded plain); the prompt cache, the server and the
refusals.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tinydraft_mlx.engine.cache.batch import BatchCache
from tinydraft_mlx.engine.drafters.dflash import load_dflash

REFERENCE = __import__("pathlib").Path(__file__).parent / "dflash_reference"
TOLERANCE = 2e-5


class _Body(nn.Module):
    def __init__(self, embed: mx.array) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(*embed.shape)
        self.embed_tokens.weight = embed
        self.layers = [nn.Identity() for _ in range(6)]
        self.norm = nn.RMSNorm(embed.shape[1])


class _Target(nn.Module):
    """What a DFlash drafter uses of its target: embeddings, LM head, six layers, a final
    norm (a stand-in: the reference's inputs are given, not computed by a target)."""

    def __init__(self, embed: mx.array, head: mx.array) -> None:
        super().__init__()
        self.model = _Body(embed)
        self.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False)
        self.lm_head.weight = head

    @property
    def layers(self):
        return self.model.layers


def _reference(name: str):
    ref = mx.load(str(REFERENCE / f"{name}.safetensors"))
    target = _Target(ref["embed"], ref["head"])
    return load_dflash(target, REFERENCE / name), ref


def _close(ours: mx.array, theirs: mx.array) -> None:
    diff = float(mx.abs(ours - theirs).max())
    assert diff < TOLERANCE, diff


@pytest.mark.parametrize("name", ["dflash", "dflash2"])
def test_block_logits_equal_the_reference(name):
    draft, ref = _reference(name)
    block, context = ref["block"], ref["context"]
    logits, _ = draft(block, draft.make_cache(), context=context)
    _close(logits, ref["logits"])
    assert float(mx.abs(ref["logits"]).max()) > 3  # not a vanishing output


@pytest.mark.parametrize("name", ["dflash", "dflash2"])
def test_a_cached_context_gives_the_same_logits(name):
    draft, ref = _reference(name)
    block, context = ref["block"], ref["context"]
    cache = draft.make_cache()
    draft.absorb(context[:, :6], cache)
    logits, _ = draft(block, cache, context=context[:, 6:])
    _close(logits, ref["logits"])


def test_rows_of_a_batch_with_different_context_lengths():
    """Two rows: 4 and 9 positions cached, 7 and 2 new (padded to 7, the padding after the
    block), both the reference's logits; a third row with a shifted cache (positions 3..) sees
    both, as RoPE is relative: a cache that starts at position 3 (`shift`) gives the same logits
    when its new context is placed alike, and other ones where it is not."""
    draft, ref = _reference("dflash")
    block, context = ref["block"], ref["context"]
    singles = []
    for cached in (4, 9):
        cache = draft.make_cache()
        draft.absorb(context[:, :cached], cache)
        singles.append(cache)
    rows = BatchCache(len(draft.layers))
    rows.add(singles)
    new = mx.concatenate([context[:, 4:], mx.pad(context[:, 9:], [(0, 0), (0, 5), (0, 0)])])
    rows.reserve(7 + block.shape[1])
    logits, _ = draft(mx.concatenate([block, block]), rows.layers, context=new,
                      counts=mx.array([7, 2]), shift=mx.array([0, 0]))
    _close(logits[0], ref["logits"][0])
    _close(logits[1], ref["logits"][0])
    for shift, same in ((3, True), (0, False)):
        cache = draft.make_cache()
        draft.absorb(context[:, :6], cache, shift=3)
        shifted, _ = draft(block, cache, context=context[:, 6:], shift=shift)
        assert (float(mx.abs(shifted - ref["logits"]).max()) < TOLERANCE) == same


def test_the_dflash2_selector_samples_from_the_reference_q():
    """Along the reference's sampled path: the same candidates per position, and the q each
    proposal was drawn from (softmax of the selector's scores at T) equal to float32 rounding."""
    draft, ref = _reference("dflash2")
    logits, states = draft(ref["block"], draft.make_cache(), context=ref["context"])
    selector = draft.candidate_selector
    candidates = selector.candidates(logits)
    projected = selector.hidden_projection(states)
    previous = ref["block"][:, 0]
    vocab = logits.shape[-1]
    for i in range(logits.shape[1]):
        assert sorted(candidates[0, i].tolist()) == sorted(ref["candidates"][0, i].tolist())
        scores = selector.scores(logits[:, i], projected[:, i], candidates[:, i], previous)
        ours = mx.put_along_axis(mx.zeros((1, vocab)), candidates[:, i],
                                 mx.softmax(scores / 0.7, axis=-1), axis=-1)
        theirs = mx.put_along_axis(mx.zeros((1, vocab)), ref["candidates"][:, i],
                                   ref["q"][:, i], axis=-1)
        _close(ours, theirs)
        previous = ref["path"][:, i]
    assert np.unique(np.array(ref["path"])).size > 1


# -- in the engine --------------------------------------------------------------------------------
NEW = 24


@pytest.fixture(scope="module")
def dflash2(eagle, tmp_path_factory):
    """A DFlash2 drafter (block 8) over the `eagle` fixture's target."""
    from tests.fixtures import write_dflash

    out = write_dflash(eagle[0], tmp_path_factory.mktemp("dflash2"), version=2, block_size=8)
    return load_dflash(eagle[2][0], out)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A Qwen3.5-shaped hybrid target (Gated DeltaNet and attention layers), a DFlash drafter
    for it, and the oracle's greedy references."""
    from tests.fixtures import HEAD_PROMPTS, build_hybrid_pair, write_dflash
    from tests.oracle import Oracle
    from tinydraft_mlx import load_models

    root = tmp_path_factory.mktemp("hybrid")
    target_dir, _ = build_hybrid_pair(root, "qwen3_5")
    out = write_dflash(target_dir, root / "dflash")
    target, draft, tok = load_models(str(target_dir), str(out), dtype="float32")
    refs = Oracle(target_dir).references(tok, HEAD_PROMPTS, NEW, 2e-3, "qwen3_5")
    return target, draft, tok, refs


@pytest.mark.usefixtures("cpu_fp32")
@pytest.mark.parametrize("k", [1, 3, 7, 15, "auto"])
def test_greedy_equals_the_oracle_at_every_block_length(eagle, dflash, k):
    """One sequence at a time, then the four prompts in one batch."""
    from tinydraft_mlx import batch_generate, generate

    _, _, (target, _, tok), _, refs, _ = eagle
    drafted = 0
    for ids, ref in refs:
        out, stats = generate(target, dflash, tok, ids, k=k, max_tokens=NEW)
        assert out == ref
        drafted += stats.drafted
    assert drafted > 0
    batch = batch_generate(target, dflash, tok, [ids for ids, _ in refs[:3]], k=k,
                           max_tokens=NEW)
    assert [tokens for tokens, _ in batch] == [ref for _, ref in refs[:3]]


@pytest.mark.usefixtures("cpu_fp32")
def test_eight_rows_of_mixed_drafters_and_block_lengths_equal_the_oracle(eagle, dflash, dflash2):
    """B = 8: DFlash rows at k = 2, 7 and 15, DFlash2 rows at 3 and 7, a draft model's, an
    EAGLE-3 head's and a plain row, joining at once."""
    from tests.reference import drain
    from tinydraft_mlx import BatchDecoder

    _, _, (target, head, tok), draft, refs, _ = eagle
    rows = [(dflash, 2), (dflash, 7), (dflash, 15), (dflash2, 3), (dflash2, 7), ("model", 3),
            (head, 3), (None, 1)]
    decoder = BatchDecoder(target, draft)
    want = {}
    for j, (source, k) in enumerate(rows):
        ids, ref = refs[j % len(refs)]
        want[decoder.insert(ids, draft=source, k=k, max_tokens=NEW)] = ref
    out = drain(decoder)
    assert all(out[uid] == ref for uid, ref in want.items())


@pytest.mark.usefixtures("cpu_fp32")
def test_dflash2_greedy_equals_the_oracle(eagle, dflash2):
    from tinydraft_mlx import generate

    _, _, (target, _, tok), _, refs, _ = eagle
    drafted = 0
    for ids, ref in refs:
        out, stats = generate(target, dflash2, tok, ids, k=7, max_tokens=NEW)
        assert out == ref
        drafted += stats.drafted
    assert drafted > 0


@pytest.mark.usefixtures("cpu_fp32")
def test_sampled_first_two_tokens_follow_the_oracle_with_dflash2(eagle, dflash2):
    """T = 1, top-p 0.8, k = 3, 2,000 rows: the selector's q is what the rejection rule reads."""
    from tests.reference import check_first_two_tokens, two_step_joint
    from tinydraft_mlx import BatchDecoder, SamplingParams

    target, oracle, ids = eagle[2][0], eagle[5], eagle[4][0][0]
    exact = two_step_joint(oracle.logits, ids, temperature=1.0, top_p=0.8)
    wrong = two_step_joint(oracle.logits, ids, temperature=1.0)
    check_first_two_tokens(lambda: BatchDecoder(target, dflash2), ids, dflash2, 2000, exact,
                           wrong, k=3, sampling=lambda seed: SamplingParams(1.0, top_p=0.8))


@pytest.mark.usefixtures("cpu_fp32")
def test_sampled_first_two_tokens_inside_mixed_batches(eagle, dflash):
    """DFlash rows (T = 1, top-p 0.8, k = 2) in batches that greedy, seeded, draft-model and
    prompt-lookup rows join: 1,200 rows against the oracle's exact joint."""
    from tests.reference import check_first_two_in_batches, two_step_joint
    from tinydraft_mlx import BatchDecoder, SamplingParams

    _, _, (target, _, _), draft, refs, oracle = eagle
    ids = refs[2][0]
    exact = two_step_joint(oracle.logits, ids, temperature=1.0, top_p=0.8)
    wrong = two_step_joint(oracle.logits, ids, temperature=1.0)
    companions = [(SamplingParams(), "model", 3), (SamplingParams(0.7, seed=5), dflash, 7),
                  (SamplingParams(0.9), "prompt-lookup", 2)]
    check_first_two_in_batches(lambda: BatchDecoder(target, draft), ids, dflash,
                               SamplingParams(1.0, top_p=0.8), companions,
                               [refs[0][0], refs[1][0]], exact, wrong, batches=12, rows=100,
                               every=50)


@pytest.mark.usefixtures("cpu_fp32")
@pytest.mark.parametrize("k", [1, 7, 15])
def test_a_seed_fixes_the_text_at_any_block_length_and_batch(eagle, dflash, dflash2, k):
    from tests.reference import seeded_row_in_a_batch
    from tinydraft_mlx import generate

    _, _, (target, _, tok), draft, refs, _ = eagle
    kw = dict(max_tokens=NEW, temperature=0.8, top_p=0.95, seed=7)
    for ids, _ in refs:
        plain, _ = generate(target, None, tok, ids, **kw)
        assert generate(target, dflash, tok, ids, k=k, **kw)[0] == plain
        assert generate(target, dflash2, tok, ids, k=min(k, 7), **kw)[0] == plain
    seeded_row_in_a_batch(target, draft, tok, refs, dflash, ["model", dflash2])


@pytest.mark.usefixtures("cpu_fp32")
@pytest.mark.parametrize("tree", [None, 12])
def test_the_context_cache_holds_the_oracle_states_of_accepted_positions(eagle, dflash, tree):
    """Eight seeded sampled rows (T = 1, where the random target's drafts are accepted more
    often than greedy) in one batch, after rounds that accepted and rejected: each row's drafter
    cache (kept by the row) == the drafter's keys/values of the transformers oracle's states of
    its final sequence, written in one go; nothing of a rejected block stays. With candidate
    trees (budget 12) too: the states of a walked path off the first branch, nothing of the
    other branches."""
    from tests.reference import assert_block_context, kept_rows
    from tinydraft_mlx import BatchDecoder

    _, _, (target, _, _), _, refs, oracle = eagle
    accepted = 0
    for seq, done in kept_rows(BatchDecoder(target, dflash), refs[0][0], 8, draft=dflash, k=7,
                               max_tokens=NEW, tree=tree):
        accepted += done.stats.accepted
        assert done.stats.drafted > done.stats.accepted
        kept = done.draft_cache
        assert kept.skip == 0
        assert sum(s.shape[0] for s in kept.states) + kept[0].offset == len(seq) - 1
        assert_block_context(dflash, oracle, seq, kept)
    assert accepted > 0


@pytest.mark.usefixtures("cpu_fp32")
def test_a_prompt_cache_keeps_the_context(eagle, dflash):
    from tinydraft_mlx import PromptCache, generate

    _, _, (target, _, tok), _, refs, _ = eagle
    cache = PromptCache(target, dflash)
    ids, ref = refs[1]
    first, _ = generate(target, dflash, tok, ids, k=7, max_tokens=NEW // 2, prompt_cache=cache)
    second, stats = generate(target, dflash, tok, ids + first, k=7,
                             max_tokens=NEW - NEW // 2, prompt_cache=cache)
    assert first + second == ref and stats.cached_tokens == len(ids) + len(first) - 1
    assert stats.drafted > 0


@pytest.mark.usefixtures("cpu_fp32")
@pytest.mark.parametrize("k", [3, 7])
def test_a_hybrid_target_decodes_exactly(hybrid, k):
    """Qwen3.5-shaped: Gated DeltaNet states rolled back after every rejected block; greedy ==
    the oracle, one sequence and a batch of three."""
    from tinydraft_mlx import batch_generate, generate

    target, draft, tok, refs = hybrid
    for ids, ref in refs:
        assert generate(target, draft, tok, ids, k=k, max_tokens=NEW)[0] == ref
    batch = batch_generate(target, draft, tok, [ids for ids, _ in refs[:3]], k=k,
                           max_tokens=NEW)
    assert [tokens for tokens, _ in batch] == [ref for _, ref in refs[:3]]


def test_refusals_are_one_line(eagle, dflash):
    from tinydraft_mlx import ParameterError, generate, load_models

    _, _, (target, _, tok), _, refs, _ = eagle
    one_line = r"^k must be at most 15 with the dflash drafter .*\(got 16\)$"
    with pytest.raises(ParameterError, match=one_line):
        generate(target, dflash, tok, refs[0][0], k=16, max_tokens=4)
    with pytest.raises(ParameterError, match="max_kv_size"):
        generate(target, dflash, tok, refs[0][0], k=3, max_tokens=4, max_kv_size=64)
    other, _, _ = load_models(str(eagle[0]), "none", dtype="float32")
    with pytest.raises(ParameterError, match="draft"):
        generate(other, dflash, tok, refs[0][0], k=3, max_tokens=4)


def test_load_models_recognises_a_dflash_directory_and_the_server_drafts_with_it(eagle, tmp_path):
    """`load_models(draft=<directory>)` gives the drafter; `python -m tinydraft_mlx.server
    --draft <directory>` drafts with it by default and serves requests that name none,
    "dflash" and "none" alike, greedy == the oracle."""
    import httpx

    from tests.fixtures import write_dflash
    from tests.test_server import Served
    from tinydraft_mlx import load_models
    from tinydraft_mlx.server import build_app, setup_arg_parser

    out = write_dflash(eagle[0], tmp_path / "d", steps=1)
    target, draft, tok = load_models(str(eagle[0]), str(out), dtype="float32")
    assert draft.kind == "dflash" and draft.target is target and draft.block_size == 16
    refs = eagle[4]
    app = build_app(setup_arg_parser().parse_args(
        ["--target", str(eagle[0]), "--draft", str(out), "-k", "7"]))
    served = Served(app)
    try:
        assert served.health()["draft"] == "dflash"
        for body in ({}, {"draft": "dflash"}, {"draft": "none"}):
            r = httpx.post(served.url + "/v1/completions", timeout=60, json={
                "prompt": refs[0][0], "max_tokens": NEW, "temperature": 0, **body})
            assert r.status_code == 200, r.text
            reply = r.json()
            assert reply["choices"][0]["tinydraft"]["token_ids"] == refs[0][1]
            assert reply["usage"]["speculative"]["draft"] == body.get("draft", "dflash")
    finally:
        served.close()


@pytest.mark.usefixtures("cpu_fp32")
def test_a_quantized_target_gets_a_drafter_quantized_alike(eagle, dflash, tmp_path):
    """A 4-bit target (group 32): the drafter loads quantized alike (its linear layers 4-bit),
    drafts, and greedy and seeded outputs equal that target's plain decoding; a checkpoint saved
    quantized (config "quantization") loads as it was saved."""
    import json

    from mlx.utils import tree_flatten

    from tests.fixtures import write_dflash
    from tinydraft_mlx import generate, load_models

    target, _, tok = load_models(str(eagle[0]), "none", dtype="float32")
    nn.quantize(target, group_size=32, bits=4)
    draft = load_dflash(target, write_dflash(eagle[0], tmp_path / "d", steps=30))
    assert isinstance(draft.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert draft.layers[0].self_attn.q_proj.bits == 4
    drafted = 0
    for ids, _ in eagle[4]:
        plain, _ = generate(target, None, tok, ids, max_tokens=NEW)
        out, stats = generate(target, draft, tok, ids, k=7, max_tokens=NEW)
        assert out == plain
        drafted += stats.drafted
        kw = dict(max_tokens=NEW, temperature=0.8, seed=3)
        assert generate(target, draft, tok, ids, k=7, **kw)[0] == \
            generate(target, None, tok, ids, **kw)[0]
    assert drafted > 0
    saved = tmp_path / "q"
    saved.mkdir()
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, "quantization": {
        "group_size": 32, "bits": 4}}))
    mx.save_safetensors(str(saved / "model.safetensors"), dict(tree_flatten(draft.parameters())))
    again = load_dflash(target, saved)
    assert isinstance(again.layers[0].mlp.gate_proj, nn.QuantizedLinear)
    block, context = mx.array([eagle[4][0][0][-1:] + [0] * 15]), mx.zeros((1, 3, 128))
    _close(again(block, again.make_cache(), context=context)[0],
           draft(block, draft.make_cache(), context=context)[0])


def test_auto_may_choose_the_whole_block(dflash):
    """k="auto" reaches a block drafter's block_size - 1 (one draft forward whatever k): with
    flat costs and every draft accepted it picks 15, where a chain's pair stops at 8."""
    from tinydraft_mlx.engine.policy import AUTO_MAX_K, Acceptance, RoundCosts, choose
    from tinydraft_mlx.engine.rounds import max_draft_length

    assert max_draft_length(dflash.source(), "auto") == 15
    costs = RoundCosts()
    for k in range(16):
        for _ in range(3):
            costs.update(k, 0.010 + 0.0001 * k)
    picks = []
    for k_max in (15, AUTO_MAX_K):
        row = Acceptance(k_max)
        for _ in range(50):
            row.update(k_max, k_max)
        picks.append(choose(costs, [row], 100))
    assert picks == [15, AUTO_MAX_K]


def test_the_server_refuses_flags_its_block_drafter_cannot_take(eagle, dflash, tmp_path):
    from tests.fixtures import write_dflash
    from tinydraft_mlx import ParameterError
    from tinydraft_mlx.server import build_app, setup_arg_parser

    out = write_dflash(eagle[0], tmp_path / "d", steps=1)
    base = ["--target", str(eagle[0]), "--draft", str(out)]
    for extra, message in ((["-k", "16"], "--num-draft-tokens must be at most 15 with the dflash"),
                           (["--max-kv-size", "64"], "max_kv_size must be None with a dflash")):
        with pytest.raises(ParameterError, match=message):
            build_app(setup_arg_parser().parse_args(base + extra))

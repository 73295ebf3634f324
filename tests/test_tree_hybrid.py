"""Candidate trees on hybrid targets: recurrent layers (Gated DeltaNet: Qwen3-Next, Qwen3.5 dense
and MoE; Mamba-2: Nemotron-H, Granite 4, Mamba-2 alone) run along each branch of a tree in the
one verify forward (engine/cache/branches.py), and are replayed along the walked path at the
commit.

Checked against independent references, on tiny checkpoints built at test time
(tests/fixtures.py, as tests/test_hybrid.py's):
- one tree forward of two rows (different lengths, deep random trees): every node's logits ==
  the transformers oracle's at the end of prompt + the node's own path (full recompute), for
  every family; the same forward with the recurrent layers running along the layout instead of
  the branches does not match (the control); after the commit of a path per row, every
  recurrent layer's convolution window and state == mlx-lm's own cache after one forward of
  prompt + path (without our caches), and every attention layer's keys/values == a prefill;
- greedy == the oracle with trees from the hybrid draft model, the target's MTP layer and
  prompt lookup, budgets {4, 16, 32}, one sequence and batches of 3 and 8 (trees, chains and
  plain rows together); walks that leave the draft's own chain occur;
- sampled: the joint of the first two tokens of tree rows inside mixed batches == the oracle's
  exact joint (chi-square, the suite's bound); a seeded row's text == plain seeded decoding's,
  alone and batched; after tree rounds at T = 1 each row's target cache (recurrent states
  included) == mlx-lm's after one forward of the emitted sequence.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.fixtures import (
    FIRST_ATTENTION,
    HEAD_PROMPTS,
    HYBRIDS,
    build_hybrid_pair,
    damp_layers,
    write_mtp,
)
from tests.reference import (
    check_first_two_in_batches,
    drain,
    kept_rows,
    prefilled_rows,
    two_step_joint,
)
from tinydraft_mlx import BatchDecoder, SamplingParams, batch_generate, generate, load_models
from tinydraft_mlx.engine.cache import branches
from tinydraft_mlx.engine.tree_verify import compact, forward, layout
from tinydraft_mlx.engine.trees import Tree

pytestmark = pytest.mark.usefixtures("cpu_fp32")

NEW = 24
MIN_MARGIN = 1e-3
ENGINE = ("qwen3_5", "nemotron_h")  # a Gated DeltaNet target with an MTP layer; a rope-free one


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (target, draft model, tokenizer, oracle, [(ids, oracle greedy)] (ENGINE
    families only), MTP head (Qwen3.5 only))."""
    from tests.oracle import Oracle

    root = tmp_path_factory.mktemp("tree_hybrid")
    out = {}
    for family in HYBRIDS:
        target_dir, draft_dir = build_hybrid_pair(root, family, damp=0.05)
        target, draft, tok = load_models(str(target_dir), str(draft_dir), dtype="float32")
        head = None
        if family == "qwen3_5":  # its MTP layer, as the hub ships it (tests/test_mtp.py)
            damp_layers(target_dir, 0.02, FIRST_ATTENTION[family])
            write_mtp(target_dir, family, into="model.safetensors")
            target, head, tok = load_models(str(target_dir), "mtp", dtype="float32")
            _, draft, _ = load_models(str(target_dir), str(draft_dir), dtype="float32")
        oracle = Oracle(target_dir)
        refs = (oracle.references(tok, HEAD_PROMPTS, NEW, MIN_MARGIN, family)
                if family in ENGINE else [])
        out[family] = (target, draft, tok, oracle, refs, head)
    return out


def _deep_tree(rng: random.Random, last: int, nodes: int, vocab: int) -> Tree:
    """A random tree whose parents are among the 3 nodes laid out last: deep branches (past
    the convolution's window) that fork."""
    tokens, parents, depths = [last], [-1], [0]
    for i in range(1, nodes):
        parent = rng.randrange(max(0, i - 3), i)
        tokens.append(rng.randrange(vocab))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return Tree(tokens, parents, depths)


def _recurrent_states(cache) -> list:
    return [(np.array(c[0]), np.array(c[1])) for c in cache if hasattr(c, "tape")
            or type(c).__name__ == "ArraysCache"]


@pytest.mark.parametrize("family", HYBRIDS)
def test_one_tree_forward_follows_every_branch(built, family, monkeypatch):
    target, _, tok, oracle, _, _ = built[family]
    rng = random.Random(7)
    prompts = [tok.encode(HEAD_PROMPTS[0]), tok.encode(HEAD_PROMPTS[2])[:9]]
    trees = [_deep_tree(rng, prompts[0][-1], 13, 200), _deep_tree(rng, prompts[1][-1], 8, 200)]
    assert max(trees[0].depths) >= 5 and any(  # forks, and branches deeper than the window
        len(t.ancestors(i)) > 4 for t in trees for i in range(len(t)))

    def tree_forward():
        rows = prefilled_rows(target, [ids[:-1] for ids in prompts], margin=16)
        placed = layout(trees)
        return rows, forward(target, rows, placed.tokens, placed)

    def worst(logits) -> tuple[float, float, float]:
        """The largest gap of the nodes' logits to the oracle's and to mlx-lm's own forward of
        the node's path (no caches), and the largest oracle logit."""
        gaps = np.zeros(3)
        for b, (ids, tree) in enumerate(zip(prompts, trees)):
            for i in range(len(tree)):
                path = [tree.tokens[j] for j in reversed(tree.ancestors(i)[:-1])]
                want = oracle.logits(ids + path)[-1]
                plain = np.array(target(mx.array([ids + path]))[0, -1])
                ours = np.array(logits[b, i])
                gaps = np.maximum(gaps, [np.abs(ours - want).max(), np.abs(ours - plain).max(),
                                         np.abs(want).max()])
        return tuple(gaps)

    with monkeypatch.context() as patched:  # the control: recurrent layers along the layout
        patched.setattr(branches, "active", lambda: None)
        assert worst(tree_forward()[1])[0] > 1e-2
    rows, logits = tree_forward()
    # float32 rounding of two frameworks (mlx-lm's own forward is as far from the oracle: up
    # to 1.1e-4 on Qwen3-Next's logits of 12.8) and of one framework's two recurrence orders
    to_oracle, to_mlx_lm, scale = worst(logits)
    assert to_oracle < 2e-5 * scale and to_mlx_lm < 1e-4, (to_oracle, to_mlx_lm, scale)
    # the deepest node's path of each row into place
    paths = []
    for tree in trees:
        deepest = max(range(len(tree)), key=lambda i: tree.depths[i])
        paths.append(list(reversed(tree.ancestors(deepest))))
    assert any(p != list(range(len(p))) for p in paths)
    starts = [len(ids) - 1 for ids in prompts]
    compact(rows.layers, starts, paths)
    rows.rollback([s + len(p) for s, p in zip(starts, paths)])
    for b, (ids, tree, path) in enumerate(zip(prompts, trees, paths)):
        seq = ids + [tree.tokens[j] for j in path[1:]]
        mine = rows.extract(b)
        fresh = make_prompt_cache(target)  # mlx-lm's own caches, one forward
        target(mx.array([seq]), cache=fresh)
        for ours, theirs in zip(_recurrent_states(mine), _recurrent_states(fresh), strict=True):
            for a, c in zip(ours, theirs):
                assert np.abs(a - c).max() < 1e-4
        for ours, theirs in zip(mine, fresh):
            if hasattr(theirs, "keys"):
                n = len(seq)
                assert ours.offset == theirs.offset == n
                for a, c in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                    assert float(mx.abs(a[..., :n, :] - c[..., :n, :]).max()) < 1e-4


@pytest.fixture
def walks(monkeypatch):
    """Each tree walk of the test: (path, the tree's spine)."""
    seen = []
    walk = Tree.walk

    def recorded(self, *args):
        path, tokens = walk(self, *args)
        seen.append((path, list(self.spine)))
        return path, tokens

    monkeypatch.setattr(Tree, "walk", recorded)
    return seen


def _off_spine(walks) -> int:
    return sum(any(n not in spine for n in path[1:]) for path, spine in walks)


@pytest.mark.parametrize("budget", [4, 16, 32])
@pytest.mark.parametrize("family", ENGINE)
def test_greedy_trees_equal_the_oracle(built, family, budget, walks):
    """One sequence at a time for each drafter, then three prompts in one batch."""
    target, draft, tok, _, refs, head = built[family]
    drafters = [(draft, 4), (head, 3)] if head is not None else [(draft, 4)]
    for source, k in drafters:
        for ids, ref in refs[:2]:
            out, stats = generate(target, source, tok, ids, k=k, max_tokens=NEW, tree=budget)
            assert out == ref
            assert all(r <= budget for r in stats.k_histogram)
    outs = batch_generate(target, draft, tok, [ids for ids, _ in refs[:3]], k=4,
                          max_tokens=NEW, tree=budget)
    assert [o for o, _ in outs] == [ref for _, ref in refs[:3]]
    assert _off_spine(walks) > 0, "no walk left the drafter's own chain"


@pytest.mark.parametrize("family", ENGINE)
def test_eight_rows_of_trees_chains_lookup_and_plain_equal_the_oracle(built, family, walks):
    target, draft, tok, oracle, refs, head = built[family]
    decoder = BatchDecoder(target, draft, max_k=16)
    kinds = [("model", 4, 16), ("model", 3, None), ("prompt-lookup", 3, 8), (None, 0, None),
             (head or "model", 3, 8), ("model", 4, 4), ("prompt-lookup", 2, None),
             ("model", 2, 12)]
    want = {}
    for i, (kind, k, tree) in enumerate(kinds):
        ids, ref = refs[i % len(refs)]
        limit = [NEW, 11, NEW, 7][i % 4]
        if kind == "prompt-lookup":  # text that repeats, so that lookup proposes
            ids = ids + ids[-6:]
            ref = oracle.greedy(ids, NEW)[0]
        want[decoder.insert(ids, draft=kind, k=k, tree=tree, max_tokens=limit)] = ref[:limit]
    out = drain(decoder)
    assert all(out[uid] == ref for uid, ref in want.items())
    assert walks


def test_sampled_first_two_tokens_inside_mixed_batches(built):
    """Qwen3.5 target, draft-model tree rows (T = 1, top-p 0.8, k = 2, budget 6) in batches
    that MTP trees, seeded and lookup rows join: 1,200 rows against the oracle's exact joint
    (and not the joint without top-p)."""
    target, draft, _, oracle, refs, head = built["qwen3_5"]
    ids = refs[1][0]
    exact = two_step_joint(oracle.logits, ids, temperature=1.0, top_p=0.8)
    wrong = two_step_joint(oracle.logits, ids, temperature=1.0)
    companions = [(SamplingParams(), head, 3), (SamplingParams(0.7, seed=5), "model", 3),
                  (SamplingParams(0.9), "prompt-lookup", 2)]
    check_first_two_in_batches(lambda: BatchDecoder(target, draft), ids, "model",
                               SamplingParams(1.0, top_p=0.8), companions,
                               [refs[0][0], refs[2][0]], exact, wrong, batches=12, rows=100,
                               every=50, tree=6)


@pytest.mark.parametrize("family", ENGINE)
def test_a_seed_fixes_the_text_with_trees(built, family):
    target, draft, tok, _, refs, head = built[family]
    kw = dict(max_tokens=NEW, temperature=0.8, top_p=0.95, seed=7)
    ids = refs[1][0]
    plain, _ = generate(target, None, tok, ids, **kw)
    sources = [(draft, 4)] + ([(head, 3)] if head is not None else [])
    for source, k in sources:
        assert generate(target, source, tok, ids, k=k, tree=8, **kw)[0] == plain
    decoder = BatchDecoder(target, draft)
    decoder.insert(refs[2][0], draft="model", k=3, max_tokens=8, sampling=SamplingParams(0.7),
                   tree=8)
    uids = [decoder.insert(ids, draft="model" if source is draft else source, k=k,
                           max_tokens=NEW, tree=8,
                           sampling=SamplingParams(0.8, top_p=0.95, seed=7))
            for source, k in sources]
    out = drain(decoder)
    assert all(out[uid] == plain for uid in uids)


@pytest.mark.parametrize("family", ENGINE)
def test_the_caches_after_tree_rounds_hold_the_emitted_sequence(built, family, walks):
    """Six seeded rows at T = 1, draft-model trees, caches kept: each row's target cache (the
    recurrent layers' windows and states, the attention layers' keys/values) == mlx-lm's own
    after one forward of the row's sequence."""
    target, draft, _, _, refs, _ = built[family]
    decoder = BatchDecoder(target, draft)
    for seq, done in kept_rows(decoder, refs[0][0], 6, draft="model", k=4, max_tokens=NEW,
                               tree=8):
        n = len(seq) - 1
        fresh = make_prompt_cache(target)
        target(mx.array([seq[:n]]), cache=fresh)
        assert done.target_cache[0].offset == n
        for ours, theirs in zip(_recurrent_states(done.target_cache),
                                _recurrent_states(fresh), strict=True):
            for a, c in zip(ours, theirs):
                assert np.abs(a - c).max() < 1e-4
        for ours, theirs in zip(done.target_cache, fresh):
            if hasattr(theirs, "keys"):
                for a, c in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                    assert float(mx.abs(a[..., :n, :] - c[..., :n, :]).max()) < 1e-4
    assert _off_spine(walks) > 0


def test_a_tree_beyond_the_rollback_margin_is_refused_in_one_line(built):
    """A recurrent layer replays at most its margin + 1 positions: a decoder made for k <= 8
    refuses a tree of 12 nodes, naming the parameter, the bound and the value."""
    from tinydraft_mlx.engine.sampling import ParameterError

    target, draft, _, _, refs, _ = built["nemotron_h"]
    decoder = BatchDecoder(target, draft, max_k=8)
    with pytest.raises(ParameterError) as err:
        decoder.insert(refs[0][0], draft="model", k=4, tree=12)
    message = str(err.value)
    assert message.startswith("tree must be at most max_k = 8") and "recurrent" in message
    assert "(got 12)" in message and "\n" not in message


def test_bounded_attention_beside_recurrent_layers_holds_trees(built):
    """max_kv_size 20 (attention rings that wrap within the generation) on Qwen3.5: trees of 8
    give plain bounded decoding's tokens (whose windows tests/test_rotating_cache.py checks
    against uncached windowed passes), one sequence and in a batch beside a chain row."""
    target, draft, tok, _, refs, _ = built["qwen3_5"]
    prompts = [ids for ids, _ in refs[:2]]
    assert all(len(ids) + NEW > 20 for ids in prompts)
    plain = [generate(target, None, tok, ids, max_tokens=NEW, max_kv_size=20)[0]
             for ids in prompts]
    assert generate(target, draft, tok, prompts[0], k=4, max_tokens=NEW, max_kv_size=20,
                    tree=8)[0] == plain[0]
    decoder = BatchDecoder(target, draft, max_kv_size=20, max_k=8)
    uids = [decoder.insert(ids, draft="model", k=4, max_tokens=NEW, tree=tree)
            for ids, tree in zip(prompts, (8, None))]
    out = drain(decoder)
    assert [out[uid] for uid in uids] == plain

"""Candidate trees (engine/trees.py, engine/tree_verify.py, policy.TreeChoice).

The parts against independent references: the best-first tree is the budget's most probable
prefixes found by enumerating every prefix (DDTree's marginal expansion, and a chain's spine with
its siblings, spine first where it is tested by rejection); prompt lookup's trie; the walk on a
tree written by hand; the choices at a root and its child against p x p; one tree forward's
logits at every node == the transformers fp32 oracle's logits of that node's own prefix, for
two rows of different lengths, and the compaction against a plain prefill.

Then trees in the engine, on the tiny Qwen3 target of conftest.py's `eagle` with each drafter
(the draft model, 64 ids narrower; its MTP layer; an EAGLE-3 head; a DFlash block drafter) and
prompt lookup on the demo target: greedy == the oracle for budgets {4, 16, 32}, one sequence and
batches of 3 and 8 (trees, chains and plain rows together), also with k="auto"; the sampled
first two tokens' joint against the oracle's exact joint (chi-square, tests/reference.py's
bound), alone and in mixed batches; a seed fixes the text; log-probabilities. The caches, ring
layouts, the server and the refusals: tests/test_tree_caches.py.
"""

from __future__ import annotations

import itertools
import math
import random

import mlx.core as mx
import numpy as np
import pytest

from tinydraft_mlx.engine.trees import Tree, chain, grow

NEW = 24


# -- the tree itself -----------------------------------------------------------------------------
def _tables(rng: random.Random, depth: int, width: int) -> tuple[list, list]:
    ids, logprobs = [], []
    for _ in range(depth):
        tokens = rng.sample(range(100), width)
        weights = [rng.random() + 1e-3 for _ in tokens]
        total = sum(weights)
        pairs = sorted(((math.log(w / total), t) for w, t in zip(weights, tokens)),
                       reverse=True)
        logprobs.append([v for v, _ in pairs])
        ids.append([t for _, t in pairs])
    return ids, logprobs


def _paths(tree: Tree) -> set[tuple[int, ...]]:
    """Every node as the tuple of tokens from the root's child down to it."""
    return {tuple(tree.tokens[j] for j in reversed(tree.ancestors(i)[:-1]))
            for i in range(1, len(tree))}


def _check_shape(tree: Tree) -> None:
    assert tree.parents[0] == -1 and tree.depths[0] == 0
    for i in range(1, len(tree)):
        assert tree.parents[i] < i  # parents first: the verify's layout
        assert tree.depths[i] == tree.depths[tree.parents[i]] + 1
    for i in range(len(tree)):  # siblings hold different tokens
        kids = [tree.tokens[j] for j in range(len(tree)) if tree.parents[j] == i]
        assert len(kids) == len(set(kids))


@pytest.mark.parametrize("budget", [1, 4, 16, 32])
def test_a_block_tree_is_the_most_probable_prefixes(budget):
    """DDTree's expansion against every prefix of the product distribution, ranked."""
    rng = random.Random(budget)
    for _ in range(20):
        ids, logprobs = _tables(rng, 4, 5)
        tree = grow(7, budget, ids, logprobs)
        _check_shape(tree)
        scores = {}
        for depth in range(1, 5):
            for ranks in itertools.product(range(5), repeat=depth):
                path = tuple(ids[d][r] for d, r in enumerate(ranks))
                scores[path] = sum(logprobs[d][r] for d, r in enumerate(ranks))
        best = sorted(scores, key=scores.get, reverse=True)[:budget]
        assert _paths(tree) == set(best)


def _scorer(ids: list, logprobs: list):
    """lp(depth index, token): its log-probability, or below every candidate's if it is none."""
    def lp(d: int, token: int) -> float:
        row = ids[d]
        return logprobs[d][row.index(token)] if token in row else min(logprobs[d]) - 1.0
    return lp


@pytest.mark.parametrize("budget", [1, 3, 8, 20])
def test_a_chain_tree_is_its_spine_and_likeliest_siblings(budget):
    """A draft model's tree: its own drafts d_1..d_K (also a draft outside the top candidates,
    as a sampled one may be) and, under each spine node, the next depth's other candidates;
    the budget's most probable of those, against the enumerated set."""
    rng = random.Random(100 + budget)
    for trial in range(20):
        ids, logprobs = _tables(rng, 4, 5)
        drafts = [row[rng.randrange(len(row))] for row in ids]
        if trial % 4 == 0:
            drafts[1] = 999  # not among the candidates
        tree = grow(7, budget, ids, logprobs, drafts)
        _check_shape(tree)
        lp = _scorer(ids, logprobs)
        scores = {}
        for depth in range(1, 5):
            spine = tuple(drafts[:depth])
            scores[spine] = sum(lp(d, t) for d, t in enumerate(spine))
            for token in ids[depth - 1]:
                if token != drafts[depth - 1]:
                    path = spine[:-1] + (token,)
                    scores[path] = scores[spine] - lp(depth - 1, drafts[depth - 1]) + lp(
                        depth - 1, token)
        best = sorted(scores, key=scores.get, reverse=True)[:budget]
        assert _paths(tree) == set(best)
        spine_nodes = [i for i in tree.spine]
        assert [tree.tokens[i] for i in spine_nodes] == drafts[: len(spine_nodes)]
        # a spine tested by rejection is taken whole first, whatever its drafts' scores: which
        # drafts the tree holds may not depend on what they are
        assert not tree.tested
        first = grow(7, budget, ids, logprobs, drafts, tested=True)
        _check_shape(first)
        held = min(budget, 4)
        assert first.spine == list(range(1, held + 1)) and first.tested
        assert [first.tokens[i] for i in first.spine] == drafts[:held]
        rest = {p for p in _paths(first) if p != tuple(drafts[: len(p)])}
        siblings = {p for p in scores if p != tuple(drafts[: len(p)])}
        assert rest == set(sorted(siblings, key=scores.get, reverse=True)[: budget - held])


def test_the_walk_follows_the_targets_choices():
    """root -> a(1) -> c(3); root -> b(2); a -> d(4) (nodes in that layout)."""
    tree = Tree([9, 10, 20, 30, 40], [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2], spine=[1, 3])
    assert tree.walk([10, 30, 0, 77, 0]) == ([0, 1, 3], [10, 30, 77])
    assert tree.walk([20, 0, 55, 0, 0]) == ([0, 2], [20, 55])
    assert tree.walk([40, 0, 0, 0, 0]) == ([0], [40])
    assert tree.walk([10, 40, 0, 0, 5]) == ([0, 1, 4], [10, 40, 5])
    assert tree.agreed([0, 1, 3]) == 2 and tree.agreed([0, 1, 4]) == 1
    assert tree.agreed([0, 2]) == 0
    straight = chain(9, [1, 2, 3])
    assert straight.walk([1, 2, 5, 0]) == ([0, 1, 2], [1, 2, 5])


def test_the_choices_at_each_depth_are_independent_draws_from_p():
    """A root and its child with the same distribution p over 5 ids: over 4,000 keys the pair
    of the target's choices follows p x p (chi-square, tests/reference.py's bound), and not a
    draw shared between depths (the pair would always agree)."""
    from collections import Counter
    from types import SimpleNamespace

    from tests.reference import chi2_statistic, chi2_threshold
    from tinydraft_mlx import SamplingParams
    from tinydraft_mlx.engine.tree_verify import choices

    p = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = mx.array(np.log(p)[None, None].repeat(2, axis=1).astype(np.float32))
    tree = Tree([0, 1], [-1, 0], [0, 1])
    counts, n = Counter(), 4000
    keys = mx.random.split(mx.random.key(5), n)
    for i in range(n):
        row = SimpleNamespace(sampling=SamplingParams(1.0), seq=[0], verify_key=keys[i])
        a, b = choices([row], {0: tree}, logits)[0].tolist()
        counts[(a, b)] += 1
    exact = {(a, b): p[a] * p[b] for a in range(5) for b in range(5)}
    stat, df = chi2_statistic(counts, exact, n)
    assert stat < chi2_threshold(df), (stat, df)
    assert sum(c for (a, b), c in counts.items() if a == b) < 0.5 * n  # sum p^2 = 0.285


def test_prompt_lookup_offers_its_latest_continuations_as_a_trie():
    """The n-gram index keeps the latest continuations of each n-gram; merged, the shared
    prefix is one branch, and the budget cuts the later continuations."""
    from tinydraft_mlx.engine.drafters.lookup import NgramIndex
    from tinydraft_mlx.engine.trees import trie

    seq = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 7, 9, 1, 2]
    index = NgramIndex(seq, 2, 3)
    assert index.propose(3) == [7, 9, 1]  # the latest continuation of (9, 1, 2)
    found = index.continuations(3, 8)
    assert found == [[7, 9, 1], [3, 5, 9], [3, 4, 9]]
    tree = trie(2, found, 7)
    assert _paths(tree) == {(7,), (7, 9), (7, 9, 1), (3,), (3, 5), (3, 5, 9), (3, 4)}
    assert [tree.tokens[i] for i in tree.spine] == [7, 9, 1]
    _check_shape(tree)
    assert _paths(trie(2, found, 8)) == _paths(tree) | {(3, 4, 9)}
    assert len(trie(2, found, 4)) == 5


def test_auto_tries_each_size_then_takes_the_fastest_and_retries_the_others():
    """Budget 16: trees of 16, 8 and 4 nodes and the chain, each tried once, largest first;
    then the fastest, each other one again after RETRY rounds of the others, and after twice
    as many each time it loses again (a retry may wait behind another one due: at most as
    many rounds as there are arms); a size that becomes the fastest is kept."""
    from tinydraft_mlx.engine.policy import TreeChoice

    choice = TreeChoice(16)
    assert choice.arms == [16, 8, 4, None]
    assert TreeChoice(5).arms == [5, None] and TreeChoice(1).arms == [1, None]
    rates = {16: 2.0, 8: 4.0, 4: 1.0, None: 3.0}  # tokens per 1-second round
    runs = []
    for _ in range(300):
        runs.append(choice.budget())
        assert choice.tree() == (runs[-1] is not None)
        choice.book(runs[-1], rates[runs[-1]], 1.0)
    assert runs[:4] == [16, 8, 4, None]
    assert runs.count(8) > 0.85 * len(runs)
    for arm in (16, 4, None):
        at = [i for i, r in enumerate(runs) if r == arm]
        gaps = [b - a - 1 for a, b in zip(at, at[1:])]  # rounds of the others in between
        wait = TreeChoice.RETRY
        for gap in gaps:
            assert wait <= gap <= wait + len(choice.arms), (arm, gaps)
            wait = min(2 * wait, TreeChoice.MAX_WAIT)
        assert len(gaps) >= 4
    rates[4] = 50.0  # now the fastest: taken from its next retry on
    while choice.budget() != 4:
        choice.book(choice.budget(), rates[choice.budget()], 1.0)
    runs = []
    for _ in range(200):
        runs.append(choice.budget())
        choice.book(runs[-1], rates[runs[-1]], 1.0)
    assert runs[0] == 4 and runs.count(4) > 0.85 * len(runs)


# -- one tree forward --------------------------------------------------------------------------
def _random_tree(rng: random.Random, last: int, nodes: int, vocab: int) -> Tree:
    tokens, parents, depths = [last], [-1], [0]
    for i in range(1, nodes):
        parent = rng.randrange(i)
        tokens.append(rng.randrange(vocab))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return Tree(tokens, parents, depths)


@pytest.mark.usefixtures("cpu_fp32")
def test_tree_logits_equal_the_oracle_along_every_branch(eagle):
    """Two rows of different lengths in a BatchCache, trees of 12 and 7 random nodes: node i's
    logits == the oracle's at the end of prompt + the path to i; then the compaction of a path
    per row leaves the cache equal to a plain prefill of prompt + that path."""
    from mlx_lm.models.cache import make_prompt_cache

    from tinydraft_mlx.engine.cache import layer_kinds
    from tinydraft_mlx.engine.cache.batch import BatchCache
    from tinydraft_mlx.engine.forward import prefill
    from tinydraft_mlx.engine.tree_verify import compact, forward, layout

    _, _, (target, _, _), _, refs, oracle = eagle
    rng = random.Random(3)
    prompts = [refs[0][0], refs[2][0]]
    rows = BatchCache(layer_kinds(target))
    solo = []
    for ids in prompts:
        cache = make_prompt_cache(target)
        prefill(target, cache, ids[:-1])
        solo.append(cache)
    rows.add(solo)
    trees = [_random_tree(rng, prompts[0][-1], 12, 200), _random_tree(rng, prompts[1][-1], 7, 200)]
    placed = layout(trees)
    logits = forward(target, rows, placed.tokens, placed)
    worst = 0.0
    for b, (ids, tree) in enumerate(zip(prompts, trees)):
        for i in range(len(tree)):
            path = [tree.tokens[j] for j in reversed(tree.ancestors(i)[:-1])]
            want = oracle.logits(ids + path)[-1]
            worst = max(worst, float(np.abs(np.array(logits[b, i]) - want).max()))
    assert worst < 1e-4, worst
    # the deepest node's path of each row into place
    paths = []
    for tree in trees:
        deepest = max(range(len(tree)), key=lambda i: tree.depths[i])
        paths.append(list(reversed(tree.ancestors(deepest))))
    starts = [len(ids) - 1 for ids in prompts]
    compact(rows.kv, starts, paths)
    rows.rollback([s + len(p) for s, p in zip(starts, paths)])
    for b, (ids, tree, path) in enumerate(zip(prompts, trees, paths)):
        seq = ids + [tree.tokens[j] for j in path[1:]]
        fresh = make_prompt_cache(target)
        prefill(target, fresh, seq)
        n = len(seq)
        mine = rows.extract(b)
        for ours, theirs in zip(mine, fresh):
            assert ours.offset == theirs.offset == n
            for a, c in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                assert float(mx.abs(a[..., :n, :] - c[..., :n, :]).max()) < 1e-4


# -- trees in the engine -----------------------------------------------------------------------
def _drafters(eagle, dflash):
    _, _, (_, head, _), draft, _, _ = eagle
    return {"model": (draft, 4), "mtp": ("mtp", 3), "eagle3": (head, 4), "dflash": (dflash, 7)}


@pytest.mark.usefixtures("cpu_fp32")
@pytest.mark.parametrize("budget", [4, 16, 32])
@pytest.mark.parametrize("name", ["model", "mtp", "eagle3", "dflash"])
def test_greedy_trees_equal_the_oracle(eagle, dflash, name, budget):
    """One sequence at a time (its own caches), then three prompts in one batch."""
    from tinydraft_mlx import batch_generate, generate

    _, _, (target, _, tok), draft, refs, _ = eagle
    source, k = _drafters(eagle, dflash)[name]
    model = draft if name == "model" else None
    nodes = accepted = 0
    for ids, ref in refs:
        out, stats = generate(target, source if model is None else model, tok, ids, k=k,
                              max_tokens=NEW, tree=budget)
        assert out == ref
        nodes, accepted = nodes + stats.drafted, accepted + stats.accepted
        assert all(r <= budget for r in stats.k_histogram)
    assert accepted > 0 and nodes > accepted
    batch = batch_generate(target, source if model is None else model, tok,
                           [ids for ids, _ in refs[:3]], k=k, max_tokens=NEW, tree=budget)
    assert [tokens for tokens, _ in batch] == [ref for _, ref in refs[:3]]


@pytest.mark.usefixtures("cpu_fp32")
def test_prompt_lookup_trees_equal_the_oracle(demo, demo_oracle):
    """A prompt that repeats with different continuations: prompt lookup's tree (budget 16)
    verifies several of them a round; greedy == the oracle, alone and two in a batch."""
    from tinydraft_mlx import batch_generate, generate

    target, _, tok = demo
    text = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(6)) + "def f"
    plain, margin = demo_oracle.greedy(tok.encode(text), 40)
    assert margin > 1e-4  # no near-tie on the path
    chain, chained = generate(target, "prompt-lookup", tok, text, k=6, max_tokens=40)
    tree, grown = generate(target, "prompt-lookup", tok, text, k=6, max_tokens=40, tree=16)
    assert chain == tree == plain
    assert grown.drafted > chained.drafted and grown.accepted > 0
    both = batch_generate(target, "prompt-lookup", tok, [text, text], k=6, max_tokens=40,
                          tree=16)
    assert all(ids == plain for ids, _ in both)


@pytest.mark.usefixtures("cpu_fp32")
@pytest.mark.parametrize("name", ["model", "dflash"])
def test_auto_with_a_budget_mixes_tree_and_chain_rounds_exactly(eagle, dflash, name):
    """k="auto" and tree=8: rounds of the tree and of the k="auto" chain (plain steps
    included), greedy == the oracle, alone and batched."""
    from tinydraft_mlx import batch_generate, generate

    _, _, (target, _, tok), draft, refs, _ = eagle
    source = _drafters(eagle, dflash)[name][0]
    source = draft if name == "model" else source
    kinds = set()
    for ids, ref in refs:
        out, stats = generate(target, source, tok, ids, k="auto", tree=8, max_tokens=NEW)
        assert out == ref
        kinds |= set(stats.k_histogram)
    assert 8 in kinds and len(kinds) > 1  # tree rounds (8 nodes) and chain rounds
    batch = batch_generate(target, source, tok, [ids for ids, _ in refs[:3]], k="auto",
                           tree=8, max_tokens=NEW)
    assert [tokens for tokens, _ in batch] == [ref for _, ref in refs[:3]]


@pytest.mark.usefixtures("cpu_fp32")
def test_eight_rows_of_trees_chains_and_plain_equal_the_oracle(eagle, dflash):
    """B = 8 joining at once: trees of each drafter and budget beside chains and a plain row."""
    from tests.reference import drain
    from tinydraft_mlx import BatchDecoder

    _, _, (target, head, tok), draft, refs, _ = eagle
    rows = [(dflash, 15, 32), (dflash, 7, None), ("model", 4, 16), ("model", 3, None),
            (head, 4, 8), ("mtp", 2, 4), (None, 1, None), ("prompt-lookup", 3, 8)]
    decoder = BatchDecoder(target, draft)
    want = {}
    for j, (source, k, tree) in enumerate(rows):
        ids, ref = refs[j % len(refs)]
        want[decoder.insert(ids, draft=source, k=k, max_tokens=NEW, tree=tree)] = ref
    out = drain(decoder)
    assert all(out[uid] == ref for uid, ref in want.items())


@pytest.mark.usefixtures("cpu_fp32")
@pytest.mark.parametrize("name", ["dflash", "model"])
def test_sampled_first_two_tokens_follow_the_oracle(eagle, dflash, name):
    """T = 1, top-p 0.8, budget 8, 2,000 rows 100 at a time, against the oracle's exact joint
    (and not the joint without top-p)."""
    from tests.reference import check_first_two_tokens, two_step_joint
    from tinydraft_mlx import BatchDecoder, SamplingParams

    target, oracle, ids, draft = eagle[2][0], eagle[5], eagle[4][0][0], eagle[3]
    source, k = _drafters(eagle, dflash)[name]
    exact = two_step_joint(oracle.logits, ids, temperature=1.0, top_p=0.8)
    wrong = two_step_joint(oracle.logits, ids, temperature=1.0)
    check_first_two_tokens(lambda: BatchDecoder(target, draft), ids, source, 2000, exact,
                           wrong, k=k, tree=8, sampling=lambda seed: SamplingParams(1.0, top_p=0.8))


@pytest.mark.usefixtures("cpu_fp32")
def test_sampled_first_two_tokens_inside_mixed_batches(eagle, dflash):
    """Draft-model tree rows (T = 1, top-p 0.8, k = 2, budget 6: a spine tested by rejection
    and its siblings) in batches that DFlash trees, seeded, greedy and chain rows join: 1,200
    rows against the oracle's exact joint."""
    from tests.reference import check_first_two_in_batches, two_step_joint
    from tinydraft_mlx import BatchDecoder, SamplingParams

    _, _, (target, head, _), draft, refs, oracle = eagle
    ids = refs[2][0]
    exact = two_step_joint(oracle.logits, ids, temperature=1.0, top_p=0.8)
    wrong = two_step_joint(oracle.logits, ids, temperature=1.0)
    companions = [(SamplingParams(), dflash, 7), (SamplingParams(0.7, seed=5), "model", 3),
                  (SamplingParams(0.9), head, 2)]
    check_first_two_in_batches(lambda: BatchDecoder(target, draft), ids, "model",
                               SamplingParams(1.0, top_p=0.8), companions,
                               [refs[0][0], refs[1][0]], exact, wrong, batches=12, rows=100,
                               every=50, tree=6)


@pytest.mark.usefixtures("cpu_fp32")
def test_a_seed_fixes_the_text_with_trees(eagle, dflash):
    """Seeded rows with trees of each drafter == plain decoding with the seed, alone and
    together in one batch with unseeded companions."""
    from tests.reference import drain
    from tinydraft_mlx import BatchDecoder, SamplingParams, generate

    _, _, (target, _, tok), draft, refs, _ = eagle
    kw = dict(max_tokens=NEW, temperature=0.8, top_p=0.95, seed=7)
    ids = refs[1][0]
    plain, _ = generate(target, None, tok, ids, **kw)
    sources = _drafters(eagle, dflash)
    for name, (source, k) in sources.items():
        assert generate(target, draft if name == "model" else source, tok, ids, k=k, tree=16,
                        **kw)[0] == plain, name
    decoder = BatchDecoder(target, draft)
    decoder.insert(refs[2][0], draft=dflash, k=7, max_tokens=8, sampling=SamplingParams(0.7),
                   tree=8)
    uids = [decoder.insert(ids, draft=source, k=k, max_tokens=NEW, tree=16,
                           sampling=SamplingParams(0.8, top_p=0.95, seed=7))
            for source, k in sources.values()]
    out = drain(decoder)
    assert all(out[uid] == plain for uid in uids)


@pytest.mark.usefixtures("cpu_fp32")
def test_logprobs_of_a_tree_are_plain_decodings(eagle, dflash):
    from tinydraft_mlx import stream_generate

    _, _, (target, _, tok), _, refs, _ = eagle
    ids = refs[0][0]
    plain = list(stream_generate(target, None, tok, ids, max_tokens=12))
    tree = list(stream_generate(target, dflash, tok, ids, k=7, max_tokens=12, tree=16))
    assert [r.token for r in tree] == [r.token for r in plain]
    assert any(r.from_draft for r in tree)
    for a, b in zip(plain, tree):
        assert float(mx.abs(a.logprobs - b.logprobs).max()) < 1e-4

"""Candidate trees and the caches (engine/tree_verify.py's commit and ring layouts): after tree
rounds the target's cache == a plain prefill of the emitted sequence, a draft model's a prefix
of it (a block drafter's context after tree rounds: tests/test_dflash.py);
sliding-window rings (Gemma 3) and bounded caches against the oracle and uncached windowed
passes; prompt caches across turns; the server's default and per-request trees; the one-line
refusals.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

NEW = 24


@pytest.mark.usefixtures("cpu_fp32")
def test_the_caches_after_tree_rounds_hold_the_emitted_sequence(eagle):
    """Eight seeded rows at T = 1 (trees accepted in part), a draft model drafting, each row's
    caches kept: the target's == a plain prefill of its sequence, the draft model's == a plain
    prefill of the prefix it holds, which is the sequence's (nothing of a rejected branch)."""
    from mlx_lm.models.cache import make_prompt_cache

    from tests.reference import kept_rows
    from tinydraft_mlx import BatchDecoder
    from tinydraft_mlx.engine.forward import prefill

    _, _, (target, _, _), draft, refs, _ = eagle
    decoder = BatchDecoder(target, draft)
    accepted = 0
    for seq, done in kept_rows(decoder, refs[0][0], 8, draft="model", k=4, max_tokens=NEW,
                               tree=12):
        accepted += done.stats.accepted
        for model, cache in ((target, done.target_cache), (draft, done.draft_cache)):
            n = cache[0].offset
            assert n <= len(seq) - 1 and (model is draft or n == len(seq) - 1)
            fresh = make_prompt_cache(model)
            prefill(model, fresh, seq[:n])
            for ours, theirs in zip(cache, fresh):
                for a, c in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                    assert float(mx.abs(a[..., :n, :] - c[..., :n, :]).max()) < 1e-4
    assert accepted > 0


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny Gemma 3 pair (five sliding-window layers of 8 positions to one full-attention
    layer, tests/fixtures.py) and the oracle's greedy references of two prompts that wrap the
    window."""
    from tests.fixtures import HEAD_PROMPTS, build_family_pair
    from tests.oracle import Oracle
    from tinydraft_mlx import load_models

    target_dir, draft_dir = build_family_pair(tmp_path_factory.mktemp("gemma3"), "gemma3")
    target, draft, tok = load_models(str(target_dir), str(draft_dir), dtype="float32")
    refs = Oracle(target_dir).references(tok, HEAD_PROMPTS[:2], 32, 1e-3, "gemma3")
    return target, draft, tok, refs


@pytest.mark.usefixtures("cpu_fp32")
@pytest.mark.parametrize("budget", [4, 16])
def test_sliding_window_targets_verify_trees_exactly(gemma3, budget):
    """Gemma 3's sliding-window rings hold the tree's nodes (each sees its own position's
    window): greedy == the oracle alone and in a batch beside a chain row, and a seed fixes
    the text."""
    from tests.reference import drain
    from tinydraft_mlx import BatchDecoder, generate

    target, draft, tok, refs = gemma3
    assert all(len(ids) > 8 for ids, _ in refs)
    nodes = 0
    for ids, ref in refs:
        out, stats = generate(target, draft, tok, ids, k=4, max_tokens=32, tree=budget)
        assert out == ref
        nodes += stats.drafted
    assert nodes > 0
    decoder = BatchDecoder(target, draft, max_k=16)
    want = {decoder.insert(ids, draft="model", k=4, max_tokens=32, tree=tree): ref
            for (ids, ref), tree in zip(refs, (budget, None))}
    out = drain(decoder)
    assert all(out[uid] == ref for uid, ref in want.items())
    kw = dict(max_tokens=24, temperature=0.8, seed=3)
    ids = refs[0][0]
    assert generate(target, draft, tok, ids, k=4, tree=budget, **kw)[0] == \
        generate(target, None, tok, ids, **kw)[0]


@pytest.mark.usefixtures("cpu_fp32")
def test_bounded_caches_verify_trees_exactly(eagle, dflash):
    """max_kv_size 16 (the prompt wraps it): a tree's greedy output == the greedy path of
    uncached passes in which each position sees the 4 sinks and its latest 12 positions
    (tests/reference.py's `windowed_logits`), alone and in a batch; the budget is checked
    against what the window holds beside its sinks."""
    from tests.reference import windowed_logits
    from tinydraft_mlx import batch_generate, generate
    from tinydraft_mlx.engine.sampling import ParameterError

    _, _, (target, _, tok), draft, refs, _ = eagle
    ids = refs[0][0]
    assert len(ids) > 16
    plain = []
    for _ in range(NEW):
        plain.append(int(windowed_logits(target, ids + plain, 16)[-1].argmax()))
    for source, k in ((draft, 4), ("mtp", 3)):
        out, stats = generate(target, source, tok, ids, k=k, max_tokens=NEW, tree=8,
                              max_kv_size=16)
        assert out == plain and stats.accepted > 0
    both = batch_generate(target, draft, tok, [ids, ids], k=4, max_tokens=NEW, tree=8,
                          max_kv_size=16)
    assert all(tokens == plain for tokens, _ in both)
    with pytest.raises(ParameterError, match="a round of tree=12 writes 13 positions"):
        generate(target, draft, tok, ids, k=4, max_tokens=4, tree=12, max_kv_size=16)


@pytest.mark.usefixtures("cpu_fp32")
def test_refusals_are_one_line(eagle):
    from tinydraft_mlx import generate
    from tinydraft_mlx.engine.sampling import ParameterError

    _, _, (target, _, tok), draft, refs, _ = eagle
    ids = refs[0][0]
    cases = [
        (dict(tree=0), "tree must be None or an integer node budget in [1, 64] (got 0)"),
        (dict(tree=65), "(got 65)"),
        (dict(tree=True), "(got True)"),
        (dict(tree=4, repetition_penalty=1.1), "None with logits processors or penalties"),
        (dict(tree=4, k=2, bitwise=True), "None with bitwise"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ParameterError) as err:
            generate(target, draft, tok, ids, max_tokens=4, **kwargs)
        assert words in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ParameterError, match="None without a drafter"):
        generate(target, None, tok, ids, max_tokens=4, tree=4)
    # what the server asks before a request runs (a bound its window must hold)
    from tinydraft_mlx import make_options
    from tinydraft_mlx.engine.drafters import resolve_drafter
    from tinydraft_mlx.generation.api import check_tree

    with pytest.raises(ParameterError, match=r"at most 11 with max_kv_size 16 .* \(got 12\)"):
        check_tree(target, resolve_drafter(draft, target=target), make_options(tree=12), 16)
    check_tree(target, resolve_drafter(draft, target=target), make_options(tree=11), 16)


@pytest.mark.usefixtures("cpu_fp32")
def test_the_server_verifies_trees_by_default_and_per_request(eagle, tmp_path):
    """`--tree 16` with a DFlash drafter: requests that leave `tree` out get the default, a
    request may set its own; a plain request and one with a penalty still run (the default
    applies where it can); a tree the request cannot have is a 400 naming `tree`. Greedy ==
    the oracle throughout."""
    import httpx

    from tests.fixtures import write_dflash
    from tests.test_server import Served
    from tinydraft_mlx.server import build_app, setup_arg_parser

    out = write_dflash(eagle[0], tmp_path / "d", steps=1)
    ids, ref = eagle[4][0]
    app = build_app(setup_arg_parser().parse_args(
        ["--target", str(eagle[0]), "--draft", str(out), "-k", "7", "--tree", "16"]))
    served = Served(app)
    try:
        booked = np.zeros(2)
        for body, tree in (({}, 16), ({"tree": 4}, 4), ({"draft": "none"}, None),
                           ({"repetition_penalty": 1.0}, None)):
            r = httpx.post(served.url + "/v1/completions", timeout=60, json={
                "prompt": ids, "max_tokens": NEW, "temperature": 0, **body})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["tinydraft"]["token_ids"] == ref
            usage = r.json()["usage"]["speculative"]
            assert usage["tree"] == tree
            if tree:
                booked += [usage["drafted"], usage["accepted"]]
        for body, words in (({"draft": "none", "tree": 4}, "None without a drafter"),
                            ({"tree": 0}, "[1, 64]"),
                            ({"tree": 4, "repetition_penalty": 1.1}, "logits processors")):
            r = httpx.post(served.url + "/v1/completions", timeout=60, json={
                "prompt": ids, "max_tokens": 4, **body})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "tree" and words in error["message"], error
        metrics = httpx.get(served.url + "/metrics", timeout=10).text
        nodes, accepted = (float(next(line.split()[-1] for line in metrics.splitlines()
                                      if line.startswith(f'{name}_total{{draft="dflash"}}')))
                           for name in ("tinydraft_tree_nodes", "tinydraft_tree_accepted_nodes"))
        assert (nodes, accepted) == tuple(booked) and nodes > 0
    finally:
        served.close()


@pytest.mark.usefixtures("cpu_fp32")
def test_a_prompt_cache_carries_a_conversation_with_trees(eagle, dflash):
    """Two turns on one PromptCache with a DFlash tree: the second reuses the first's caches
    (cached tokens) and both equal the oracle's greedy continuation."""
    from tinydraft_mlx import PromptCache, generate

    _, _, (target, _, tok), _, refs, oracle = eagle
    ids, ref = refs[1]
    cache = PromptCache(target, dflash)
    first, _ = generate(target, dflash, tok, ids, k=7, tree=16, max_tokens=8,
                        prompt_cache=cache)
    assert first == ref[:8]
    turn = ids + first + [5, 6]
    want, _ = oracle.greedy(turn, 10)
    second, stats = generate(target, dflash, tok, turn, k=7, tree=16, max_tokens=10,
                             prompt_cache=cache)
    assert stats.cached_tokens >= len(ids) + 7
    assert second == want

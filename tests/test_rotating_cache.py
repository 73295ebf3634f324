"""Bounded generation: the rollback-able rotating cache against a from-scratch windowed reference,
against mlx-lm's RotatingKVCache, and speculative vs plain decoding with the same max_kv_size."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from tests.reference import windowed_logits
from tinydraft_mlx import generate
from tinydraft_mlx.engine.cache import KEEP, RollbackRotatingKVCache, make_cache
from tinydraft_mlx.engine.speculative import decode

PROMPT = "def parse_args(self, args=None, namespace=None):"  # 20 tokens


def _reference_greedy(model, ids, window, n):
    """Greedy decoding recomputing every step from scratch with the explicit windowed mask.
    Returns the tokens and the smallest top-1/top-2 logit gap on the path."""
    seq, margin = list(ids), np.inf
    for _ in range(n):
        last = windowed_logits(model, seq, window)[-1]
        top2 = np.sort(last)[-2:]
        margin = min(margin, top2[1] - top2[0])
        seq.append(int(last.argmax()))
    return seq[len(ids):], margin


@pytest.fixture(scope="module")
def same_draft(load):
    return load("target", "target")[1]


def test_plain_decoding_matches_brute_force_window(pair):
    target, _, tok = pair
    ids, window = tok.encode(PROMPT), 24
    ref, margin = _reference_greedy(target, ids, window, 3 * window + 8)
    assert margin > 1e-3 and len(set(ref)) >= 8
    unbounded, _ = generate(target, None, tok, ids, max_tokens=len(ref))
    assert unbounded != ref  # the window really changes the output
    out, _ = generate(target, None, tok, ids, max_tokens=len(ref), max_kv_size=window)
    assert out == ref


def test_prompt_longer_than_window_matches_brute_force(pair):
    """Prefill in one chunk larger than the ring takes the concatenating path."""
    target, _, tok = pair
    ids = tok.encode(PROMPT * 3)
    assert len(ids) > 2 * 24
    ref, margin = _reference_greedy(target, ids, 24, 30)
    assert margin > 1e-3
    assert generate(target, None, tok, ids, max_tokens=30, max_kv_size=24)[0] == ref


def test_matches_mlx_lm_rotating_cache(pair):
    target, _, tok = pair
    ids, window, n = tok.encode(PROMPT), 32, 100
    assert len(ids) < window
    theirs = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), target, max_tokens=n,
                                                        max_kv_size=window), range(n))]
    ours, _ = generate(target, None, tok, ids, max_tokens=n, max_kv_size=window)
    assert ours == theirs


@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_equals_plain_with_same_window(pair, same_draft, k):
    target, draft, tok = pair
    ids, window, n = tok.encode(PROMPT), 24, 120
    ring = window - KEEP + k + 1
    assert (len(ids) + n) / ring > 4  # wraps several times, so rounds straddle the wrap point
    plain, _ = generate(target, None, tok, ids, max_tokens=n, max_kv_size=window)
    out, stats = generate(target, draft, tok, ids, k=k, max_tokens=n, max_kv_size=window)
    assert out == plain and 0 < stats.accepted < stats.drafted
    out, stats = generate(target, same_draft, tok, ids, k=k, max_tokens=n, max_kv_size=window)
    assert out == plain and stats.acceptance_rate == 1.0  # every round fully accepted


def test_cache_bytes_constant_once_full(pair):
    target, draft, tok = pair
    window = 16
    tc, dc = make_cache(target, window, margin=4), make_cache(draft, window, margin=4)
    sizes, stats = [], None
    for token in decode(target, draft, tok.encode(PROMPT), k=3, max_tokens=10 * window,
                        target_cache=tc, draft_cache=dc):
        sizes.append(sum(c.nbytes for c in tc) + sum(c.nbytes for c in dc))
        stats = token.stats
    assert len(sizes) == 10 * window and stats.generated == 10 * window
    assert sizes[0] > 0 and len(set(sizes)) == 1
    unbounded = make_cache(target)
    list(decode(target, None, tok.encode(PROMPT), max_tokens=300, target_cache=unbounded))
    assert sum(c.nbytes for c in unbounded) > sum(c.nbytes for c in tc)  # growth it avoids


def test_trim_after_wrap_is_bounded_by_margin():
    cache = RollbackRotatingKVCache(8, keep=2, margin=3)
    x = mx.zeros((1, 1, 20, 4))
    cache.update_and_fetch(x, x)
    assert cache.trim(4) == 4 and cache.offset == 16
    with pytest.raises(ValueError, match="at most margin \\+ 1 = 4"):
        cache.trim(5)


def test_window_too_small_for_k(pair):
    target, draft, tok = pair
    with pytest.raises(ValueError, match="max_kv_size must be an integer >= 9"):
        generate(target, draft, tok, PROMPT, k=4, max_kv_size=8)
    with pytest.raises(ValueError, match="max_kv_size must be an integer >= 5"):
        generate(target, None, tok, PROMPT, max_kv_size=4)
    # the default k="auto" drafts up to 8 tokens a round: the message says why 13 and what helps
    with pytest.raises(ValueError, match=r"max_kv_size must be an integer >= 13 \(a round of "
                       r"k='auto' writes 9 positions beside the 4 kept; a smaller window needs "
                       r"a smaller k\) \(got 12\)"):
        generate(target, draft, tok, PROMPT, max_kv_size=12)
    assert len(generate(target, draft, tok, PROMPT, k=4, max_kv_size=12, max_tokens=8)[0]) == 8


def test_bounds_apply_to_full_attention_and_other_caches_are_refused_before_work():
    """max_kv_size bounds full-attention layers; a sliding-window layer keeps its own window (a
    rollback-able ring of it); a cache of another kind (here a quantized one) is refused."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    model = SimpleNamespace(make_cache=lambda: [KVCache(), RotatingKVCache(16)], layers=[0, 1])
    cache = make_cache(model, max_kv_size=64)
    assert all(isinstance(c, RollbackRotatingKVCache) for c in cache)
    assert [c.max_kv_size for c in cache] == [64, 16]
    other = SimpleNamespace(make_cache=lambda: [KVCache(), QuantizedKVCache()], layers=[0, 1])
    with pytest.raises(ValueError, match="caches of another kind"):
        make_cache(other, max_kv_size=64)
    plain = SimpleNamespace(make_cache=lambda: [KVCache(), KVCache()], layers=[0, 1])
    assert len(make_cache(plain, max_kv_size=64)) == 2

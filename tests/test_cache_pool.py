"""The server's prompt-cache pool (LRU, bounded in bytes) and `PromptCache.copy`."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tinydraft_mlx import PromptCache, generate
from tinydraft_mlx.engine.cache import cache_length
from tinydraft_mlx.serving.cache_pool import PromptCachePool, common_prefix


class Fake:
    """Stands in for a PromptCache: tokens, a size, and copy()."""

    def __init__(self, tokens, nbytes=100, name="", cut=True):
        self.tokens, self.nbytes, self.name, self.copied = list(tokens), nbytes, name, False
        self.cut = cut  # False: as a recurrent target's, usable only up to its end

    def usable(self, prompt, cap=None):
        """What a real PromptCache's `usable` answers: the target holds tokens[:-1]."""
        keep = min(common_prefix(self.tokens, prompt), len(prompt) - 1, len(self.tokens) - 1)
        keep = keep if cap is None else cap(keep)
        return keep if self.cut or keep == len(self.tokens) - 1 else 0

    def copy(self):
        clone = Fake(self.tokens, self.nbytes, self.name + "'", self.cut)
        clone.copied = True
        return clone


def pool(max_bytes=1000):
    return PromptCachePool(lambda: Fake([], 0, "new"), max_bytes)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2]) == 2


def test_take_prefers_the_longest_prefix_and_moves_a_whole_match():
    p = pool()
    a, b = Fake([1, 2, 3], name="a"), Fake([1, 2, 3, 4, 5], name="b")
    p.put(a)
    p.put(Fake([9, 9], name="c"))
    p.put(b)  # a is a prefix of b: redundant, dropped
    assert len(p) == 2
    taken = p.take([1, 2, 3, 4, 5, 6])
    assert taken is b and len(p) == 1  # the next turn of b's conversation: moved out
    assert p.take([7]).name == "new"  # nothing shares a token


def test_a_partial_match_is_copied_and_the_original_stays():
    p = pool()
    a = Fake([1, 2, 3, 4], name="a")
    p.put(a)
    taken = p.take([1, 2, 7])
    assert taken is not a and taken.copied and taken.tokens == [1, 2, 3, 4]
    assert len(p) == 1 and p.take([1, 2, 3, 4, 5]) is a


def test_a_longer_prefix_a_recurrent_cache_cannot_cut_back_to_loses():
    """A recurrent target's cache after [1..6] shares 4 tokens with [1, 2, 3, 4, 7] but its
    state cannot go back to 4 (it would prefill everything again); a cache sharing 3 that can
    be cut back is taken instead. The same recurrent cache is the one taken for its own next
    turn."""
    p = pool()
    recurrent = Fake([1, 2, 3, 4, 5, 6], name="recurrent", cut=False)
    p.put(Fake([1, 2, 3, 9, 9], name="cuttable"))
    p.put(recurrent)
    assert p.take([1, 2, 3, 4, 7]).name == "cuttable'"
    assert p.take([1, 2, 3, 4, 5, 6, 8]) is recurrent


def test_a_real_prompt_cache_says_what_its_reuse_keeps(pair):
    target, draft, tok = pair
    pc = PromptCache(target, draft)
    ids = tok.encode("def parse_args(self):")
    generate(target, draft, tok, ids, max_tokens=4, prompt_cache=pc)
    assert pc.usable(pc.tokens + [5]) == cache_length(pc.target_cache) == len(pc.tokens) - 1
    assert pc.usable(ids[:3] + [7, 7]) == 3 and pc.usable([7]) == 0


def test_eviction_is_least_recently_used_within_the_byte_budget():
    p = pool(max_bytes=250)
    a, b, c = Fake([1], name="a"), Fake([2], name="b"), Fake([3], name="c")
    p.put(a)
    p.put(b)
    p.take([1, 5])  # a: whole match, taken out and put back below (most recent)
    p.put(a)
    p.put(c)  # 300 bytes > 250: the least recently used (b) goes
    assert p.take([2]).name == "new"
    assert p.take([1]) is a and p.take([3]) is c
    p.put(Fake([4], nbytes=251))  # larger than the whole budget: not kept
    assert len(p) == 0 and p.nbytes == 0
    p.put(Fake([]))  # empty: not kept
    assert len(p) == 0


def test_bad_budget():
    with pytest.raises(ValueError, match=r"max_bytes must be an integer >= 0 \(got -1\)"):
        pool(max_bytes=-1)


@pytest.mark.parametrize("max_kv_size", [None, 24])
def test_prompt_cache_copy_is_independent(pair, max_kv_size):
    """Extending a copy leaves the original's arrays and tokens as they were: continuing the
    original afterwards gives the same output as a fresh run."""
    target, draft, tok = pair
    prompt = [5, 9, 3, 17, 4, 8, 2]
    pc = PromptCache(target, draft, max_kv_size=max_kv_size)
    first, _ = generate(target, draft, tok, prompt, k=3, max_tokens=10, prompt_cache=pc)
    before = [mx.array(layer.keys) for layer in pc.target_cache]
    tokens, length = list(pc.tokens), cache_length(pc.target_cache)
    clone = pc.copy()
    assert clone.tokens == tokens and clone.nbytes == pc.nbytes
    generate(target, draft, tok, prompt + first + [11, 12], k=3, max_tokens=30,
             prompt_cache=clone)  # extends the copy past the original (and wraps a bound)
    assert pc.tokens == tokens and cache_length(pc.target_cache) == length
    assert all(mx.array_equal(b, layer.keys).item() for b, layer in zip(before, pc.target_cache))
    follow = prompt + first + [6, 6]
    expected, _ = generate(target, draft, tok, follow, k=3, max_tokens=12,
                           max_kv_size=max_kv_size)
    out, stats = generate(target, draft, tok, follow, k=3, max_tokens=12, prompt_cache=pc)
    assert out == expected and stats.cached_tokens > 0

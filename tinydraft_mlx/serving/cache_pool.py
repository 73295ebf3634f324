"""A pool of prompt caches for a server: recent conversations, least recently used first out,
bounded in bytes.

A request takes the cache that shares the longest prefix with its prompt. When the cached tokens
are all a prefix of the prompt (the next turn of that conversation) the cache itself is taken out
of the pool and extended; when only part of them match (another conversation with the same system
prompt, an edited message) a copy is taken, so the cached conversation stays whole for its own
next turn. Whatever the generation did, the caller puts the cache back (`put`), and the pool
evicts the least recently used caches until it fits its byte budget again.

Not thread-safe: the server's single generation thread is its only user.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..generation.prompt_cache import PromptCache, common_prefix


class PromptCachePool:
    """At most `max_bytes` of `PromptCache`s (both models' KV arrays); `new()` makes an empty one
    for a prompt that matches nothing."""

    def __init__(self, new: Callable[[], PromptCache], max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0 (got {max_bytes!r})")
        self.new, self.max_bytes = new, max_bytes
        self._entries: OrderedDict[int, PromptCache] = OrderedDict()  # id -> cache, LRU first

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[PromptCache]:
        """The pooled caches, least recently used first."""
        return iter(list(self._entries.values()))

    @property
    def nbytes(self) -> int:
        """Bytes held by the caches in the pool."""
        return sum(pc.nbytes for pc in self._entries.values())

    def take(self, prompt: Sequence[Any], cap: Callable[[int], int] | None = None) -> PromptCache:
        """The cache to generate `prompt` with: the pooled one whose reuse keeps the most of it
        (`PromptCache.usable`: a longer shared prefix that the target's cache cannot be cut back
        to, as a recurrent state's, keeps nothing), taken out when all its tokens match, else
        copied; a new one when none keeps a token. Reusing it (`PromptCache.reuse`) is the
        caller's job, as with any prompt cache. `prompt` and `cap`: as `PromptCache.reuse`
        takes them (a prompt with images: its key)."""
        best, best_score = None, (0, False)
        for key, pc in self._entries.items():
            whole = common_prefix(pc.tokens, prompt) == len(pc.tokens)
            score = (pc.usable(prompt, cap), whole)  # a tie: the conversation's own next turn
            if score > best_score:
                best, best_score = key, score
        if best is None:
            return self.new()
        pc = self._entries[best]
        if best_score[1]:
            del self._entries[best]
            return pc
        self._entries.move_to_end(best)
        return pc.copy()

    def put(self, pc: PromptCache) -> None:
        """Return a cache after a generation (most recently used now); evict least recently used
        caches until the pool fits `max_bytes`. A cache larger than the budget is dropped, and an
        empty one is not kept. A pooled cache whose tokens are a prefix of `pc`'s is redundant and
        goes too."""
        if not pc.tokens:
            return
        for key, other in list(self._entries.items()):
            if common_prefix(other.tokens, pc.tokens) == len(other.tokens):
                del self._entries[key]
        self._entries[id(pc)] = pc
        total = self.nbytes
        while self._entries and total > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            total -= evicted.nbytes

    def clear(self) -> None:
        """Drop every cache."""
        self._entries.clear()

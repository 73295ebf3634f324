"""Prompt caches: both models' KV caches and the tokens they hold, reused across generations
(multi-turn chat) and saved to / loaded from one safetensors file.

Reuse keeps the longest common prefix of the cached tokens and the new prompt (trimming the rest,
an O(1) offset change) and prefills only the new suffix. A bounded cache that has wrapped can
only be trimmed within its rollback margin; past that it is rebuilt (nothing reused). A file
records a fingerprint of the models it was made with and refuses others.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from ..engine.cache import (
    KEEP,
    Cache,
    RollbackRotatingKVCache,
    cache_length,
    can_cut,
    cut,
    make_cache,
    reachable,
    rollback,
)
from ..engine.cache.recurrent import RecurrentCache
from ..engine.drafters import draft_model, resolve_drafter

FORMAT = "tinydraft-mlx prompt cache 1"
MARGIN = 65  # rollback slots of a bounded prompt cache: enough for any k (1..64) + 1


class PromptCacheError(ValueError):
    """A prompt cache that cannot be used with these models, or a file that is not one; the
    message is one sentence."""


def fingerprint(model: nn.Module) -> str:
    """Identifies a checkpoint: parameter names, shapes and dtypes, and the first values of the
    first and last parameters (two checkpoints of one architecture differ there)."""
    flat = tree_flatten(model.parameters())
    digest = hashlib.sha256()
    for name, w in flat:
        digest.update(f"{name}:{w.shape}:{w.dtype};".encode())
    for _, w in (flat[0], flat[-1]):
        digest.update(np.array(w.reshape(-1)[:256].astype(mx.float32)).tobytes())
    return digest.hexdigest()[:32]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _trimmable_to(cache: Cache, keep: int) -> bool:
    """Whether rolling `cache` back to `keep` tokens leaves it consistent: a wrapped bounded
    layer goes back at most margin + 1 tokens, a recurrent layer only as far as its tape (its
    state is a snapshot at its last token: a shorter prefix cannot be had from it)."""
    drop = cache_length(cache) - keep
    return reachable(cache, keep) and not any(
        isinstance(layer, RollbackRotatingKVCache) and drop > layer.margin + 1
        and layer.offset > layer.slots for layer in cache)


class PromptCache:
    """Both models' caches and `tokens`, the sequence they were built from (prompt + output of
    the last generation; the target holds all of it but the last token, the draft a prefix).

    target, draft: the models (draft None, "prompt-lookup" or a `PromptLookup`: no draft cache).
    max_kv_size: bound both caches as `stream_generate(max_kv_size=...)` does.
    """

    def __init__(self, target: nn.Module, draft: Any = None, *,
                 max_kv_size: int | None = None) -> None:
        if max_kv_size is not None and (isinstance(max_kv_size, bool)
                                        or not isinstance(max_kv_size, int)
                                        or max_kv_size <= KEEP + 1):
            raise PromptCacheError(f"max_kv_size must be an integer > {KEEP + 1} "
                                   f"(got {max_kv_size!r})")
        self.drafter = resolve_drafter(draft, target=target)
        # a draft model is one of the cache's models (checked, fingerprinted in its file); a
        # head goes with its target (its cache, with what it has not read, starts anew)
        self.target, self.draft = target, draft_model(self.drafter, target)
        self.max_kv_size = max_kv_size
        self.tokens: list[int] = []
        self.in_use = False  # a generation is running on these caches
        self.target_cache = make_cache(target, max_kv_size, MARGIN)
        self.draft_cache = self.new_draft_cache()

    def drafts_for(self, drafter: Any) -> bool:
        """Whether its draft cache is `drafter`'s (a `Source`): the same drafting model."""
        return drafter.model is not None and drafter.model is self.drafter.model

    def new_draft_cache(self) -> Cache | None:
        """An empty cache for the drafter (None: it has no model)."""
        return self.drafter.row_cache(None, self.max_kv_size, MARGIN)

    def check_models(self, target: nn.Module, draft: Any) -> None:
        """PromptCacheError unless `target` and `draft` are the models this cache was made for."""
        if target is not self.target:
            raise PromptCacheError("this prompt cache was made for another target model")
        if draft_model(draft) is not None and draft is not self.draft:
            raise PromptCacheError("this prompt cache was made for another draft model "
                                   "(or without one)")

    def check_free(self) -> None:
        """PromptCacheError while a generation runs on this cache (two at once would corrupt
        both caches silently)."""
        if self.in_use:
            raise PromptCacheError("this prompt cache is in use by a generation that has not "
                                   "finished: finish or close that one first, or give this one "
                                   "another PromptCache (or none)")

    @contextmanager
    def taken(self) -> Iterator[PromptCache]:
        """Hold this cache for one generation: PromptCacheError if another holds it."""
        self.check_free()
        self.in_use = True
        try:
            yield self
        finally:
            self.in_use = False

    def reuse(self, prompt: list[Any], cap: Callable[[int], int] | None = None) -> int:
        """Make the caches hold a prefix of `prompt` (at most all but its last token): the common
        prefix with `tokens` where it can be kept, else nothing. Returns the target's reused
        tokens. `prompt`: token ids, or a prompt with images' key (`VisionPrompt.keys`);
        `cap(common)`: how much of a common prefix the prompt's prefill may start after."""
        keep = self._common(prompt, cap)
        target_keep = min(keep, cache_length(self.target_cache))
        if _trimmable_to(self.target_cache, target_keep):
            rollback(self.target_cache, target_keep)
        else:  # a wrapped ring cannot go back that far: rebuild
            self.target_cache = make_cache(self.target, self.max_kv_size, MARGIN)
        held = cache_length(self.target_cache)
        draft = self.draft_cache
        if draft is not None and not (_trimmable_to(draft, min(held, cache_length(draft)))
                                      and can_cut(draft, held)):
            self.draft_cache = self.new_draft_cache()  # it cannot go back that far
        elif draft is not None:
            cut(draft, held)  # a head's resumes where the target's cache ends
        self.tokens = list(prompt[:keep])
        return cache_length(self.target_cache)

    def usable(self, prompt: list[Any], cap: Callable[[int], int] | None = None) -> int:
        """The target tokens `reuse(prompt, cap)` would keep: the common prefix (at most all but
        the prompt's last token) where the target's cache can be cut back to it, else 0 (a
        recurrent state after a longer sequence, a ring wrapped past its margin)."""
        keep = min(self._common(prompt, cap), cache_length(self.target_cache))
        return keep if _trimmable_to(self.target_cache, keep) else 0

    def _common(self, prompt: list[Any], cap: Callable[[int], int] | None) -> int:
        keep = min(common_prefix(self.tokens, prompt), len(prompt) - 1)
        return keep if cap is None else cap(keep)

    def copy(self) -> PromptCache:
        """An independent copy (both caches' arrays are copied): reusing or extending it never
        changes this one."""
        clone = object.__new__(PromptCache)
        clone.__dict__.update(self.__dict__)
        clone.tokens = list(self.tokens)
        clone.in_use = False
        clone.target_cache = _copy_cache(self.target_cache)
        clone.draft_cache = _copy_cache(self.draft_cache)
        return clone

    @property
    def nbytes(self) -> int:
        """Bytes held by both caches."""
        caches = [c for c in (self.target_cache, self.draft_cache) if c is not None]
        return sum(_layer_nbytes(layer) for cache in caches for layer in cache)

    # -- files -----------------------------------------------------------------------------------

    def save(self, path: str | Path, metadata: dict[str, str] | None = None) -> None:
        """Write both caches, the tokens and a fingerprint of the models to one safetensors
        file at exactly `path` (whatever its suffix), atomically: a failure leaves the file as
        it was. `metadata`: extra strings stored with it (returned by `load`'s `.metadata`).
        PromptCacheError when its directory does not exist."""
        arrays: dict[str, mx.array] = {}
        layers = {}
        draft = self.draft_cache if self.drafter.cache_in_file else None  # else: starts anew
        for prefix, cache in (("target", self.target_cache), ("draft", draft)):
            if cache is not None:
                layers[prefix] = [_save_layer(layer, f"{prefix}.{i}", arrays)
                                  for i, layer in enumerate(cache)]
        info = {
            "format": FORMAT,
            "tokens": self.tokens,
            "max_kv_size": self.max_kv_size,
            "target": fingerprint(self.target),
            "draft": fingerprint(self.draft) if self.draft is not None else None,
            "layers": layers,
            "metadata": dict(metadata or {}),
        }
        path = Path(path)
        if not path.parent.is_dir():
            raise PromptCacheError(f"cannot save the prompt cache to {str(path)!r}: directory "
                                   f"{str(path.parent)!r} does not exist")
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial.safetensors")
        try:
            mx.save_safetensors(str(partial), arrays,
                                metadata={"tinydraft_mlx": json.dumps(info)})
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path, target: nn.Module, draft: Any = None) -> PromptCache:
        """Read a file written by `save` for these models; PromptCacheError (one sentence) for a
        missing or foreign file, or models other than those it was made with."""
        path = Path(path)
        if not path.is_file():
            raise PromptCacheError(f"prompt cache file {str(path)!r} does not exist")
        try:
            arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
            info = json.loads(meta["tinydraft_mlx"])
            assert info["format"] == FORMAT
        except Exception:  # unreadable, not safetensors, or not ours: one sentence either way
            raise PromptCacheError(f"{str(path)!r} is not a tinydraft-mlx prompt cache "
                                   "file") from None
        pc = cls(target, draft, max_kv_size=info["max_kv_size"])
        if info["target"] != fingerprint(target):
            raise PromptCacheError(f"{str(path)!r} was made with another target model")
        if (info["draft"] is None) != (pc.draft is None) or (
                pc.draft is not None and info["draft"] != fingerprint(pc.draft)):
            raise PromptCacheError(f"{str(path)!r} was made with another draft model "
                                   "(or without one)")
        for prefix, cache in (("target", pc.target_cache), ("draft", pc.draft_cache)):
            if cache is not None and prefix in info["layers"]:
                for i, (layer, layer_info) in enumerate(zip(cache, info["layers"][prefix])):
                    _load_layer(layer, layer_info, arrays, f"{prefix}.{i}")
        pc.tokens = list(info["tokens"])
        pc.metadata = info["metadata"]
        return pc


def _copy_cache(cache: Cache | None) -> Cache | None:
    """New layer objects holding copies of the arrays (`mx.array(x)` copies; sharing the array
    objects would let a slice update through one cache show in the other)."""
    if cache is None:
        return None
    if callable(getattr(cache, "with_layers", None)):  # more than layers: it copies itself
        return cache.with_layers(_copy_cache(list(cache)))
    layers = []
    for layer in cache:
        if isinstance(layer, RecurrentCache):
            layers.append(layer.copy())  # its arrays are replaced, never updated in place
            continue
        clone = copy.copy(layer)
        if getattr(layer, "keys", None) is not None:
            clone.keys, clone.values = mx.array(layer.keys), mx.array(layer.values)
        layers.append(clone)
    return layers


def _layer_nbytes(layer: Any) -> int:
    if isinstance(layer, RecurrentCache):
        return layer.nbytes
    keys = getattr(layer, "keys", None)
    return 0 if keys is None else keys.nbytes + layer.values.nbytes


def _save_layer(layer: Any, name: str, arrays: dict[str, mx.array]) -> dict[str, Any]:
    if isinstance(layer, RecurrentCache):
        for i, state in enumerate(layer.cache):
            if state is not None:
                arrays[f"{name}.{i}"] = state
        return {"kind": "recurrent", "offset": layer.offset}
    if isinstance(layer, RollbackRotatingKVCache):
        if layer.keys is not None:
            arrays[f"{name}.keys"], arrays[f"{name}.values"] = layer.keys, layer.values
        return {"kind": "rotating", "offset": layer.offset}
    if isinstance(layer, KVCache):
        if layer.offset:
            arrays[f"{name}.keys"] = layer.keys[..., : layer.offset, :]
            arrays[f"{name}.values"] = layer.values[..., : layer.offset, :]
        return {"kind": "kv", "offset": layer.offset}
    raise PromptCacheError(f"cannot save a {type(layer).__name__} prompt cache")


def _load_layer(layer: Any, info: dict[str, Any], arrays: dict[str, mx.array],
                name: str) -> None:
    if isinstance(layer, RecurrentCache):
        layer.cache = [arrays.get(f"{name}.{i}") for i in range(len(layer.cache))]
        layer.offset = info["offset"]
        return
    keys, values = arrays.get(f"{name}.keys"), arrays.get(f"{name}.values")
    if keys is not None:
        layer.keys, layer.values = keys, values
    layer.offset = info["offset"]

"""Recurrent layers that roll back: Gated DeltaNet (Qwen3-Next, Qwen3.5) and Mamba-2
(Nemotron-H, Granite 4, Mamba-2), on mlx-lm's own layer code.

A recurrent layer keeps a state instead of keys and values: a short convolution's window (the
last K - 1 inputs) and the recurrence's state (GDN: (heads, Dv, Dk); Mamba-2: (heads, head_dim,
N)). mlx-lm keeps both in an `ArraysCache`, which cannot be trimmed. A rejected draft must leave
each row's state as it was after that row's accepted tokens, which the verify forward never
wrote: it ran all k + 1 positions in one call.

The technique is replay from a tape. During every short forward (at most `reach` positions:
draft steps, verifies) the layer's two pieces are observed as they run: the convolution's input
(the window before the forward, then the T new inputs), and the recurrence's call (its function,
its per-position inputs and the state it started from). Those arrays exist anyway; keeping a
reference costs the memory of T positions' inputs per layer, no copy and no extra compute. A
rollback of a row to n of the forward's T positions then takes the window from the recorded
input (positions n .. n + K - 2) and recomputes the state by calling the same recurrence function
on the first n positions of the recorded inputs from the recorded start state: a recurrence over
n positions only, none of the layer's projections (GDN: about 4 Dv Dk flops per head and
position, against the projections' 2 d (2 Hk Dk + 2 Hv Dv) per position). Rows that rejected at
the first position take the recorded start state as it is; fully accepted rows keep what the
forward wrote. Rows of a batch are replayed in groups of equal n, each group one call.

Segments (one per forward) are kept while a rollback may still reach them: at most `reach`
positions back from the end (the rollback margin + 1), and after a rollback only what one more
position back needs (the engine's next rollback before a forward goes at most that far: a row
leaving after a round queued ahead), so plain decoding holds one segment and a draft chain k. A
longer forward (a prefill chunk) keeps nothing, and a forward after a rollback that cut rows at
different points starts a new tape. A rollback beyond the tape raises ValueError (before any
state changes), as a wrapped bounded KV cache does.

How the pieces are observed: the layer that owns the convolution (a "mixer": GDN's
`linear_attn`, Mamba-2's `mixer`) gets a subclass whose `__call__` marks the cache it was given
as the one recording for the duration of the call; its `conv1d` gets a subclass that hands its
input to that cache; and the recurrence functions mlx-lm's layers call (`gated_delta_ops` /
`gated_delta_kernel`, `ssm_attn` / `ssm_update_kernel`) are wrapped where `gated_delta_update` and
`ssm_update` look them up. Outside a marked call every wrapper is a pass-through. Nothing of the
model's code is copied: its layers run as they are.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta, ssm
from mlx_lm.models.cache import ArraysCache

from . import branches

# model_type -> the recurrence its mixers run (verified against the transformers oracle in
# tests/test_hybrid.py); other ArraysCache models stay refused
RECURRENCES = {
    "qwen3_next": "gdn",
    "qwen3_5": "gdn",
    "qwen3_5_moe": "gdn",
    "nemotron_h": "ssd",
    "granitemoehybrid": "ssd",
    "mamba2": "ssd",
}
# per recurrence: the arguments of its function that run along the time axis (axis 1)
_TIMED = {"gdn": ("q", "k", "v", "g", "beta", "mask"),
          "ssd": ("x", "hidden_states", "B", "C", "dt", "mask")}
_STATE_ARG = "state"  # the start state's argument, in both
_PREPARED = "_tinydraft_mixers"  # per model: how many mixers `prepare` made observable

_local = threading.local()  # .cache: the RecurrentCache whose mixer is running on this thread


def model_kind(model: nn.Module) -> str | None:
    """The recurrence kind of a hybrid mlx-lm model this module can roll back ("gdn", "ssd"),
    or None."""
    args = getattr(model, "args", None)
    kind = RECURRENCES.get(getattr(args, "model_type", None))
    if kind is None:
        text = getattr(args, "text_config", None)
        if isinstance(text, dict):
            kind = RECURRENCES.get(text.get("model_type", "").removesuffix("_text"))
    return kind


def prepare(model: nn.Module) -> int:
    """Make the model's recurrent layers observable (idempotent, once per model): each module
    with a `conv1d` child becomes a recording mixer. Returns how many mixers the model has.
    The modules' classes are swapped for subclasses (as hidden.py's watched modules are) rather
    than wrapped, so that their parameter paths and identity in mlx-lm's tree stay as loaded."""
    done = model.__dict__.get(_PREPARED)
    if done is not None:
        return done
    _install()
    mixers = 0
    for _, module in model.named_modules():
        conv = module.get("conv1d") if isinstance(module, dict) else None
        if not isinstance(conv, nn.Conv1d):
            continue
        if type(conv) is not _TapedConv1d:
            conv.__class__ = _TapedConv1d
        module.__class__ = _mixer_class(type(module))
        mixers += 1
    model.__dict__[_PREPARED] = mixers
    return mixers


_MIXERS: dict[type, type] = {}


def _mixer_class(cls: type) -> type:
    if getattr(cls, "_tinydraft_mixer", False):
        return cls
    made = _MIXERS.get(cls)
    if made is None:
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            cache = next((a for a in (*args, *kwargs.values()) if isinstance(a, RecurrentCache)),
                         None)
            outer = getattr(_local, "cache", None)
            _local.cache = cache
            try:
                return cls.__call__(self, *args, **kwargs)
            finally:
                _local.cache = outer
                if cache is not None:
                    cache._close()

        made = _MIXERS[cls] = type(cls.__name__, (cls,),
                                   {"__call__": __call__, "_tinydraft_mixer": True})
    return made


class _TapedConv1d(nn.Conv1d):
    """nn.Conv1d that hands its input to the recording cache (if any) before running."""

    def __call__(self, x: mx.array) -> mx.array:
        cache = getattr(_local, "cache", None)
        width = self.weight.shape[1] - 1
        if cache is not None:
            cache._conv(x, width)
            trees = branches.active()
            if trees is not None:  # a tree forward: each node's window along its branch
                return trees.convolve(lambda v: nn.Conv1d.__call__(self, v), x, width)
        return super().__call__(x)


_installed = False


def _install() -> None:
    """Wrap the recurrence functions where mlx-lm's `gated_delta_update` and `ssm_update` look
    them up (once per process). Why replaced functions: mlx-lm's layers call them as globals of
    their modules, with the per-position inputs the replay needs (and nothing else sees them);
    a subclass of each layer would have to copy its `__call__` (mlx-lm's model code). The
    wrappers record only inside a forward that asked for it and pass through otherwise."""
    global _installed
    if _installed:
        return
    for module, name, kind in [(gated_delta, "gated_delta_ops", "gdn"),
                               (gated_delta, "gated_delta_kernel", "gdn"),
                               (ssm, "ssm_attn", "ssd"),
                               (ssm, "ssm_update_kernel", "ssd")]:
        setattr(module, name, _recording(getattr(module, name), kind))
    _installed = True


def _recording(fn: Callable, kind: str) -> Callable:
    signature = inspect.signature(fn)
    replay = ssm.ssm_attn if kind == "ssd" else fn  # the kernel's T = 1 steps never replay

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        cache = getattr(_local, "cache", None)
        trees = branches.active() if cache is not None else None
        if cache is None:
            return fn(*args, **kwargs)
        arguments = dict(signature.bind(*args, **kwargs).arguments)
        if trees is not None:  # a tree forward: along each branch (branches.py)
            out = trees.recur(fn, arguments, _TIMED[kind], _STATE_ARG)
        else:
            out = fn(*args, **kwargs)
        cache._recurrence(Recurrence(kind, replay, arguments))
        return out

    wrapped.__wrapped__ = fn
    return wrapped


class Recurrence:
    """One recorded call of a recurrence function: replays its first n positions."""

    def __init__(self, kind: str, fn: Callable, arguments: dict[str, Any]) -> None:
        self.kind, self.fn, self.arguments = kind, fn, arguments
        if kind == "ssd" and "x" not in arguments:  # ssm_update_kernel's names -> ssm_attn's
            arguments["x"] = arguments.pop("hidden_states")
        self.replayable = arguments.get("lengths") is None

    @property
    def start(self) -> mx.array | None:
        return self.arguments.get(_STATE_ARG)

    def replay(self, rows: mx.array | None, n: int) -> mx.array:
        """The state after the first n positions, for the given rows (None: all)."""
        timed = _TIMED[self.kind]
        args = {}
        for name, value in self.arguments.items():
            if isinstance(value, mx.array) and (name in timed or name == _STATE_ARG):
                value = value if rows is None else value[rows]
                if name in timed:
                    value = value[:, :n]
            args[name] = value
        return self.fn(**args)[1]


class _Segment:
    """One short forward through one layer: T positions, the convolution's input and the
    recurrence's call."""

    __slots__ = ("length", "conv", "recurrence", "branched")

    def __init__(self, length: int, conv: mx.array, branched: bool = False) -> None:
        self.length, self.conv, self.branched = length, conv, branched
        self.recurrence: Recurrence | None = None

    def reorder(self, order: mx.array) -> None:
        """Lay the positions out in `order` (rows, length): position j of row b becomes what
        position order[b, j] was (a tree forward's walked path first)."""
        width = self.conv.shape[1] - self.length
        nodes = mx.take_along_axis(self.conv[:, width:], order[:, :, None], axis=1)
        self.conv = mx.concatenate([self.conv[:, :width], nodes], axis=1)
        rec = self.recurrence
        for name in _TIMED[rec.kind]:
            value = rec.arguments.get(name)
            if isinstance(value, mx.array):
                index = order.reshape(*order.shape, *[1] * (value.ndim - 2))
                rec.arguments[name] = mx.take_along_axis(value, index, axis=1)

    def window(self, rows: mx.array | None, n: int) -> mx.array:
        width = self.conv.shape[1] - self.length
        conv = self.conv if rows is None else self.conv[rows]
        return conv[:, n : n + width]

    def state(self, rows: mx.array | None, n: int, like: mx.array) -> mx.array:
        rec = self.recurrence
        if n == 0:
            start = rec.start
            if start is None:  # the layer's first forward: it started from zeros
                return mx.zeros_like(like if rows is None else like[rows])
            return start if rows is None else start[rows]
        return rec.replay(rows, n)


class RecurrentCache(ArraysCache):
    """mlx-lm's `ArraysCache` for a recurrent layer (slot 0: the convolution's window, slot 1:
    the recurrence's state), that rolls back by replaying its tape (module docstring).

    `reach`: how many positions back a rollback may go (the engine's rollback margin + 1).
    `offset` counts the positions it has consumed, as a KV cache's does, so the engine's
    `rollback(cache, keep)` and `trim(n)` work on a list of mixed layers."""

    def __init__(self, size: int = 2, reach: int = 2) -> None:
        super().__init__(size)
        self.reach = reach
        self.offset = 0
        self.tape: list[_Segment] = []
        self.cut: list[int] | None = None  # per row: positions cut from the tape's end
        self._open: _Segment | None = None

    # -- recording (called by the mixer's pieces) ---------------------------------------------
    def _conv(self, x: mx.array, width: int) -> None:
        n = x.shape[1] - width
        self.offset += n
        if n > self.reach or self.cut is not None:  # cut: None unless a row was cut
            self.tape = []
        self.cut = None
        seg = _Segment(n, x, branches.active() is not None)
        self._open = seg
        if n <= self.reach:
            self.tape.append(seg)
            total = sum(s.length for s in self.tape)
            while len(self.tape) > 1 and total - self.tape[0].length >= self.reach:
                total -= self.tape.pop(0).length

    def _recurrence(self, record: Recurrence) -> None:
        seg, self._open = self._open, None
        if seg is None or seg.recurrence is not None:
            raise RuntimeError("a recurrence ran without its convolution: this layer's pieces "
                               "are not the ones tinydraft_mlx.engine.cache.recurrent knows")
        seg.recurrence = record

    def _close(self) -> None:
        """After the mixer's call: a segment left without its recurrence cannot be replayed."""
        seg, self._open = self._open, None
        if seg is not None and seg in self.tape:
            self.tape = []

    # -- rollback -----------------------------------------------------------------------------
    def follow(self, paths: list[list[int]]) -> None:
        """After a tree forward: each row's walked path (its nodes' layout indices, root first)
        becomes the first positions of that forward's segment, so that a rollback to the path
        replays along it (branches.py). Rows whose path is a prefix of their layout, and a
        tape without a tree forward, stay as they are."""
        seg = next((s for s in reversed(self.tape) if s.branched), None)
        if seg is None or all(p == list(range(len(p))) for p in paths):
            return
        if seg.recurrence is None or not seg.recurrence.replayable:
            raise ValueError("cannot follow a tree's path in a recurrent layer: its forward "
                             "was not recorded")
        order = [p + sorted(set(range(seg.length)) - set(p)) for p in paths]
        seg.reorder(mx.array(order, dtype=mx.int32))
        seg.branched = False

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the newest n positions (one sequence); returns how many were forgotten. Also
        with n = 0: the tape then keeps only what one more position back needs."""
        n = min(n, self.offset)
        self.rollback_rows([n])
        self.offset -= n
        return n

    def held(self, row: int = 0) -> int:
        """How many positions back a rollback of `row` may still go."""
        total = sum(s.length for s in self.tape)
        return total - (self.cut[row] if self.cut else 0)

    def rollback_rows(self, backs: list[int]) -> None:
        """Row b forgets its newest backs[b] positions (all within the tape)."""
        cut = list(self.cut) if self.cut else [0] * len(backs)
        total = sum(s.length for s in self.tape)
        groups: dict[tuple[int, int], list[int]] = {}
        for row, back in enumerate(backs):
            if back <= 0:
                continue
            c = cut[row] + back
            if c > total:
                raise ValueError(
                    f"cannot roll back {back} tokens of a recurrent layer's state: it holds the "
                    f"inputs of its last {total - cut[row]} positions (reach {self.reach})")
            acc = 0
            for i in range(len(self.tape) - 1, -1, -1):
                seg = self.tape[i]
                if c <= acc + seg.length:
                    if seg.recurrence is None or not seg.recurrence.replayable:
                        raise ValueError("cannot roll back a recurrent layer's state: its "
                                         "last forward was not recorded")
                    groups.setdefault((i, seg.length - (c - acc)), []).append(row)
                    break
                acc += seg.length
            cut[row] = c
        if groups:
            self._restore(groups, len(backs))
        self.cut = cut if any(cut) else None
        # the engine's next rollback before a forward goes at most one position further back
        # (a row leaving after a round queued ahead): older segments are let go
        acc, need = 0, max(cut) + 1
        for i in range(len(self.tape) - 1, -1, -1):
            if acc >= need:
                del self.tape[: i + 1]
                break
            acc += self.tape[i].length

    def _restore(self, groups: dict[tuple[int, int], list[int]], batch: int) -> None:
        """Each group's rows (segment i, n of its positions kept) take the window and the state
        after those positions."""
        conv, state = self.cache[0], self.cache[1]
        if batch == 1:
            ((i, n), _), = groups.items()
            seg = self.tape[i]
            self.cache[0], self.cache[1] = seg.window(None, n), seg.state(None, n, state)
        else:
            convs, states, index, at = [conv], [state], list(range(batch)), batch
            for (i, n), rows in groups.items():
                idx = mx.array(rows, dtype=mx.int32)
                seg = self.tape[i]
                convs.append(seg.window(idx, n).astype(conv.dtype))
                states.append(seg.state(idx, n, state).astype(state.dtype))
                for j, row in enumerate(rows):
                    index[row] = at + j
                at += len(rows)
            take = mx.array(index, dtype=mx.int32)
            self.cache[0] = mx.concatenate(convs)[take]
            self.cache[1] = mx.concatenate(states)[take]

    # -- mlx-lm's protocol --------------------------------------------------------------------
    def __getitem__(self, idx: int) -> Any:
        return self.cache[idx]

    def empty(self) -> bool:
        return self.cache[0] is None and self.cache[1] is None

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache if c is not None)

    # -- rows of a batch (`BatchCache`) -------------------------------------------------------
    def add_rows(self, caches: list[RecurrentCache | None], existing: int) -> None:
        """Append one row per one-sequence cache (None or empty: zeros) to the `existing` rows;
        the tape starts anew (a rollback never reaches back past rows joining)."""
        for slot in range(len(self.cache)):
            parts = [c.cache[slot] if c is not None else None for c in caches]
            template = next((p for p in [self.cache[slot], *parts] if p is not None), None)
            if template is None:
                continue
            pieces = [self.cache[slot] if self.cache[slot] is not None else
                      mx.zeros((existing, *template.shape[1:]), template.dtype)]
            pieces += [p[:1].astype(template.dtype) if p is not None else
                       mx.zeros((1, *template.shape[1:]), template.dtype) for p in parts]
            self.cache[slot] = mx.concatenate(pieces)
        self.tape, self.cut = [], None

    def take(self, rows: list[int]) -> None:
        """Keep these rows only (in this order); the tape starts anew."""
        index = mx.array(rows, dtype=mx.int32)
        self.cache = [None if c is None or not rows else c[index] for c in self.cache]
        self.tape, self.cut = [], None

    def row(self, index: int, length: int) -> RecurrentCache:
        """Row `index` as a one-sequence cache that has consumed `length` positions."""
        out = RecurrentCache(len(self.cache), self.reach)
        out.cache = [None if c is None else mx.array(c[index : index + 1]) for c in self.cache]
        out.offset = length
        return out

    def copy(self) -> RecurrentCache:
        """A copy holding the same state (arrays are immutable), without the tape."""
        out = RecurrentCache(len(self.cache), self.reach)
        out.cache, out.offset = list(self.cache), self.offset
        return out


def recurrent_cache(layer: Any, model: nn.Module, margin: int) -> Any:
    """`layer` (one of mlx-lm's per-layer caches for `model`) made able to roll back where it is
    a recurrent layer this module knows: a `RecurrentCache` reaching margin + 1 positions back;
    other layers are returned as they are."""
    if type(layer) is ArraysCache and model_kind(model) is not None and prepare(model):
        return RecurrentCache(len(layer.cache), margin + 1)
    return layer

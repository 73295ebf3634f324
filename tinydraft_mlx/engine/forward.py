"""The decode loop's model forward: an `mx.compile`d step run on mlx-lm's own KV caches; and the
eager chunked prefill beside it (`prefill`), with the ids a model's embedding can take.

With small, fast forwards (a 0.5B draft on Apple silicon, the demo pair on a CPU) building the
graph in Python costs as much as running it: about 25 Python-level ops per layer, each a few
microseconds. A compiled step records that graph once and replays it from C++ (and fuses the
element-wise ops): measured on the demo pair (CPU, MKL), one draft step 1.3 -> 0.7 ms and one
target step 4.8 -> 2.7 ms.

A compiled graph has fixed shapes, a KV cache grows. So the step takes the caches' whole buffers
(fixed size, a power of two of at least 256 positions, then multiples of 4096) with the write
position as an array: new keys/values go in with `mx.slice_update` at that offset, and a mask
(key position <= query position) hides the unwritten tail. One trace per (input length, buffer
size), cached per model for the life of the process. The caches stay mlx-lm `KVCache` objects
(`offset`, `trim`, `state` as before), so rollback, prompt caches and eager prefill are unchanged.

Same arithmetic as the eager forward up to float rounding (the masked tail contributes exactly
zero; max |logit difference| 5.7e-6 on logits up to 10, float32, over 150 random steps with
rollbacks). The model's parameters are inputs of the compiled step, read at every call, so
weights changed after a trace (`model.update`, fused adapters) are used as the eager forward uses
them. Used for Qwen2, Qwen3, Llama and Mistral models (the architectures the tests check against
the oracle, tests/test_architectures.py) and the hybrids (Qwen3.5, Qwen3-Next, Nemotron-H, Granite
4, Mamba-2; unbounded caches) on one process, and for a head that reads such a target's
states (an MTP layer, an EAGLE-3 head: hidden.StateHead; the states are one more input of the
step, the target's shared embeddings and head too). Bounded caches (`max_kv_size`,
`RollbackRotatingKVCache`) are fixed-size buffers already: their step takes the write position as
an array too, writes each new position into its slot and masks by stored position with the eager
cache's own position functions (cache.py), for forwards the cache writes in place (at most margin
+ 1 tokens: decode steps and verifies): 1.44-1.56x the eager bounded decode on the demo pair
(CPU, plain and k = 2, max_kv_size 64), level with the unbounded compiled step. Everything else
(other architectures such as Gemma 3, quantized caches, a longer forward into a bounded cache,
tensor-parallel ranks, TINYDRAFT_COMPILE=0) runs the eager forward.

A hybrid's recurrent layer (cache/recurrent.py) is a `_StateSlot` inside the step: its window and
state are inputs and outputs, and what its tape records during the forward (the convolution's
input, the recurrence's array arguments) becomes outputs too, from which the layer's tape is
written after the call exactly as the eager forward writes it; a rollback then replays from it
as after an eager verify. The tape's layout (which function, which argument names) is kept per
traced shape. Tested against the eager forward through rollbacks on all six families, one
sequence and batches (tests/test_forward_hybrid.py); a tree's verify (branches.py) stays eager.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from . import hidden
from .cache import Cache, RollbackRotatingKVCache, ring_mask, ring_slots, slot_positions
from .cache.recurrent import Recurrence, RecurrentCache
from .distributed import ranks_of

COMPILE_ENV = "TINYDRAFT_COMPILE"
# architectures whose attention reads the cache only through offset / update_and_fetch / make_mask
SUPPORTED = frozenset({"qwen2", "qwen3", "llama", "mistral",
                       # hybrids: their recurrent layers' window and state are inputs and
                       # outputs of the step, and what their tape records too (`_StateSlot`)
                       "qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h",
                       "granitemoehybrid", "mamba2"})
MIN_BUFFER = 256
LINEAR_BUFFER = 4096  # beyond this, buffers grow by this much instead of doubling
_STATE = "_tinydraft_forward"  # per model: {kernel set name: _Compiled or False}
_KERNELS = "_tinydraft_kernels"  # the name of the module set the model runs now
PREFILL_STEP = 512
COMPILED_POSITIONS = 8  # a batched forward of at most this many positions runs compiled


def enabled() -> bool:
    """Whether compiled forwards are on for this process (TINYDRAFT_COMPILE, default on)."""
    return os.environ.get(COMPILE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def buffer_size(need: int) -> int:
    """The buffer length that holds `need` positions: a power of two >= 256 up to 4096, then a
    multiple of 4096 (few distinct sizes, so few traces; at most 4096 unused positions)."""
    if need > LINEAR_BUFFER:
        return -(-need // LINEAR_BUFFER) * LINEAR_BUFFER
    size = MIN_BUFFER
    while size < need:
        size *= 2
    return size


class _Slot:
    """One layer's cache as the compiled step sees it: the whole buffer, the write position as
    an array. Speaks the part of mlx-lm's cache protocol that SUPPORTED attention uses."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array) -> None:
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.offset.ndim == 0:  # one sequence
            start = self.offset.reshape(1)
            self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
            self.values = mx.slice_update(self.values, values, start, axes=(2,))
        else:  # a batch: each row at its own offset
            slots = (self.offset[:, None] + mx.arange(keys.shape[2]))[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, slots, keys, axis=2)
            self.values = mx.put_along_axis(self.values, slots, values, axis=2)
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """(n, buffer) True where query i (position offset + i) may see the key: written and
        not after it; (B, 1, n, buffer) for a batch, each row at its own offset."""
        queries = self.offset[..., None] + mx.arange(n)
        mask = mx.arange(self.keys.shape[2]) <= queries[..., None]
        return mask[:, None] if self.offset.ndim else mask


class _RingSlot:
    """One layer's bounded cache (`RollbackRotatingKVCache`) as the compiled step sees it: its
    whole fixed buffer (`keep` sink slots, then a ring of `ring` slots) and, as one int32 array,
    the write position and the bound (`packed`: offset, keep, window, ring). Writes and mask as
    the eager cache's for a forward it writes in place (at most margin + 1 tokens, cache/kv.py),
    from the same position functions. The bound is an input, not a constant of the trace, so
    every bound shares one step and MLX's CPU backend compiles its fused kernels once (as
    constants, each bound made kernels of its own: ~50 of a suite's ~260)."""

    def __init__(self, keys: mx.array, values: mx.array, packed: mx.array) -> None:
        self.keys, self.values = keys, values
        self.offset, self.keep, self.window, self.ring = packed[0], packed[1], packed[2], packed[3]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        slots = ring_slots(self.offset + mx.arange(keys.shape[2]), self.keep, self.ring)
        slots = slots[None, None, :, None]
        self.keys = mx.put_along_axis(self.keys, slots, keys, axis=2)
        self.values = mx.put_along_axis(self.values, slots, values, axis=2)
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        keys = slot_positions(self.offset + n, self.keep, self.ring, self.keys.shape[2])
        return ring_mask(self.offset, n, keys, self.keep, self.window)


class _StateSlot(RecurrentCache):
    """One recurrent layer's cache as the compiled step sees it: its window and state as
    inputs; what the layer's tape records during the step (the convolution's input, the
    recurrence's call: recurrent.py) is kept here to become outputs of the step, from which the
    real cache's tape is written after the call as the eager forward writes it."""

    def __init__(self, conv: mx.array, state: mx.array) -> None:
        super().__init__(2, reach=0)
        self.cache = [conv, state]
        self.conv_input: mx.array | None = None
        self.width = 0
        self.record: Recurrence | None = None

    def _conv(self, x: mx.array, width: int) -> None:
        self.conv_input, self.width = x, width

    def _recurrence(self, record: Recurrence) -> None:
        self.record = record

    def _close(self) -> None:
        pass

    def taped(self) -> tuple[tuple, list[mx.array]]:
        """(what the tape needs beside arrays: width, kind, function, argument names, the
        arguments that are not arrays), [the convolution's input, the recurrence's arrays]."""
        rec = self.record
        if self.conv_input is None or rec is None:
            raise RuntimeError("a recurrent layer ran without its convolution or recurrence in "
                               "a compiled step")
        names = tuple(n for n, v in rec.arguments.items() if isinstance(v, mx.array))
        rest = {n: v for n, v in rec.arguments.items() if n not in names}
        return ((self.width, rec.kind, rec.fn, names, rest),
                [self.conv_input, *(rec.arguments[n] for n in names)])


def _write_back(layers: list[RecurrentCache], windows: list[mx.array], states: list[mx.array],
                layout: list[tuple], arrays: list[mx.array]) -> None:
    """Each recurrent layer after a compiled step: its window and state, and its tape as the
    eager forward writes it (its convolution's input, then its recurrence), from the step's
    outputs."""
    for layer, window, held in zip(layers, windows, states):
        layer.cache[0], layer.cache[1] = window, held
    at = 0
    for layer, (width, kind, fn, names, rest) in zip(layers, layout, strict=True):
        conv, args = arrays[at], arrays[at + 1 : at + 1 + len(names)]
        at += 1 + len(names)
        layer._conv(conv, width)
        layer._recurrence(Recurrence(kind, fn, {**rest, **dict(zip(names, args))}))


class _Compiled:
    """A model's compiled steps (on unbounded caches; on bounded ones, every bound's) and the
    shapes they have been traced for."""

    def __init__(self, model: nn.Module, inputs: tuple[str, ...] = ()) -> None:
        self.model, self.inputs = model, inputs  # inputs: its keyword inputs beside the ids
        self.step = self._compile(_Slot)
        self.ring_step = self._compile(_RingSlot)
        self.shapes: set[tuple] = set()
        self.tags: list[Any] = []  # what the step's last output holds (set when it traces)
        self.kinds: tuple[bool, ...] = ()  # per cache layer: recurrent (set before a call)
        self.tapes: dict[tuple, list[tuple]] = {}  # per traced shape: the tapes' layout

    def order(self, attention: Any, recurrent: Any) -> list:
        """Per cache layer, the iterator its slot comes from."""
        return [recurrent if kind else attention for kind in self.kinds]

    def _compile(self, slot: Callable[..., Any]) -> Callable:
        model, state = self.model, self

        def step(tokens, offset, keys, values, windows, states, *extra):
            attention = iter([slot(k, v, offset) for k, v in zip(keys, values)])
            recurrent = [_StateSlot(w, s) for w, s in zip(windows, states)]
            slots = [next(attention) for _ in keys] if not recurrent else \
                [next(layers) for layers in state.order(attention, iter(recurrent))]
            with hidden.capture() as seen:  # a watched model's states (hidden.py)
                logits = model(tokens, cache=slots, **dict(zip(state.inputs, extra)))
            state.tags = [tag for tag, _ in seen]  # the same at every trace of this model
            taped = [slot.taped() for slot in recurrent]
            state.tapes[(tokens.shape, len(recurrent))] = [t for t, _ in taped]
            return (logits, [s.keys for s in slots if not isinstance(s, _StateSlot)],
                    [s.values for s in slots if not isinstance(s, _StateSlot)],
                    [s.cache[0] for s in recurrent], [s.cache[1] for s in recurrent],
                    [a for _, arrays in taped for a in arrays], [a for _, a in seen])

        # the parameters are inputs, read at every call: a closure's arrays would be frozen into
        # the trace as constants, so a weight changed later (model.update, adapters, training)
        # would be ignored by decode steps while the eager prefill used it (a head's shared
        # embeddings and LM head are its target's)
        target = getattr(model, "target", None)
        return mx.compile(step, inputs=[model.state] + ([target.state] if target else []))


def _model_type(model: Any) -> str | None:
    return getattr(getattr(model, "args", None), "model_type", None)


def _compiled(model: Any) -> _Compiled | None:
    """The model's compiled step for the modules it runs now, made on first use; None where it
    does not apply."""
    if not isinstance(model, nn.Module):
        return None
    states = model.__dict__.setdefault(_STATE, {})
    # a step records the states watched when it traced: one per set of watched modules too
    key = (model.__dict__.get(_KERNELS), hidden.watched(model))
    state = states.get(key)
    if state is None:
        inputs = tuple(getattr(model, "step_inputs", ()))  # a head's states beside its ids
        body = getattr(model, "target", model) if inputs else model  # a head: its target's kind
        ok = _model_type(body) in SUPPORTED and ranks_of(body) is None
        state = states[key] = _Compiled(model, inputs) if ok else False
    return state or None


def set_kernels(model: nn.Module, name: str) -> None:
    """Say that `model`'s modules were swapped for the set called `name` (e.g. by `skinny`): a
    compiled step replays the modules it traced, so steps are kept per set (swapping back and
    forth traces each set once)."""
    if isinstance(model, nn.Module):
        model.__dict__[_KERNELS] = name


def reset(model: nn.Module) -> None:
    """Forget every compiled step of `model`."""
    if isinstance(model, nn.Module):
        model.__dict__.pop(_STATE, None)


_traced = 0  # shapes first traced by any model's compiled steps in this process


def trace_count() -> int:
    """Shapes traced by the compiled steps of all models in this process so far: the decode
    loops read it before and after a round (a round that traced, tens of milliseconds, stays out
    of k="auto"'s costs). One number read, where summing `traces` over the models (an
    environment read and a lookup per model, twice a round) cost plain and k="auto" rounds
    host time every round."""
    return _traced


def _traced_shape(state: _Compiled, shape: tuple) -> None:
    """Note that `state`'s step runs `shape` (a trace the first time)."""
    global _traced
    if shape not in state.shapes:
        state.shapes.add(shape)
        _traced += 1


def traces(model: Any) -> int:
    """How many shapes `model`'s compiled step has been traced for so far (a trace costs tens of
    milliseconds; the loop leaves rounds that traced out of its timing-based choices)."""
    state = _compiled(model) if enabled() else None
    return len(state.shapes) if state is not None else 0


def _reserve(cache: list[KVCache], need: int) -> int:
    """Make every layer's buffers exactly `buffer_size(need)` long (copying what is written when
    they must change); returns that size."""
    size = buffer_size(need)
    for layer in cache:
        have = layer.keys.shape[2]
        if have == size:
            continue
        keep = min(layer.offset, size)
        for name in ("keys", "values"):
            old = getattr(layer, name)
            shape = (*old.shape[:2], size - keep, old.shape[3])
            setattr(layer, name, mx.concatenate([old[..., :keep, :], mx.zeros(shape, old.dtype)],
                                                axis=2))
    return size


def compiles(model: Any) -> bool:
    """Whether `model`'s decode steps run compiled (on unbounded caches) in this process."""
    return enabled() and _compiled(model) is not None


def forward(model: nn.Module, tokens: mx.array, cache: list[Any], *, reserve: int = 0,
            **inputs: Any) -> Any:
    """`model(tokens, cache=cache)`, (1, L) ids -> (1, L, V) logits, lazily; compiled where it
    applies (see the module docstring), else the eager forward. The cache advances by L either
    way. `inputs`: more keyword inputs of the model (a head's states: hidden.StateHead). A
    forward of more than COMPILED_POSITIONS tokens runs eagerly, as `forward_batch`'s: the
    compiled step attends over its whole buffer (a k = 15 verify of the demo pair: eager 108
    tok/s, compiled 97), unless `reserve` fixes the buffer (bitwise.py).
    `reserve`: the compiled step's buffer holds at least this many positions (a buffer fixed
    for a whole generation: bitwise.py)."""
    state = _compiled(model) if enabled() else None
    long = tokens.shape[1] > COMPILED_POSITIONS and not reserve  # eager wins (forward_batch)
    if state is None or not cache or set(inputs) != set(state.inputs) or long:
        return model(tokens, cache=cache, **inputs)
    attention = [layer for layer in cache if not isinstance(layer, RecurrentCache)]
    recurrent = [layer for layer in cache if isinstance(layer, RecurrentCache)]
    if any(layer.keys is None for layer in attention) or any(
            type(layer) is not RecurrentCache or layer.empty() for layer in recurrent):
        return model(tokens, cache=cache, **inputs)  # nothing written yet: eager
    offset, n = cache[0].offset, tokens.shape[1]
    if all(type(layer) is KVCache for layer in attention):
        size = _reserve(attention, max(offset + n, reserve)) if attention else 0
        step, where = state.step, mx.array(offset, dtype=mx.int32)
        _traced_shape(state, (n, size, len(recurrent), *_widths(inputs)))
    elif not recurrent and _ring_in_place(cache, n):
        first = cache[0]
        step = state.ring_step
        where = mx.array([offset, first.keep, first.window, first.ring], dtype=mx.int32)
        _traced_shape(state, ("ring", n, first.slots, *_widths(inputs)))
    else:  # a forward longer than the ring's margin (a catch-up), a ring beside a recurrent
        return model(tokens, cache=cache, **inputs)  # layer: eager, with its inputs
    state.kinds = tuple(isinstance(layer, RecurrentCache) for layer in cache)
    logits, keys, values, windows, states, tapes, seen = step(
        tokens, where, [layer.keys for layer in attention], [layer.values for layer in attention],
        [layer.cache[0] for layer in recurrent], [layer.cache[1] for layer in recurrent],
        *[inputs[name] for name in state.inputs])
    hidden.record(state.tags, seen)
    for layer, k, v in zip(attention, keys, values):
        layer.keys, layer.values = k, v  # the old buffers' last references go: updated in place
        layer.offset += n
    if recurrent:
        _write_back(recurrent, windows, states,
                    state.tapes[(tuple(tokens.shape), len(recurrent))], tapes)
    return logits


def _widths(inputs: dict[str, Any]) -> tuple:
    """The last dimension of each keyword input: a trace per width (an EAGLE-3 head's first
    step reads the fused states, its next ones its own)."""
    return tuple(v.shape[-1] for v in inputs.values())


def _ring_in_place(cache: Cache, n: int) -> bool:
    """Whether every layer is a `RollbackRotatingKVCache` of one shape, allocated, all at one
    offset, that writes `n` tokens in place (n <= margin + 1: a decode step or a verify; a
    longer forward reads its buffer and the new keys side by side, eagerly)."""
    first = cache[0]
    return all(type(layer) is RollbackRotatingKVCache and layer.keys is not None
               and (layer.keep, layer.ring, layer.window, layer.offset)
               == (first.keep, first.ring, first.window, first.offset)
               for layer in cache) and first.in_place(n)


def forward_batch(model: nn.Module, tokens: mx.array, cache: Any, **inputs: Any) -> Any:
    """`forward` for a `BatchCache` (batch_cache.py): (B, L) ids -> (B, L, V) logits, each row
    at its own offset; every row advances by L (the caller rolls rows back to their real
    lengths). Compiled where `forward` would be (unbounded rows) for small forwards, at most
    `COMPILED_POSITIONS` positions in all, else the eager forward: the compiled step attends
    over its whole fixed-size buffer, which costs more than it saves once many positions share
    the forward. Demo target, ms, compiled vs eager: B = 2 x 1 token 4.0-5.1 vs 4.8-5.4, 2 x 4
    9.6 vs 10.0-11.1, 4 x 1 8.2 vs 9.7-10.1, 8 x 1 12.3-12.7 vs 11.5-12.1, 8 x 4 19.4-19.7 vs
    16.3-19.6; B = 32 x 1: 21-26 vs 17-18. `inputs` as `forward`'s."""
    n = tokens.shape[1]
    small = tokens.shape[0] * n <= COMPILED_POSITIONS
    state = _compiled(model) if enabled() and small else None
    recurrent = cache.recurrent
    if state is None or cache.bounded or any(layer.keys is None for layer in cache.kv) \
            or any(layer.empty() for layer in recurrent) or set(inputs) != set(state.inputs):
        cache.reserve(n)
        logits = model(tokens, cache=cache.layers, **inputs)
    else:
        size = buffer_size(max(cache.lengths) + n)
        cache.reserve(n, size)
        _traced_shape(state, (tokens.shape[0], n, size, len(recurrent), *_widths(inputs)))
        state.kinds = tuple(isinstance(layer, RecurrentCache) for layer in cache.layers)
        logits, keys, values, windows, states, tapes, seen = state.step(
            tokens, cache.offsets(), [layer.keys for layer in cache.kv],
            [layer.values for layer in cache.kv], [layer.cache[0] for layer in recurrent],
            [layer.cache[1] for layer in recurrent], *[inputs[name] for name in state.inputs])
        hidden.record(state.tags, seen)
        for layer, k, v in zip(cache.kv, keys, values):
            layer.keys, layer.values = k, v
        if recurrent:
            _write_back(recurrent, windows, states,
                        state.tapes[(tuple(tokens.shape), len(recurrent))], tapes)
    cache.advance(n)
    return logits


def vocab_width(model: nn.Module) -> int | None:
    """Rows of the model's embedding (its logit width for Qwen2), from the mlx-lm config (a
    multimodal wrapper's, e.g. Qwen3.5's, under "text_config")."""
    args = getattr(model, "args", None)
    width = getattr(args, "vocab_size", None)
    text = getattr(args, "text_config", None)
    if width is None and isinstance(text, dict):
        width = text.get("vocab_size")
    return width


def model_inputs(model: nn.Module, tokens: list[int] | mx.array) -> list[int] | mx.array:
    """`tokens` (a list, or an int32 array, kept lazy) made safe for `model`'s embedding: ids
    beyond its width become its last row. The draft meets them where the target's logits are
    wider (e.g. Qwen2.5-7B vs 0.5B): that only changes which q it proposes from; the target where
    a wider draft proposes them (the verify, `rounds.BatchDecoder._verify`): such a proposal is
    never accepted. Never the exactness of the output."""
    width = vocab_width(model)
    if width is None:
        return tokens
    if isinstance(tokens, mx.array):
        return mx.minimum(tokens, width - 1)
    return [min(t, width - 1) for t in tokens]


def head_module(model: nn.Module) -> nn.Module | None:
    """The module of an mlx-lm model that holds its LM head: its tied embeddings
    (`.model.embed_tokens`, config `tie_word_embeddings`) or `lm_head`; None where the model has
    no `.model` body or no such module."""
    body = getattr(model, "model", None)
    if body is None:
        return None
    if getattr(getattr(model, "args", None), "tie_word_embeddings", False):
        return getattr(body, "embed_tokens", None)
    return getattr(model, "lm_head", None)


def _head(model: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """The model's LM head (hidden states -> logits) where its forward is `.model` (the body:
    tokens, cache -> hidden states) then that head: a model that says so (`head_logits`, e.g. a
    pruned draft), or an mlx-lm model of a SUPPORTED architecture (`head_module`: tied
    embeddings, applied `as_linear`, or `lm_head`); None elsewhere."""
    if getattr(model, "model", None) is None:
        return None
    own = getattr(model, "head_logits", None)
    if callable(own):
        return own
    source = head_module(model) if _model_type(model) in SUPPORTED else None
    return getattr(source, "as_linear", source)


def prefill(
    model: nn.Module,
    cache: Cache,
    tokens: list[int],
    step: int = PREFILL_STEP,
    progress: Callable[[int], None] | None = None,
    predict: int = 0,
) -> mx.array | None:
    """Run `tokens` through `model`, filling `cache`, in chunks of `step` tokens; `progress(n)`
    after each chunk with the tokens processed so far. Returns the model's logits after each of
    the last `predict` tokens, (min(predict, len(tokens)), V), evaluated (None where there are
    none). Only those rows go through the LM head: where the model's head can be taken apart
    (`_head`), the last chunk runs whole and its last hidden states go through it (the last
    chunk may then run up to `predict` - 1 tokens past `step`); elsewhere a chunk ends where the
    rows begin, a second forward. (k="auto" predicts on every look: the second forward made a
    catch-up after 17-40 plain rounds ~1.7 ms of 5 slower, and a 20-token prompt's prefill 28 ms
    where k = 1's took 16.5, demo pair on a CPU.)"""
    tokens = model_inputs(model, tokens)
    cut = max(0, len(tokens) - predict)
    head = _head(model) if predict else None
    if head is None:
        bounds = sorted({*range(0, cut, step), *range(cut, len(tokens), step)})
    else:  # the last chunk holds every predicted row
        bounds = [start for start in range(0, len(tokens), step) if start <= cut]
    rows: list[mx.array] = []
    for start, end in zip(bounds, [*bounds[1:], len(tokens)]):
        inputs = mx.array(tokens[start:end], dtype=mx.int32)[None]
        if head is not None and end == len(tokens):
            states = model.model(inputs, cache=cache)
            rows.append(head(states[0, cut - start :]))
        else:
            logits = model(inputs, cache=cache)
            if start >= cut:
                rows.append(logits[0])
        mx.eval([layer.state for layer in cache], rows, hidden.active())
        if end < len(tokens):
            mx.clear_cache()  # as mlx-lm: free the chunk's temporaries before the next one
        if progress is not None:
            progress(end)
    return mx.concatenate(rows) if rows else None

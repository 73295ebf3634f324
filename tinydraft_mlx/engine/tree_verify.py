"""A round's verify when rows carry candidate trees (trees.py): every row's nodes in one target
forward, the target's choice at every node, and the commit of the walked path into the caches.

The forward: row b's nodes are its positions in layout order (right-padded to the widest row;
a chain row's layout is its chain), written at slots length_b, length_b + 1, ... as any
verify's; each node attends to the row's cache and to its own ancestors (a (B, 1, L, slots)
mask that each layer's cache hands mlx-lm's attention through `make_mask`) and sits at position
length_b + depth (RoPE: the model's rope modules are given each node's position for the one
forward); in a ring layer (bounded, sliding-window) it sees the sinks and the window up to its
own position. Padding nodes attend as a chain's would; they are never read.

The choices: greedy argmax; an unseeded sampled row draws at every node from its warped p with
Gumbel noise drawn from its round's key per depth (a walk visits one node per depth, so its
draws are independent); a seeded row uses its (seed, position) noise, as plain decoding does
(`seeded.py`). A row with logits processors is refused at insert (their history differs per
branch).

The commit: the walked path's keys/values move to the row's contiguous slots (length_b + j <-
length_b + path[j]), the caller then rolls the row back to the path; the target states a head
reads are gathered in path order, so a drafter's commit sees the accepted positions first, as
after a chain.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from .cache.branches import branching
from .cache.kv import layer_kinds, ring_slots, slot_positions
from .cache.recurrent import RecurrentCache, model_kind
from .distributed import ranks_of
from .sampling import ParameterError, check_int, seeded, warp
from .sampling.rejection import rejection_steps
from .trees import BRANCH, Tree, chain, grow, trie


def rope_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that own a `rope` (its attention layers)."""
    return [m for _, m in model.named_modules() if isinstance(getattr(m, "rope", None),
                                                                 nn.Module)]


class _Positioned(nn.Module):
    """A rope module that places each query/key at its own position (B, L) for one forward."""

    def __init__(self, rope: nn.Module, positions: mx.array) -> None:
        super().__init__()
        self.inner, self.positions = rope, positions

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        b, h, n, d = x.shape
        flat = x.transpose(0, 2, 1, 3).reshape(b * n, h, 1, d)
        out = self.inner(flat, offset=self.positions.reshape(-1))
        return out.reshape(b, n, h, d).transpose(0, 2, 1, 3)


@contextmanager
def _placed(model: nn.Module, positions: mx.array) -> Iterator[None]:
    """For the forward inside: every rope of `model` places the nodes at `positions` (B, L);
    the model's own modules are back afterwards, whatever happened."""
    owners = rope_modules(model)
    ropes = [m.rope for m in owners]
    try:
        for owner, rope in zip(owners, ropes):
            owner.rope = _Positioned(rope, positions)
        yield
    finally:
        for owner, rope in zip(owners, ropes):
            owner.rope = rope


class _Masked:
    """A cache layer as attention sees it during a tree forward: the layer's own writes, the
    tree's mask."""

    def __init__(self, layer: Any, mask: mx.array) -> None:
        self.layer, self.mask = layer, mask

    @property
    def offset(self) -> Any:
        return self.layer.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.layer.update_and_fetch(keys, values)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return self.mask


def shapes(rows: list[Any], proposals: Any) -> list[Tree]:
    """Every row's tree for this round, from the proposals' step logits (the top candidates of
    each depth, read in one transfer with the chain's ids), or a host drafter's continuations
    (`Source.host_tree`); a chain where the row asks for none or its drafter gives neither."""
    grown = [b for b, r in enumerate(rows) if r.budget and r.round_k and proposals.logits
             and proposals.logits[b] is not None]
    tops = {}
    for b in grown:
        logits = proposals.logits[b].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        m = min(BRANCH, rows[b].budget, logprobs.shape[-1])
        ids = mx.argpartition(-logprobs, m - 1, axis=-1)[:, :m]
        tops[b] = (ids, mx.take_along_axis(logprobs, ids, axis=-1))
    mx.eval(list(tops.values()))
    drafted = proposals.values()
    out = []
    for b, row in enumerate(rows):
        drafts = drafted[b][: row.round_k]
        if b not in tops:
            host = getattr(row.source, "host_tree", None)  # a plug-in may predate it
            branches = (host(row.round_k, row.budget) if row.budget and row.round_k and host
                        and proposals.chain_rows[b] is None else [])
            out.append(trie(row.seq[-1], branches, row.budget) if branches
                       else chain(row.seq[-1], drafts))
            continue
        ids, values = (a.tolist() for a in tops[b])
        ranked = [sorted(((v, i) for v, i in zip(vs, js) if v > -float("inf")), reverse=True)
                  for vs, js in zip(values, ids)]
        # an unseeded sampled spine is tested by rejection (`choices`): taken whole first
        tested = not row.sampling.greedy and row.sampling.seed is None and \
            proposals.q[b] is not None
        out.append(grow(row.seq[-1], row.budget, [[i for _, i in r] for r in ranked],
                        [[v for v, _ in r] for r in ranked],
                        None if proposals.marginal[b] else drafts, tested=tested))
    return out


class Layout(NamedTuple):
    """The rows' trees laid out for one forward: `tokens` (B, L) int32, `depths` (B, L) int32,
    `ancestors` (B, L, L) bool (i sees j), `parents` (host: each row's parent index per node,
    -1 for the root; padding continues as a chain)."""

    tokens: mx.array
    depths: mx.array
    ancestors: mx.array
    parents: list[list[int]]


def layout(trees: list[Tree]) -> Layout:
    """The rows' trees as one forward's positions, right-padded to the widest."""
    width = max(len(t) for t in trees)
    tokens, depths, anc, parents = [], [], [], []
    for tree in trees:
        n = len(tree)
        tokens.append(tree.tokens + [0] * (width - n))
        depths.append(tree.depths + [tree.depths[-1] + 1 + i for i in range(width - n)])
        parents.append(tree.parents + list(range(n - 1, width - 1)))
        rows = []
        for i in range(width):
            seen = set(tree.ancestors(i)) if i < n else set(range(i + 1))
            rows.append([j in seen for j in range(width)])
        anc.append(rows)
    return Layout(mx.array(tokens, dtype=mx.int32), mx.array(depths, dtype=mx.int32),
                  mx.array(anc, dtype=mx.bool_), parents)


def _ring(layer: Any) -> tuple[int, int, int] | None:
    """(keep, ring, window) of a layer in the slot layout of a `RollbackRotatingKVCache` (a
    bounded or sliding-window layer, one sequence's or a batch's), None for a growing one."""
    bound = getattr(layer, "bound", layer)  # a batch layer's `Ring`, or the cache itself
    if bound is None or not hasattr(bound, "ring"):
        return None
    return bound.keep, bound.ring, bound.window


def _mask(ring: tuple[int, int, int] | None, lengths: mx.array, read: int, depths: mx.array,
          ancestors: mx.array) -> mx.array:
    """(B, 1, L, slots) what each node sees: the row's earlier positions (within the window of
    its own position, for a ring) and its ancestors. A growing layer's slot s holds position s;
    a ring's slot the position `slot_positions` gives it once the nodes are written."""
    n = depths.shape[1]
    if ring is None:
        held = mx.broadcast_to(mx.arange(read, dtype=mx.int32)[None], (lengths.shape[0], read))
    else:
        keep, size, _ = ring
        held = slot_positions(lengths[:, None] + n, keep, size, keep + size)  # (B, S)
    rel = held - lengths[:, None]  # a node's layout index, or < 0 for the cache
    index = mx.clip(rel, 0, n - 1)
    seen = (held >= 0) & (rel < 0)
    node = (rel >= 0) & (rel < n)
    tree = node[:, None, :] & mx.take_along_axis(ancestors, index[:, None, :], axis=2)
    if ring is not None:  # the latest `window` positions up to the node's own, and the sinks
        keep, _, window = ring
        at = (lengths[:, None] + depths)[:, :, None]  # (B, L, 1) each node's position
        position = mx.where(node, lengths[:, None] + mx.take_along_axis(depths, index, axis=1),
                            held)[:, None, :]
        recent = position > at - window
        return ((held < keep)[:, None, :] & (seen[:, None, :] | tree)
                | (seen[:, None, :] | tree) & recent)[:, None]
    return (seen[:, None, :] | tree)[:, None]


def forward(model: nn.Module, rows: Any, tokens: mx.array, placed: Layout,
            **inputs: Any) -> mx.array:
    """(B, L) node ids (`placed.tokens`, or the model's inputs made of them) -> (B, L, V)
    logits, each row's nodes as the module docstring says; `rows`: a `BatchCache` or a
    `SingleCache` (every row advances by L, as any verify). Recurrent layers run along each
    row's branches (cache/branches.py). A ring layer (bounded, sliding-window) or a recurrent
    one takes at most its margin + 1 nodes (the caller's check)."""
    n = tokens.shape[1]
    lengths = mx.array(rows.lengths, dtype=mx.int32)
    if hasattr(rows, "reserve"):
        rows.reserve(n)
    read = max(rows.lengths) + n  # the slots a growing layer's attention reads
    masks: dict = {}
    layers = []
    for layer in rows.layers:
        if isinstance(layer, RecurrentCache):  # no mask: it follows the branches itself
            layers.append(layer)
            continue
        ring = _ring(layer)
        if ring not in masks:
            masks[ring] = _mask(ring, lengths, read, placed.depths, placed.ancestors)
        layers.append(_Masked(layer, masks[ring]))
    with _placed(model, lengths[:, None] + placed.depths), branching(placed.parents):
        logits = model(tokens, cache=layers, **inputs)
    if hasattr(rows, "advance"):
        rows.advance(n)
    return logits


def choices(rows: list[Any], trees: dict[int, Tree], logits: mx.array,
            proposals: Any = None) -> dict[int, mx.array]:
    """Batch index -> (nodes,) the target's choice at each node of that row's tree (lazy): see
    the module docstring; for a tree whose spine is `tested` (drawn from the q in
    `proposals.q`), then each spine draft's rejection test and residual draw
    (`rejection_steps`: what `Tree.walk` reads after the choices). `rows` carry `sampling`,
    `seq` and `verify_key`."""
    out = {}
    for b, tree in trees.items():
        row, n = rows[b], len(tree)
        x = logits[b, :n]
        if row.sampling.greedy:
            out[b] = mx.argmax(x, axis=-1).astype(mx.int32)
            continue
        p = warp(x, row.sampling)
        depths = mx.array(tree.depths, dtype=mx.int32)
        top = max(tree.depths) + 1
        spine = tree.spine if tree.tested else []
        if row.sampling.seed is not None:
            noise = seeded.noise(row.sampling.seed, len(row.seq), top, p.shape[-1])
        else:
            key, spine_key = mx.random.split(row.verify_key)
            noise = mx.random.gumbel((top, p.shape[-1]), key=key)
        scores = mx.where(p > 0, mx.log(mx.maximum(p, 1e-38)) + noise[depths], -mx.inf)
        out[b] = mx.argmax(scores, axis=-1).astype(mx.int32)
        if spine:  # the spine's tests at its parents' distributions
            parents = mx.array([0] + spine[:-1], dtype=mx.int32)
            q = proposals.q_of(b, p.shape[-1])[: len(spine)]
            drafts = mx.array([tree.tokens[i] for i in spine], dtype=mx.int32)
            accepted, residual = rejection_steps(p[parents][None], q[None], drafts[None],
                                                 spine_key)
            out[b] = mx.concatenate([out[b], accepted[0].astype(mx.int32), residual[0]])
    return out


def compact(layers: Any, starts: list[int], paths: list[list[int]]) -> None:
    """Move each row's walked path to its contiguous positions: position starts[b] + j takes
    what position starts[b] + paths[b][j] holds, in every layer (`layers`: the rows cache's
    layers; an attention layer's `keys` / `values` are (B, heads, slots, dim), a ring layer's
    positions mapped to its slots; a recurrent layer's tape is laid out path first, so that
    the rollback to the path replays along it)."""
    if all(p == list(range(len(p))) for p in paths):
        return
    for layer in layers:
        if isinstance(layer, RecurrentCache):
            layer.follow(paths)
    layers = [layer for layer in layers if hasattr(layer, "keys")]
    width = max(len(p) for p in paths)
    src = mx.array([[s + (p[j] if j < len(p) else 0) for j in range(width)]
                    for s, p in zip(starts, paths)], dtype=mx.int32)
    dst = mx.array([[s + (j if j < len(p) else 0) for j in range(width)]
                    for s, p in zip(starts, paths)], dtype=mx.int32)
    for layer in layers:
        ring = _ring(layer)
        if ring is None:
            take, put = src, dst
        else:
            take, put = (ring_slots(x, ring[0], ring[1]) for x in (src, dst))
        for name in ("keys", "values"):
            buffer = getattr(layer, name)
            moved = mx.take_along_axis(buffer, take[:, None, :, None], axis=2)
            setattr(layer, name, mx.put_along_axis(buffer, put[:, None, :, None], moved,
                                                   axis=2))


def in_path_order(seen: list, paths: list[list[int]]) -> list:
    """The verify's captured (B, L, D) states with each row's positions reordered: its path
    first (the rest after it, unread)."""
    out = []
    for tag, state in seen:
        if state.ndim == 3 and state.shape[0] == len(paths):
            width = state.shape[1]
            order = mx.array([p + sorted(set(range(width)) - set(p)) for p in paths],
                             dtype=mx.int32)
            state = mx.take_along_axis(state, order[:, :, None], axis=1)
        out.append((tag, state))
    return out


def refusal(model: nn.Module, source: Any, processors: Any, bitwise: bool) -> str | None:
    """Why a row with this drafter and these processors cannot verify trees on `model` (None:
    it can): no drafter, processors, bitwise, layers of a kind a batch does not hold in the
    target or the drafter's model, a tensor-parallel target, a target whose positions this
    module cannot place (no rope module, and not a hybrid whose attention takes none)."""
    models = [m for m in (model, source.model) if m is not None]
    if not source.drafts:
        return "None without a drafter (a tree holds its proposals)"
    if processors:
        return "None with logits processors or penalties (their history differs per branch)"
    if bitwise:
        return "None with bitwise"
    if ranks_of(model) is not None or any(layer_kinds(m) is None for m in models):
        return ("None with a tensor-parallel target or layers other than attention, "
                "sliding-window attention, Gated DeltaNet and Mamba-2")
    # Mamba-2 hybrids (Nemotron-H, Granite 4) place positions by rope where they have it and
    # by nothing else (their state carries order)
    if not rope_modules(model) and model_kind(model) != "ssd":
        return "None with this target (it has no rope module to place tree positions)"
    return None


def check_budget(tree: object, top: int) -> None:
    """ParameterError unless `tree` is None or an int in [1, top]."""
    if tree is None:
        return
    try:
        check_int("tree", tree, 1, top)
    except ParameterError:
        raise ParameterError("tree", f"None or an integer node budget in [1, {top}]",
                             tree) from None

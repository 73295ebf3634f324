"""Recurrent layers along the branches of candidate trees: one target forward in which each node
of a row's tree continues its parent's state, not the state of the node laid out before it.

A tree forward (engine/tree_verify.py) feeds each row's nodes in layout order, parents first. An
attention layer sees a node's ancestors through the tree mask; a recurrent layer has no mask to
read: its two pieces run along the time axis. Inside `branching(parents)` they run along each
node's path instead (recurrent.py hands them here while a tree forward runs):

- the short convolution: node i's window is the last K inputs of the row's window before the
  forward followed by the inputs of i's ancestors and i itself (root first), gathered into one
  (rows x nodes, K, channels) input of the layer's own `conv1d`, one output per node;
- the recurrence (GDN's delta rule, Mamba-2's SSD): depth by depth, the nodes of one depth of
  every row as one batch of one position each (on the CPU one node per call: `step_width`),
  each started from its parent's state (the root from the row's state before the forward),
  through the same function mlx-lm's layer called: the same recurrence work per node as one
  call over the layout.

The layer's outputs are laid out as its inputs were. The state it leaves is that of each row's
last laid-out node: a chain's (a row without a tree, or a row padded as a chain) is what a chain
verify leaves. A tree row's state is rebuilt at the commit by replay along the walked path (the
tape's segment reordered path first, `RecurrentCache.follow`), as a chain's is along its
accepted prefix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

_local = threading.local()  # .branches: the Branches of the tree forward running on this thread


class Branches:
    """The rows' trees of one forward, as the recurrent layers need them: `parents[b][i]` is the
    layout index of node i's parent in row b (-1: the root, which continues the row's state).
    Every row has the same number of nodes (padding continues as a chain)."""

    def __init__(self, parents: list[list[int]]) -> None:
        self.parents = parents
        self.rows, self.nodes = len(parents), len(parents[0])
        self.chain = all(p == i - 1 for row in parents for i, p in enumerate(row))
        depths = []
        for row in parents:
            depth: list[int] = []
            for i, p in enumerate(row):
                if not -1 <= p < i:
                    raise ValueError(f"node {i}'s parent {p} is not laid out before it")
                depth.append(0 if p < 0 else depth[p] + 1)
            depths.append(depth)
        # the recurrence's calls: depth by depth, a depth's nodes in pieces of at most `wide`
        # (each call's states stay in the CPU's caches); per call the flat (row * nodes + i)
        # index of each node and where its parent's state is: (call, index in it), call -1 for
        # the row's state before the forward
        wide = step_width()
        self.calls: list[tuple[mx.array, list[tuple[int, int]]]] = []
        at: dict[tuple[int, int], tuple[int, int]] = {}
        order: list[int] = []
        for d in range(max(max(row) for row in depths) + 1):
            members = [(b, i) for b in range(self.rows) for i in range(self.nodes)
                       if depths[b][i] == d]
            for start in range(0, len(members), wide or len(members)):
                piece = members[start : start + (wide or len(members))]
                call = len(self.calls)
                self.calls.append((
                    mx.array([b * self.nodes + i for b, i in piece], dtype=mx.int32),
                    [(-1, b) if d == 0 else at[(b, parents[b][i])] for b, i in piece]))
                at.update({node: (call, j) for j, node in enumerate(piece)})
                order += [b * self.nodes + i for b, i in piece]
        # where each laid-out node's output is among the calls' outputs, and each row's last
        # node's state
        place = {f: j for j, f in enumerate(order)}
        self.unsort = mx.array([place[f] for f in range(self.rows * self.nodes)], dtype=mx.int32)
        self.last = [at[(b, self.nodes - 1)] for b in range(self.rows)]
        self._windows: dict[int, mx.array] = {}

    def windows(self, width: int) -> mx.array:
        """(rows * nodes, width + 1) flat indices into a (rows, width + nodes) convolution input
        (the window before the forward, then the nodes): each node's window along its path."""
        if width not in self._windows:
            out = []
            span = width + self.nodes
            for b, row in enumerate(self.parents):
                for i in range(self.nodes):
                    path, a = [], i
                    while a >= 0 and len(path) <= width:
                        path.append(width + a)
                        a = row[a]
                    before = list(range(width - (width + 1 - len(path)), width))
                    out.append([b * span + j for j in before + path[::-1]])
            self._windows[width] = mx.array(out, dtype=mx.int32)
        return self._windows[width]

    def convolve(self, conv: Callable[[mx.array], mx.array], x: mx.array,
                 width: int) -> mx.array:
        """`conv` (a valid convolution of kernel width + 1) over `x` (rows, width + nodes, C),
        each node's output from its own path's window: (rows, nodes, C')."""
        flat = x.reshape(-1, x.shape[-1])
        out = conv(flat[self.windows(width)])  # (rows * nodes, 1, C')
        return out.reshape(self.rows, self.nodes, -1)

    def recur(self, fn: Callable, arguments: dict[str, Any], timed: tuple[str, ...],
              state_arg: str) -> tuple[mx.array, mx.array]:
        """`fn` (a recurrence: timed inputs (rows, nodes, ...) and a start state -> outputs and
        the end state) run depth by depth along every branch; returns the outputs in layout
        order and each row's last node's state."""
        start = arguments.get(state_arg)
        ys, states = [], []
        for flat, sources in self.calls:
            args = {}
            for name, value in arguments.items():
                if name in timed and isinstance(value, mx.array):
                    value = value.reshape(self.rows * self.nodes, 1, *value.shape[2:])[flat]
                elif name == state_arg:
                    value = None if start is None and sources[0][0] < 0 else \
                        _gather(start, states, sources)
                args[name] = value
            y, state = fn(**args)
            ys.append(y)
            states.append(state)
        y = mx.concatenate(ys)[self.unsort]
        return y.reshape(self.rows, self.nodes, *y.shape[2:]), _gather(start, states, self.last)


def _gather(start: mx.array | None, states: list[mx.array],
            sources: list[tuple[int, int]]) -> mx.array:
    """The states at `sources` ((call, index), call -1: `start`'s row), stacked: one take per
    run of sources from the same call."""
    pieces, run = [], [sources[0]]
    for source in sources[1:]:
        if source[0] == run[-1][0]:
            run.append(source)
        else:
            pieces.append(run)
            run = [source]
    pieces.append(run)
    taken = []
    for run in pieces:
        held = start if run[0][0] < 0 else states[run[0][0]]
        index = [j for _, j in run]
        taken.append(held if index == list(range(held.shape[0])) else
                     held[mx.array(index, dtype=mx.int32)])
    return taken[0] if len(taken) == 1 else mx.concatenate(taken)


def step_width() -> int | None:
    """The most nodes one call of the recurrence takes (None: a whole depth). On the CPU one: a
    call reads and writes its states several times (decay, memory, update, output), and several
    states per call fall out of the caches; one Gated DeltaNet layer of Qwen3.5-4B's shape over
    a binary tree of 64 nodes took 120 ms one node per call, 176 ms four and 206 ms eight here
    (the chain's 64 one-position steps: 92 ms). Metal's kernel keeps a state in registers:
    one call per depth there."""
    return 1 if mx.default_device() == mx.cpu else None


def active() -> Branches | None:
    """The trees of the tree forward running on this thread (None outside one, or where every
    row is a chain)."""
    return getattr(_local, "branches", None)


@contextmanager
def branching(parents: list[list[int]]) -> Iterator[None]:
    """For the forward inside: recurrent layers run along the rows' trees (`Branches`)."""
    branches = Branches(parents)
    outer = active()
    _local.branches = None if branches.chain else branches
    try:
        yield
    finally:
        _local.branches = outer

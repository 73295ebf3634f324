"""Candidate trees: what a round verifies when a row asks for `tree=N` (a node budget), built on
the host from its drafter's per-position logits, and walked after the verify.

A tree's node 0 is the root, the row's last token (what a chain's verify starts from); every
other node is a proposed token with a parent and a depth (root 0). Nodes are laid out in the
order they were added, so a parent always precedes its children (the verify's positions are
that layout; each attends to the cache and to its ancestors, at position offset + depth).

Building (`grow`), under the budget and a depth limit K (the row's k this round), from the
drafter's logits at each depth (log-softmax, top `BRANCH` ids per depth):
- a block drafter whose positions do not read each other (DFlash: `Chain.marginal`): the
  best-first expansion of DDTree (arXiv 2604.12989): a node's children at depth d are the top
  tokens of the block's distribution at d, whoever the parent is, and nodes are taken in the
  order of their path's summed log-probability, so the tree is the N most probable prefixes of
  the block's product distribution;
- any other drafter with logits (a draft model, an MTP layer, an EAGLE-3 head, DFlash2's
  selector): its chain d_1..d_K is the spine (its logits at depth d were computed after d_1..
  d_(d-1) only), and each spine node's siblings are the next tokens of that depth's
  distribution; spine and siblings are taken best-first in the same order;
- a drafter without logits (prompt lookup): its proposal as a chain.

Accepting (`walk`): the target's choice at every node comes from the verify (greedy argmax, a
sampled row's draw with fresh noise per depth, a seeded row's (seed, position) noise); from the
root, descend to the child holding the choice while there is one. The emitted tokens are the
walked path and the target's choice where the walk stops. Every emitted token is the target's
own choice at its position given the tokens before it, whatever the tree held, so the output is
plain decoding's distribution (its text, seeded), as long as the tree was chosen without the
target's choice: it is built from the draft's outputs before the verify.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

BRANCH = 8  # the most candidates a tree takes per depth (per parent)
MAX_TREE = 64  # the largest node budget a row may ask for


@dataclass
class Tree:
    """One row's tree: `tokens[i]`, `parents[i]` (-1 for the root) and `depths[i]` of node i,
    parents before children; `spine`: how many of nodes 1.. are the chain's own d_1, d_2, ...
    in order (the first nodes a draft model's cache holds)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    spine: list[int] = field(default_factory=list)  # node index of d_1, d_2, ... in the tree
    children: dict[int, dict[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                self.children.setdefault(parent, {})[self.tokens[i]] = i

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestors(self, i: int) -> list[int]:
        """Node i and its ancestors (root last)."""
        out = [i]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out

    def walk(self, choices: list[int]) -> tuple[list[int], list[int]]:
        """(the path of nodes walked from the root, root first; the emitted tokens: the path's
        tokens after the root and the target's choice at its end). `choices[i]`: the target's
        choice at node i."""
        path = [0]
        while (child := self.children.get(path[-1], {}).get(choices[path[-1]])) is not None:
            path.append(child)
        return path, [self.tokens[i] for i in path[1:]] + [choices[path[-1]]]

    def agreed(self, path: list[int]) -> int:
        """How many of the chain's own drafts the path kept, in order from d_1 (what a draft
        model's cache may keep of what it saw)."""
        n = 0
        while n + 1 < len(path) and n < len(self.spine) and path[n + 1] == self.spine[n]:
            n += 1
        return n


def chain(last: int, drafts: list[int]) -> Tree:
    """A chain as a tree: node i is d_i, its parent node i - 1."""
    n = len(drafts)
    return Tree([last] + list(drafts), list(range(-1, n)), list(range(n + 1)),
                spine=list(range(1, n + 1)))


def grow(last: int, budget: int, ids: list[list[int]], logprobs: list[list[float]],
         drafts: list[int] | None = None) -> Tree:
    """A tree of at most `budget` nodes beside the root (see the module docstring). `ids[d]`,
    `logprobs[d]`: the candidates at depth d + 1, most probable first; `drafts`: the chain's own
    proposals d_1..d_K (a spine whose nodes alone have children), or None for a block's
    marginal distributions (any node may have children). The depth is at most len(ids)."""
    tokens, parents, depths, spine = [last], [-1], [0], []
    depth_limit = len(ids) if drafts is None else min(len(ids), len(drafts))
    # (minus the path's log-probability, tie order, parent node, depth, rank in that depth's
    # candidates, or -1 for the spine's node)
    heap: list[tuple[float, int, int, int, int]] = []
    order = 0

    def push(score: float, parent: int, depth: int, rank: int) -> None:
        nonlocal order
        heapq.heappush(heap, (-score, order, parent, depth, rank))
        order += 1

    def sibling(score: float, parent: int, depth: int, rank: int) -> None:
        """The next candidate at `depth` under `parent` from `rank` on (not the spine's)."""
        row = ids[depth - 1]
        while rank < len(row) and drafts is not None and row[rank] == drafts[depth - 1]:
            rank += 1
        if rank < len(row):
            push(score + logprobs[depth - 1][rank], parent, depth, rank)

    def spine_score(depth: int) -> float:
        token = drafts[depth - 1]
        row = ids[depth - 1]
        return logprobs[depth - 1][row.index(token)] if token in row else min(
            logprobs[depth - 1]) - 1.0  # a sampled draft outside the top: ranked after them

    if depth_limit:
        if drafts is None:
            push(logprobs[0][0], 0, 1, 0)
        else:
            push(spine_score(1), 0, 1, -1)
            sibling(0.0, 0, 1, 0)
    while heap and len(tokens) - 1 < budget:
        neg, _, parent, depth, rank = heapq.heappop(heap)
        score = -neg
        node = len(tokens)
        tokens.append(drafts[depth - 1] if rank < 0 else ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        base = score - (spine_score(depth) if rank < 0 else logprobs[depth - 1][rank])
        if rank < 0:  # the spine: its next node, and that depth's first siblings
            spine.append(node)
            if depth < depth_limit:
                push(score + spine_score(depth + 1), node, depth + 1, -1)
                sibling(score, node, depth + 1, 0)
        else:
            sibling(base, parent, depth, rank + 1)
            if drafts is None and depth < depth_limit:
                push(score + logprobs[depth][0], node, depth + 1, 0)
    return Tree(tokens, parents, depths, spine)

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
- a drafter without logits: its continuations (`Source.host_tree`: prompt lookup's, the
  latest few of each matching n-gram) merged into one tree (`trie`), or its proposal as a
  chain.

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
import math
from dataclasses import dataclass, field

BRANCH = 8  # the most candidates a tree takes per depth (per parent)
MAX_TREE = 64  # the largest node budget a row may ask for


@dataclass
class Tree:
    """One row's tree: `tokens[i]`, `parents[i]` (-1 for the root) and `depths[i]` of node i,
    parents before children; `spine`: the nodes of the chain's own d_1, d_2, ... in order;
    `tested`: the spine was drawn from q and is tested by min(1, p/q) (`walk`), so it was taken
    whole before any sibling (`grow`)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    spine: list[int] = field(default_factory=list)  # node index of d_1, d_2, ... in the tree
    tested: bool = False
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

    def walk(self, choices: list[int], accepted: list[int] | None = None,
             residual: list[int] | None = None) -> tuple[list[int], list[int]]:
        """(the path of nodes walked from the root, root first; the emitted tokens: the path's
        tokens after the root and the target's choice at its end). `choices[i]`: the target's
        choice at node i. `accepted`, `residual` (a spine drawn from q): at spine node j - 1
        the spine's d_j passes or fails its rejection test (`accepted[j - 1]`); after a failure
        the token is the residual's draw, which descends to a sibling holding it."""
        path = [0]
        while True:
            at, j = path[-1], len(path) - 1
            if accepted is not None and j < len(self.spine) and (at == 0 or self.spine[j - 1]
                                                                   == at):
                if accepted[j]:
                    path.append(self.spine[j])
                    continue
                child = self.children.get(at, {}).get(residual[j])
                if child is None:
                    return path, [self.tokens[i] for i in path[1:]] + [residual[j]]
                path.append(child)
                at = child
            child = self.children.get(at, {}).get(choices[at])
            if child is None:
                return path, [self.tokens[i] for i in path[1:]] + [choices[at]]
            path.append(child)

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


def trie(last: int, continuations: list[list[int]], budget: int) -> Tree:
    """The continuations (best first) merged into one tree of at most `budget` nodes: each adds
    the nodes its path lacks while the budget lasts; the first is the spine."""
    tokens, parents, depths = [last], [-1], [0]
    kids: dict[tuple[int, int], int] = {}
    spine: list[int] = []
    for n, continuation in enumerate(continuations):
        node = 0
        for token in continuation:
            child = kids.get((node, token))
            if child is None:
                if len(tokens) - 1 >= budget:
                    break
                child = kids[node, token] = len(tokens)
                tokens.append(token)
                parents.append(node)
                depths.append(depths[node] + 1)
            node = child
            if n == 0:
                spine.append(node)
    return Tree(tokens, parents, depths, spine)


def grow(last: int, budget: int, ids: list[list[int]], logprobs: list[list[float]],
         drafts: list[int] | None = None, tested: bool = False) -> Tree:
    """A tree of at most `budget` nodes beside the root (see the module docstring). `ids[d]`,
    `logprobs[d]`: the candidates at depth d + 1, most probable first; `drafts`: the chain's own
    proposals d_1..d_K (a spine whose nodes alone have children), or None for a block's
    marginal distributions (any node may have children). The depth is at most len(ids).
    `tested`: the spine was drawn from q and will be tested by rejection (`Tree.walk`): it is
    taken whole before any sibling (as far as the budget goes), so that which drafts the tree
    holds, and so which rule tests them, does not depend on what they are."""
    tokens, parents, depths, spine = [last], [-1], [0], []
    depth_limit = len(ids) if drafts is None else min(len(ids), len(drafts))
    # (priority: minus the path's log-probability, or -inf for a spine taken first; tie order;
    # the path's log-probability; parent node; depth; rank in that depth's candidates, or -1
    # for the spine's node)
    heap: list[tuple[float, int, float, int, int, int]] = []
    order = 0

    def push(score: float, parent: int, depth: int, rank: int) -> None:
        nonlocal order
        first = tested and rank < 0
        heapq.heappush(heap, (-math.inf if first else -score, order, score, parent, depth, rank))
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
        _, _, score, parent, depth, rank = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(drafts[depth - 1] if rank < 0 else ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        if rank < 0:  # the spine: its next node, and that depth's first siblings
            spine.append(node)
            if depth < depth_limit:
                push(score + spine_score(depth + 1), node, depth + 1, -1)
                sibling(score, node, depth + 1, 0)
        else:  # the next sibling scores from the parent's path
            sibling(score - logprobs[depth - 1][rank], parent, depth, rank + 1)
            if drafts is None and depth < depth_limit:
                push(score + logprobs[depth][0], node, depth + 1, 0)
    return Tree(tokens, parents, depths, spine, tested=tested and bool(spine))

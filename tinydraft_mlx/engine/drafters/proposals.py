"""The batch's proposer: `Drafting` keeps one chain (chains.py) per drafting model, and per
round makes every row's proposal (`Proposals`): host ones first (prompt lookup, plug-ins), then
one batched chain of draft steps per model that a row needs; after the verify it rolls the
chains' rows back to what was accepted (`commit`). It asks each row's drafter through the
protocol (protocol.py), never its kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache import Cache
from .chains import Chain
from .protocol import Source


def point_mass(tokens: mx.array, width: int) -> mx.array:
    """(k, width) one-hot rows: the draft distribution of a deterministic proposal."""
    return (mx.arange(width)[None] == tokens[:, None]).astype(mx.float32)


@dataclass
class Proposals:
    """One round's proposals for every row of the batch, in row order: `ks` the tokens each row
    drafts (0: a plain step), host ids where the host proposed (else None), and the model's
    chain (model rows, steps) with each row's index in it (None for a host row). `q`: a row's
    (k, Vq) draft distributions where it drew from one, from its model or on the host (None:
    point masses)."""

    ks: list[int]
    host: list[list[int] | None]
    chain: mx.array | None
    chain_rows: list[int | None]
    q: list[mx.array | None]
    # a chain row's (k, Vq) step logits and whether its steps ignore each other (candidate
    # trees read them: trees.py); None for a host row
    logits: list[mx.array | None] | None = None
    marginal: list[bool] | None = None
    widest: int = field(init=False)  # the widest q of the round (0: none)

    def __post_init__(self) -> None:
        self.widest = max((q.shape[-1] for q in self.q if q is not None), default=0)

    @classmethod
    def plain(cls, rows: int) -> Proposals:
        """A round in which no row drafts."""
        return cls([0] * rows, [[]] * rows, None, [None] * rows, [None] * rows)

    def inputs(self, lasts: list[int]) -> mx.array:
        """(B, 1 + max k): each row's [last, d_1..d_k], right-padded, with the chain's device
        ids merged in a few whole-batch ops."""
        width = 1 + max(self.ks, default=0)
        host = [[last] + (h or []) for last, h in zip(lasts, self.host)]
        x = mx.array([h + [0] * (width - len(h)) for h in host], dtype=mx.int32)
        if self.chain is None or width == 1:
            return x
        chain, steps = self.chain, self.chain.shape[1]
        if steps < width - 1:
            chain = mx.pad(chain, [(0, 0), (0, width - 1 - steps)])
        chain = chain[:, : width - 1]
        picks = [0 if j is None else j for j in self.chain_rows]
        take = [[j is not None and i < k for i in range(width - 1)]
                for j, k in zip(self.chain_rows, self.ks)]
        chain = chain[mx.array(picks, dtype=mx.int32)]
        rest = mx.where(mx.array(take), chain, x[:, 1:])
        return mx.concatenate([x[:, :1], rest], axis=1)

    def drafts(self, b: int) -> mx.array:
        """Row b's (k,) draft ids on the device."""
        j, k = self.chain_rows[b], self.ks[b]
        if j is not None:
            return self.chain[j, :k]
        return mx.array(self.host[b] or [], dtype=mx.int32)[:k]

    def q_of(self, b: int, width: int) -> mx.array:
        """Row b's (k, W) draft distributions, W the round's one width for q: the target's
        (`width`), or a wider draft's where one proposed, so that every row's q stacks. Point
        masses for a host proposal; a narrower draft's q is zero on the ids it lacks."""
        width = max(width, self.widest)
        q = self.q[b]
        if q is None:
            return point_mass(self.drafts(b), width)
        extra = width - q.shape[-1]
        return q if extra == 0 else mx.pad(q, [(0, 0), (0, extra)])

    def values(self) -> list[list[int]]:
        """Every row's draft ids on the host (one read of the chain)."""
        chain = self.chain.tolist() if self.chain is not None else None
        return [h if j is None else chain[j][:k]
                for h, j, k in zip(self.host, self.chain_rows, self.ks)]


class Drafting:
    """The batch's proposer (see the module docstring): one chain per drafting model, made by
    the first source that drafts with it (`add`). `rows`: a function making an empty rows cache
    for a model (a `BatchCache` or a `SingleCache`); `chunk`: the most tokens a catch-up feeds
    per forward; `width`: the target's vocabulary width (processors know its ids)."""

    def __init__(self, rows: Callable[[nn.Module], Any], chunk: int,
                 width: int | None) -> None:
        self.chains: dict[int, Chain] = {}
        self.rows, self.chunk, self.width = rows, chunk, width

    def has(self, model: nn.Module) -> bool:
        """Whether a chain drafts with `model`."""
        return id(model) in self.chains

    def add(self, source: Source, target: nn.Module) -> None:
        """A chain for `source`'s model, if the batch has none yet (the source attached to
        `target` first: ParameterError where it cannot draft for it)."""
        if source.model is not None and id(source.model) not in self.chains:
            source.attach(target)
            self.chains[id(source.model)] = source.chain(self.rows(source.model), self.chunk,
                                                         self.width)

    def caches(self) -> list[Any]:
        """Every chain's rows cache."""
        return [chain.caches for chain in self.chains.values()]

    @staticmethod
    def reads_target(rows: list[Any]) -> bool:
        """Whether a row among `rows` drafts from the target's states (its verify and prefill
        must capture them)."""
        return any(r.source.reads_target for r in rows)

    def admit(self, row: Any, cache: Cache | None, budget: int | None,
              seen: list = (), start: int = 0) -> tuple[int, bool]:
        """Prefill a joining row's one-sequence draft cache (all of its sequence but the last
        token), at most `budget` tokens (None: all): (tokens fed, whether it is done). `seen`:
        the capture of the target's prefill from position `start` (a head's row reads it)."""
        if row.source.model is None or cache is None:
            return 0, True
        return self.chains[id(row.source.model)].admit(row, cache, budget, list(seen), start)

    def release(self, row: Any, cache: Cache | None) -> Cache | None:
        """A row that leaves before joining (its prompt not all in): its one-sequence draft
        cache as it may be kept (None: none), and whatever its chain held for it dropped."""
        if row.source.model is None or cache is None:
            return None
        return self.chains[id(row.source.model)].release(row, cache)

    def join(self, rows: list[Any], caches: list[Cache | None]) -> None:
        """Rows enter the batch (after the target's rows), with their draft caches."""
        for row in rows:
            row.source.begin(row.seq)
        for key, chain in self.chains.items():
            members = [(r, c) for r, c in zip(rows, caches)
                       if r.source.model is not None and id(r.source.model) == key]
            if members:
                chain.join([r for r, _ in members], [c for _, c in members])

    def leave(self, rows: list[Any]) -> dict[int, Cache]:
        """Rows out: their draft caches rolled back to seq[:-1], extracted for the rows that
        keep their caches (`keep_caches`)."""
        out: dict[int, Cache] = {}
        for chain in self.chains.values():
            out.update(chain.leave(rows))
        return out

    def propose(self, rows: list[Any], ks: list[int]) -> Proposals:
        """Every row's proposal for this round (`ks`: what each row may draft; a host source may
        offer fewer). Rows carry `seq`, `source`, `sampling`, `processors`, `uid` and
        `draft_key` (this round's, None when greedy). Each chain a row of this round needs runs
        once for all of its rows; the chains' ids are stacked into one array."""
        host: list[list[int] | None] = []
        q: list[mx.array | None] = [None] * len(rows)
        for b, (row, k) in enumerate(zip(rows, ks)):
            h = row.source.host_proposal(k) if k else []
            if h is not None and not isinstance(h, list):  # a HostProposal: ids with their q
                h, q[b] = list(h.tokens), (h.q[: len(h.tokens)] if h.tokens else None)
            if h is None and not self.chains[id(row.source.model)].ready(row.uid):
                h = []  # nothing to draft from yet (a head's whole prompt came cached)
            host.append(h)
        ks = [k if h is None else len(h) for h, k in zip(host, ks)]
        chain_rows: list[int | None] = [None] * len(rows)
        logits: list[mx.array | None] = [None] * len(rows)
        marginal = [False] * len(rows)
        parts: list[mx.array] = []
        needed = {id(r.source.model) for r, h in zip(rows, host) if h is None}
        at = 0
        for key, chain in self.chains.items():
            if key not in needed:
                continue
            position = {uid: j for j, uid in enumerate(chain.uids)}
            ordered = [None] * len(chain.uids)
            for b, row in enumerate(rows):
                if row.uid in position:
                    ordered[position[row.uid]] = (b, row, ks[b] if host[b] is None else 0)
            ids, qs = chain.run(ordered)
            for j, (b, _, k) in enumerate(ordered):
                if k:
                    chain_rows[b], q[b] = at + j, qs[j]
                    if chain.logits is not None:
                        logits[b], marginal[b] = chain.logits[j, :k], chain.marginal
            parts.append(ids)
            at += ids.shape[0]
        steps = max((p.shape[1] for p in parts), default=0)
        parts = [p if p.shape[1] == steps else mx.pad(p, [(0, 0), (0, steps - p.shape[1])])
                 for p in parts]
        chain = None if not parts else parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return Proposals(ks, host, chain, chain_rows, q, logits, marginal)

    def commit(self, rows: list[Any], befores: list[int], proposals: Proposals,
               seen: list | None = None) -> None:
        """The round is booked (each row's `seq` holds what it accepted): every source settles,
        and each chain's rows keep what they saw of the accepted sequence (a host row was fed
        the chain's padding past `before`, its length at the proposal). `seen`: the verify's
        capture of the target's states, where a head's row is in the batch."""
        for row in rows:
            row.source.settle(len(row.seq) - 1)
        by_uid = {r.uid: (r, before, j is None, b)
                  for b, (r, before, j) in enumerate(zip(rows, befores, proposals.chain_rows))}
        for chain in self.chains.values():
            if chain.uids:
                chain.commit(by_uid, seen)

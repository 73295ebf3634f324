"""A verified round's acceptance, for every row of a batch at once: from the target's logits at
each row's [last, d_1..d_k], the arrays its commit reads (lazy): the argmax at each position
(greedy) or [n, token] (sampled: `rejection.py`'s rule against the row's warped p and q), and the
processed logits where the row wants log-probabilities.

Logits processors see at verify position i the history seq + d_1..d_(i-1), as plain decoding
would at that position. A draft with a wider vocabulary can propose ids beyond the target's
embedding: they are clamped for the forward pass only (`forward.model_inputs`); such a proposal
is never accepted (p is 0 there), so the positions after it, the only ones the clamp changes,
are always discarded.

Randomness: a seeded row's tokens are the Gumbel-max choices of its (seed, position) noise
(`seeded.py`): drafts are accepted while they equal the target's choice, so its text is plain
decoding's with that seed, whatever drafted it and whatever rows are beside it. Unseeded rows keep
min(1, p/q) rejection sampling (`rejection.py`) and draw together, one key per kind of draw (each
row still exactly distributed); their plain steps at a temperature alone (no filter, no
processors) sample softmax(x / T) directly, all rows of one temperature in one draw.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import mlx.core as mx

from .drafters import Proposals
from .sampling import (
    draw,
    draw_at,
    process_logits,
    sample_rows,
    sampling_groups,
    seeded,
    warp,
    with_warp,
)
from .sampling.rejection import speculative_accept, speculative_accept_rows


def _scaled_draw(row: Any) -> bool:
    s = row.sampling
    return (row.round_k == 0 and not s.greedy and s.seed is None and not row.processors
            and s.top_k == 0 and s.top_p == 1.0 and s.min_p == 0.0)


def _processed(row: Any, b: int, proposals: Proposals, logits: mx.array) -> mx.array:
    """Row b's (1, k+1, V) logits, through its processors with each position's history."""
    k = row.round_k
    row_logits = logits[b : b + 1, : k + 1]
    if not row.processors:
        return row_logits
    history = mx.array(row.seq, dtype=mx.int32)
    drafts = proposals.drafts(b) if k else None
    before = [drafts[i : i + 1] for i in range(k)]
    return mx.stack([process_logits(row_logits[:, i], history, before[:i], row.processors)
                     for i in range(k + 1)], axis=1)


def verify(rows: list[Any], proposals: Proposals, logits: mx.array,
           shared_key: Callable[[], mx.array], ahead: int = 0,
           skip: Collection[int] = ()) -> tuple[list, list]:
    """(per row: its greedy argmaxes or [n, token] / [token]; per row: its processed logits
    where it wants log-probabilities, else None). `logits`: (B, L, V); `shared_key()` a fresh
    key for unseeded rows' joint draws; `ahead`: tokens each row will have emitted before this
    round's first (1 for a plain round queued ahead of the current one's read); `skip`: rows
    whose verify is another rule's (candidate trees: tree_verify.py), left None in both."""
    simple = [j not in skip and not r.processors and r.sampling.greedy
              for j, r in enumerate(rows)]
    argmax = mx.argmax(logits, axis=-1).astype(mx.int32) if any(simple) else None
    results: list[mx.array | None] = [None] * len(rows)
    kept: list[mx.array | None] = [None] * len(rows)
    for members in sampling_groups(rows, lambda j, r: j not in skip and _scaled_draw(r)).values():
        tokens = draw_at(logits[mx.array(members), 0], rows[members[0]].sampling.temperature,
                         shared_key())
        for i, j in enumerate(members):
            results[j] = tokens[i : i + 1]
    for members in sampling_groups(rows, lambda j, r: j not in skip and not r.sampling.greedy
                                   and not r.processors and r.sampling.seed is None
                                   and not _scaled_draw(r)).values():
        # unseeded rows of one regime and one k (one sequence, or a uniform batch): the warp
        # and the draw or the acceptance rule in one compiled graph, as `decode` ran them
        k, sampling = rows[members[0]].round_k, rows[members[0]].sampling
        if any(rows[j].round_k != k for j in members):
            continue  # drafting different ks: warped below, then the padded rule
        first = members[0]
        x = (logits[first : first + len(members)] if members[-1] - first == len(members) - 1
             else logits[mx.array(members)])[:, : k + 1]  # a slice where the rows are adjacent
        if k == 0:
            tokens = draw(x[:, 0], sampling, shared_key())[1]
            pairs = [tokens[i : i + 1] for i in range(len(members))]
        else:
            q = mx.stack([proposals.q_of(j, logits.shape[-1]) for j in members])
            d = mx.stack([proposals.drafts(j) for j in members])
            n, token = with_warp(speculative_accept, sampling)(x, q, d, shared_key())
            pairs = list(mx.stack([n, token], axis=1))
        for j, pair in zip(members, pairs):
            results[j] = pair
    warped: dict[int, mx.array] = {}  # row -> its warped p (other sampled rows, no processors)
    for members in sampling_groups(rows, lambda j, r: j not in skip and not r.sampling.greedy
                                   and not r.processors and not _scaled_draw(r)
                                   and results[j] is None).values():
        probs = warp(logits[mx.array(members)], rows[members[0]].sampling)  # one warp
        warped.update({j: probs[i : i + 1] for i, j in enumerate(members)})
    plain_shared = []  # unseeded plain rows: drawn together
    for j, row in enumerate(rows):
        if j in skip:
            continue
        k = row.round_k
        row_logits = _processed(row, j, proposals, logits)
        kept[j] = row_logits if row.logprobs else None
        if results[j] is not None:  # drawn above
            continue
        if simple[j]:
            results[j] = argmax[j, : k + 1]
        elif row.sampling.greedy:
            results[j] = mx.argmax(row_logits[0], axis=-1).astype(mx.int32)
        elif row.sampling.seed is not None:  # the target's Gumbel-max choice at each position
            p = (warped[j] if j in warped else warp(row_logits, row.sampling))[0, : k + 1]
            start = len(row.seq) + ahead
            results[j] = (seeded.choose(p, row.sampling.seed, start) if k == 0 else
                          seeded.coupled_accept(p, proposals.drafts(j), row.sampling.seed, start))
        elif k == 0 and j in warped:
            plain_shared.append(j)
        elif k == 0:  # a plain step with the row's own key
            p = warped[j][:, 0] if j in warped else warp(row_logits[:, 0], row.sampling)
            results[j] = sample_rows(p, row.verify_key)
        elif j not in warped:  # processed logits: this row alone
            p = warp(row_logits, row.sampling)
            n, token = speculative_accept(p, proposals.q_of(j, p.shape[-1])[None],
                                          proposals.drafts(j)[None], row.verify_key)
            results[j] = mx.concatenate([n, token])
    if plain_shared:
        tokens = sample_rows(mx.concatenate([warped[j][:, 0] for j in plain_shared]),
                             shared_key())
        for i, j in enumerate(plain_shared):
            results[j] = tokens[i : i + 1]
    members = [j for j in warped if rows[j].round_k > 0 and results[j] is None]
    if members:  # unseeded drafting rows: the rejection rule in one batch
        pairs = _accept(rows, members, proposals, warped, shared_key())
        for i, j in enumerate(members):
            results[j] = pairs[i]
    return results, kept


def _accept(rows: list[Any], members: list[int], proposals: Proposals,
            warped: dict[int, mx.array], key: mx.array) -> mx.array:
    """(len(members), 2) [n, token] of the drafting rows `members`, in one batch."""
    lengths = [rows[j].round_k for j in members]
    top = max(lengths)
    p = mx.concatenate([warped[j][:, : top + 1] for j in members])
    q = mx.stack([mx.pad(proposals.q_of(j, p.shape[-1]), [(0, top - n), (0, 0)])
                  for j, n in zip(members, lengths)])
    d = mx.stack([mx.pad(proposals.drafts(j), [(0, top - n)])
                  for j, n in zip(members, lengths)])
    n, token = speculative_accept_rows(p, q, d, lengths, key)
    return mx.stack([n, token], axis=1)

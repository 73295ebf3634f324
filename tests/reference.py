"""Independent references: a NumPy warp (temperature -> top-k -> top-p -> min-p) written from the
definitions, a brute-force windowed forward pass for bounded caches, and chi-square helpers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def warp_np(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64) / temperature
    if 0 < top_k < z.size:
        kth = np.sort(z)[-top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        mass_before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        keep = np.zeros(p.size, dtype=bool)
        keep[order[mass_before < top_p]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p > 0.0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def chi2_threshold(df: int, z: float = 4.0) -> float:
    """Upper quantile of chi-square(df) by Wilson-Hilferty; z=4.0 is the 1 - 3.2e-5 quantile."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def chi2_statistic(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson chi-square of observed `counts` against `probs` (both keyed by outcome), pooling the
    outcomes with expected count < 5 into one cell. An observed outcome of probability 0 gives inf.
    Returns (statistic, degrees of freedom)."""
    if any(probs.get(o, 0.0) == 0.0 for o in counts):
        return float("inf"), 1
    stat, pooled_obs, pooled_exp, cells = 0.0, 0.0, 0.0, 0
    for outcome, p in probs.items():
        expected, observed = n * p, counts.get(outcome, 0)
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + observed, pooled_exp + expected
            continue
        stat += (observed - expected) ** 2 / expected
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    return stat, max(cells - 1, 1)


class _ExplicitWindow:
    """A stand-in cache for one uncached forward pass over a whole sequence: stores nothing and
    masks each position to [0, keep) plus the most recent W - keep positions, itself included."""

    offset = 0

    def __init__(self, window: int, keep: int = 4):
        self.window, self.keep = window, keep

    def make_mask(self, n, **_):
        q, k = np.arange(n)[:, None], np.arange(n)[None, :]
        return mx.array((k <= q) & ((k < self.keep) | (k > q - (self.window - self.keep))))

    def update_and_fetch(self, keys, values):
        return keys, values


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-probabilities of logits `x` along the last axis."""
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def two_step_joint(logits_of, ids: list[int], **warp_kw) -> dict[tuple[int, int], float]:
    """The exact joint of the first two tokens after `ids`, each step warped by `warp_np`;
    logits_of(ids) -> (len(ids), V) logits (the oracle's, or a windowed pass)."""
    p1 = warp_np(logits_of(ids)[-1], **warp_kw)
    joint = {}
    for a in np.flatnonzero(p1):
        p2 = warp_np(logits_of(ids + [int(a)])[-1], **warp_kw)
        for b in np.flatnonzero(p2):
            joint[(int(a), int(b))] = p1[a] * p2[b]
    return joint


def drain_first_two(decoder, uids: list[int], counts, paths) -> None:
    """Step a `BatchDecoder` until every sequence has finished; add each of `uids`' first two
    tokens to `counts` and whether it accepted a draft to `paths` (Counters)."""
    out, stats = {uid: [] for uid in uids}, {}
    while len(decoder):
        for uid, tokens in decoder.step().items():
            if uid in out:
                out[uid] += [t.id for t in tokens]
                stats[uid] = tokens[-1].stats
    for uid in uids:
        counts[tuple(out[uid][:2])] += 1
        paths["accepted" if stats[uid].accepted else "rejected"] += 1


def assert_first_two(counts, paths, exact: dict, wrong: dict, both_paths: bool = True) -> None:
    """The suite's verdict on sampled first-two-token pairs (`counts`, and `paths` as
    `drain_first_two` books them): both the accept and the resample path occurred (unless the
    rows drafted nothing: `both_paths` False), the chi-square against the exact joint is below
    the threshold, and against the wrong joint above it (the samples can tell them apart)."""
    n = sum(counts.values())
    if both_paths:
        assert paths["accepted"] > 0 and paths["rejected"] > 0, paths
    stat, df = chi2_statistic(counts, exact, n)
    assert stat < chi2_threshold(df), (stat, df)
    wrong_stat, wrong_df = chi2_statistic(counts, wrong, n)
    assert wrong_stat > chi2_threshold(wrong_df), (wrong_stat, wrong_df)


def check_first_two_tokens(make_decoder, ids: list[int], draft, n: int, exact: dict,
                           wrong: dict, rows: int = 100, k: int | str = 2,
                           both_paths: bool = True, **insert) -> None:
    """Sample the first two tokens after `ids` in `n` rows drafting `k` with `draft` (rows
    `rows` at a time in decoders from `make_decoder()`, each from a copy of the prompt's
    prefilled caches; row i seeded with i where its sampling uses it; `insert`: more arguments
    of every row, its sampling settings as `sampling(seed)`), then `assert_first_two`."""
    from collections import Counter

    sampling = insert.pop("sampling")
    cache = prefilled(make_decoder, ids, draft)
    counts, paths = Counter(), Counter()
    for begin in range(0, n, rows):
        decoder = make_decoder()
        uids = [insert_from(decoder, cache, ids, draft=draft, k=k, max_tokens=3,
                            sampling=sampling(seed), **insert)
                for seed in range(begin, min(n, begin + rows))]
        drain_first_two(decoder, uids, counts, paths)
    assert_first_two(counts, paths, exact, wrong, both_paths)


def windowed_logits(model, ids, window: int, keep: int = 4) -> np.ndarray:
    """(len(ids), V) float64 logits of one uncached pass in which each position attends to
    positions [0, keep) and the most recent window - keep positions, itself included: what a
    bounded cache of `window` positions must reproduce."""
    cache = [_ExplicitWindow(window, keep) for _ in model.layers]
    return np.array(model(mx.array([ids]), cache=cache)[0].astype(mx.float32)).astype(np.float64)


def prefilled(make_decoder, ids: list[int], draft, prefill=None):
    """A prompt cache holding `ids` for `draft` (a `draft` argument, resolved in the context of
    a decoder from `make_decoder()`), filled by the engine itself (`prefill`: the prompt's own,
    a prompt with images'): rows that start from copies of it (`insert_from`) skip the prefill,
    the bulk of a short row's cost."""
    from tinydraft_mlx import PromptCache
    from tinydraft_mlx.engine.drafters import resolve_drafter
    from tinydraft_mlx.generation.batching import record_caches

    decoder = make_decoder()
    source = resolve_drafter(draft, decoder.draft, decoder.target)
    uid = decoder.insert(ids, draft=source, k=1, max_tokens=1, keep_caches=True,
                         prefill=prefill)
    drain(decoder)
    cache = PromptCache(decoder.target, source)
    assert record_caches(cache, decoder.remove(uid), ids, [])
    return cache


def prefilled_rows(target, prompts: list[list[int]], margin: int):
    """A `BatchCache` of `target` holding `prompts`, each prefilled in a one-sequence cache of
    that rollback margin (as a batch's joining rows are)."""
    from tinydraft_mlx.engine.cache import layer_kinds, make_cache
    from tinydraft_mlx.engine.cache.batch import BatchCache
    from tinydraft_mlx.engine.forward import prefill

    rows, solo = BatchCache(layer_kinds(target), margin=margin), []
    for ids in prompts:
        cache = make_cache(target, margin=margin)
        prefill(target, cache, ids)
        solo.append(cache)
    rows.add(solo)
    return rows


def insert_from(decoder, cache, ids: list[int], **kwargs) -> int:
    """Insert `ids` into `decoder` on a copy of `cache`'s caches (`prefilled`)."""
    row = cache.copy()
    row.reuse(ids)
    return decoder.insert(ids, target_cache=row.target_cache, draft_cache=row.draft_cache,
                          **kwargs)


def check_first_two_in_batches(make_decoder, ids: list[int], draft, sampling, companions,
                               prompts: list[list[int]], exact: dict, wrong: dict,
                               batches: int = 30, rows: int = 40, every: int = 20,
                               prefill=None, **insert) -> None:
    """Sample the first two tokens after `ids` in `batches` x `rows` rows drafting with `draft`
    (k = 2, `sampling`, `insert`: more arguments of those rows), inside batches from
    `make_decoder()` that a companion (sampling, draft, k), on prompts[j // every], joins every
    `every` rows; assert that the accept and the resample path both occurred, that the
    chi-square against the exact joint is below the suite's threshold and against the wrong
    joint above it. `prefill`: the prompt's own (a prompt with images'), for the prefill and
    for every row (a row whose copy cannot be cut back to the prompt prefills it anew)."""
    from collections import Counter

    counts, paths = Counter(), Counter()
    cache = prefilled(make_decoder, ids, draft, prefill)
    for batch in range(batches):
        decoder = make_decoder()
        uids = []
        for j in range(rows):
            uids.append(insert_from(decoder, cache, ids, draft=draft, k=2, max_tokens=3,
                                    sampling=sampling, prefill=prefill, **insert))
            if j % every == 0:
                s, kind, k = companions[(batch + j // every) % len(companions)]
                decoder.insert(prompts[j // every], draft=kind, k=k, max_tokens=4 + j // 8,
                               sampling=s)
        drain_first_two(decoder, uids, counts, paths)
    assert_first_two(counts, paths, exact, wrong)


def drain(decoder) -> dict[int, list[int]]:
    """Step a `BatchDecoder` until every sequence has finished: uid -> its generated ids."""
    out: dict[int, list[int]] = {}
    while len(decoder):
        for uid, tokens in decoder.step().items():
            out.setdefault(uid, []).extend(t.id for t in tokens)
    return out


def seeded_row_in_a_batch(target, draft, tok, refs, drafter, companions) -> None:
    """A seeded row (T = 0.8, top-p 0.9, seed 11, k = 3, `drafter`) decodes alone and beside
    two `companions` (draft kinds) in a batch with `draft`: assert the same tokens."""
    from tinydraft_mlx import BatchDecoder, SamplingParams, generate

    ids = refs[0][0]
    alone, _ = generate(target, drafter, tok, ids, k=3, max_tokens=20, seed=11, temperature=0.8,
                        top_p=0.9)
    decoder = BatchDecoder(target, draft)
    decoder.insert(refs[2][0], draft=companions[0], k=2, max_tokens=6,
                   sampling=SamplingParams(0.7))
    uid = decoder.insert(ids, draft=drafter, k=3, max_tokens=20,
                         sampling=SamplingParams(0.8, top_p=0.9, seed=11))
    decoder.insert(refs[3][0], draft=companions[1], k=4, max_tokens=20)
    assert drain(decoder)[uid] == alone


def assert_block_context(drafter, oracle, seq: list[int], kept) -> None:
    """A block drafter's kept cache (`kept`, a row's BlockCache) holds, once its unread states
    are absorbed, the drafter's keys/values of the transformers oracle's states of seq[:-1],
    written in one go (to 1e-4)."""
    import torch

    with torch.no_grad():
        run = oracle.model(torch.tensor([seq[:-1]]), output_hidden_states=True)
    states = np.concatenate([run.hidden_states[j + 1][0].numpy() for j in drafter.after], -1)
    fresh = drafter.make_cache()
    drafter.absorb(mx.array(states)[None], fresh)
    if kept.states:
        drafter.absorb(mx.concatenate(kept.states)[None], kept)
    for ours, theirs in zip(kept, fresh):
        assert ours.offset == theirs.offset == len(seq) - 1
        n = ours.offset
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            assert float(mx.abs(a[..., :n, :] - b[..., :n, :]).max()) < 1e-4


def kept_rows(decoder, ids: list[int], rows: int, **insert) -> list:
    """`rows` sequences after `ids`, seeded 0..rows-1 at T = 1 (drafts accepted and rejected),
    each keeping its caches (`insert`: more arguments of every row), decoded to their end:
    [(prompt + generated, Finished)]."""
    from tinydraft_mlx import SamplingParams

    uids = [decoder.insert(ids, keep_caches=True, sampling=SamplingParams(1.0, seed=seed),
                           **insert) for seed in range(rows)]
    while not all(uid in decoder.finished for uid in uids):
        decoder.step()
    return [(ids + decoder.finished[uid].tokens, decoder.finished[uid]) for uid in uids]


def decoded_compiled_and_eager(target, draft, ids: list[int], k: int, max_tokens: int,
                               monkeypatch) -> tuple[list[int], list[int]]:
    """Greedy tokens of `decode` (k = 0: plain) with the compiled forward, then with it off
    (TINYDRAFT_COMPILE=0, set through `monkeypatch`), asserting that the first run traced (the
    compiled step is what ran) and the second used nothing compiled."""
    from tinydraft_mlx.engine import forward as forward_module
    from tinydraft_mlx.engine.forward import COMPILE_ENV, traces
    from tinydraft_mlx.engine.speculative import decode

    def run():
        return [t.id for t in decode(target, draft if k else None, ids, k=max(k, 1),
                                     max_tokens=max_tokens)]

    forward_module.reset(target)
    compiled = run()
    assert traces(target) > 0
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert traces(target) == 0
    return compiled, run()

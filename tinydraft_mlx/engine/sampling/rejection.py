"""The acceptance rule of speculative decoding, as pure functions: arrays in, arrays out.

Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative Decoding" (ICML 2023),
Algorithm 1; Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling"
(2023). Names follow the paper: p is the target's distribution, q the draft's. Every function takes
a leading batch axis B so the same code serves the decode loop (B = 1) and statistical tests.
"""

from __future__ import annotations

import mlx.core as mx

from .warp import sample_rows


def _pad_vocab(x: mx.array, width: int) -> mx.array:
    """Zero-pad the last axis to `width`: a distribution has no mass beyond its model's logits."""
    extra = width - x.shape[-1]
    if extra <= 0:
        return x
    pad = [(0, 0)] * (x.ndim - 1) + [(0, extra)]
    return mx.pad(x, pad)


def _leading_true(accept: mx.array) -> mx.array:
    """(B, k) bool -> (B,) int32: how many entries are True before the first False."""
    if accept.shape[-1] == 0:
        return mx.zeros(accept.shape[:-1], dtype=mx.int32)
    return mx.cumprod(accept.astype(mx.int32), axis=-1).sum(axis=-1)


def greedy_accept(target_argmax: mx.array, draft_tokens: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy rule: accept d_i while d_i == argmax p_i; emit argmax p_n next.

    Args:
        target_argmax: (B, k+1) argmax of the target logits at each verified position.
        draft_tokens: (B, k) proposed tokens.
    Returns:
        n: (B,) number of accepted draft tokens; token: (B,) the correction (n < k) or bonus token.
    """
    k = draft_tokens.shape[-1]
    n = _leading_true(draft_tokens.astype(mx.int32) == target_argmax[:, :k].astype(mx.int32))
    token = mx.take_along_axis(target_argmax, n[:, None], axis=-1)[:, 0]
    return n, token.astype(mx.int32)


def greedy_accept_ids(target_argmax: list[int], draft_tokens: list[int]) -> tuple[int, int]:
    """`greedy_accept` for one row on the host, as the loop reads it: target_argmax (k+1 ids),
    draft_tokens (k ids) -> (n accepted, the token emitted after them)."""
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def speculative_accept(
    p: mx.array, q: mx.array, draft_tokens: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Stochastic rule: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
    rejection sample from norm(max(0, p_n - q_n)); if all k are accepted sample the bonus from p_k.

    The emitted tokens are then distributed exactly as p (Leviathan et al., Theorem 1). p and q may
    have different widths (the draft's vocabulary can be shorter): q is zero beyond its width and p
    is used unchanged.

    Args:
        p: (B, k+1, Vp) target probabilities at the k draft positions plus the bonus position.
        q: (B, k, Vq) draft probabilities from which `draft_tokens` were sampled.
        draft_tokens: (B, k) int.
        key: an `mx.random.key`.
    Returns:
        n: (B,) accepted count; token: (B,) the token emitted after the accepted ones.
    """
    p, q = _same_width(p, q)
    batch, k = draft_tokens.shape
    accept_key, sample_key = mx.random.split(key)
    u = mx.random.uniform(shape=(batch, k), key=accept_key)
    n = _leading_true(_accepted(p, q, draft_tokens, u))
    row = _emission_row(p, q, n)
    token = sample_rows(row, sample_key)
    return n, token.astype(mx.int32)


def acceptance_probability(p: mx.array, q: mx.array) -> mx.array:
    """(B, V) target and (B, V') draft distributions -> (B,) sum_x min(p(x), q(x)): the
    probability that a token drawn from q is accepted (Leviathan et al., section 3.3: alpha =
    1 - TV(p, q)); a width's missing ids have no mass."""
    p, q = _same_width(p, q)
    return mx.minimum(p, q).sum(axis=-1)


def _same_width(p: mx.array, q: mx.array) -> tuple[mx.array, mx.array]:
    width = max(p.shape[-1], q.shape[-1])
    return _pad_vocab(p, width), _pad_vocab(q, width)


def _accepted(p: mx.array, q: mx.array, draft_tokens: mx.array, u: mx.array) -> mx.array:
    """(B, k) whether each draft passes its test u < p(d) / q(d) (without dividing by q)."""
    d = draft_tokens.astype(mx.int32)[..., None]  # (B, k, 1)
    p_d = mx.take_along_axis(p[:, : d.shape[1]], d, axis=-1)[..., 0]
    q_d = mx.take_along_axis(q, d, axis=-1)[..., 0]
    return u * q_d < p_d


def _emission_row(p: mx.array, q: mx.array, n: mx.array) -> mx.array:
    """(B, V) what each row emits after its n accepted drafts: the residual max(0, p_n - q_n)
    after a rejection, p_k itself for the bonus (q is zero there)."""
    batch, width = p.shape[0], p.shape[-1]
    q_ext = mx.concatenate([q, mx.zeros((batch, 1, width), dtype=q.dtype)], axis=1)
    residual = mx.maximum(p - q_ext, 0.0)
    row = mx.take_along_axis(residual, n[:, None, None], axis=1)[:, 0]
    p_row = mx.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    # an all-zero residual means p_n == q_n, where rejection has probability 0: fall back to p_n
    return mx.where(row.sum(axis=-1, keepdims=True) > 0, row, p_row)


def rejection_steps(p: mx.array, q: mx.array, draft_tokens: mx.array,
                    key: mx.array) -> tuple[mx.array, mx.array]:
    """Every position's own step of the stochastic rule, for a walk that goes on after a
    rejection (candidate trees: the emitted token may be a sibling in the tree): whether d_i
    passes its test (probability min(1, p_i(d_i) / q_i(d_i))), and a draw from the residual
    norm(max(0, p_i - q_i)) (p_i where that is zero: rejection has probability 0 there). Either
    way the token at position i is distributed as p_i (Leviathan et al., Theorem 1).

    Args:
        p: (B, k, Vp) target probabilities at the positions where d_1..d_k were proposed;
        q: (B, k, Vq) the draft's; draft_tokens: (B, k) int; key: an `mx.random.key`.
    Returns:
        accepted: (B, k) bool; residual: (B, k) int32 the draws from the residuals.
    """
    p, q = _same_width(p, q)
    batch, k = draft_tokens.shape
    accept_key, sample_key = mx.random.split(key)
    u = mx.random.uniform(shape=(batch, k), key=accept_key)
    accepted = _accepted(p, q, draft_tokens, u)
    residual = mx.maximum(p - q, 0.0)
    rows = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p)
    return accepted, sample_rows(rows, sample_key).astype(mx.int32)


def speculative_accept_rows(
    p: mx.array, q: mx.array, draft_tokens: mx.array, lengths: list[int], key: mx.array,
) -> tuple[mx.array, mx.array]:
    """`speculative_accept` for B rows that drafted different numbers of tokens: row b drafted
    lengths[b] tokens (its p rows beyond lengths[b] + 1 and q, draft rows beyond lengths[b] are
    padding). The rows' draws are made together from one key (independent draws all the same:
    each row is distributed exactly as p).

    Args:
        p: (B, L, Vp) target probabilities, L = max(lengths) + 1; q: (B, L - 1, Vq);
        draft_tokens: (B, L - 1) int; lengths: B ints in [1, L - 1]; key: an `mx.random.key`.
    Returns:
        n: (B,) accepted counts; token: (B,) the token emitted after the accepted ones.
    """
    p, q = _same_width(p, q)
    batch, k = draft_tokens.shape
    accept_key, sample_key = mx.random.split(key)
    u = mx.random.uniform(shape=(batch, k), key=accept_key)
    drafted = mx.arange(k)[None] < mx.array(lengths)[:, None]
    n = _leading_true(_accepted(p, q, draft_tokens, u) & drafted)
    # q beyond a row's drafts is zero (padding), so its bonus row's residual is p itself
    row = _emission_row(p, q * drafted[..., None], n)
    return n, sample_rows(row, sample_key).astype(mx.int32)

"""The acceptance rule on hand-built distributions, checked statistically.

Bound: each empirical frequency is the mean of N = 200,000 Bernoulli(p_j) draws, so its standard
deviation is at most sqrt(0.25 / N) = 1.12e-3. TOL = 5e-3 is 4.47 standard deviations: a single
entry exceeds it with probability < 8e-6, and the whole file checks fewer than 150 entries, so a
correct implementation fails with probability < 1.2e-3 (and the seeds are fixed, so a run is
repeatable). A classic bug (resampling from p instead of the residual max(0, p - q)) is shown below
to exceed the same bound by far, so the bound has power.
"""

import mlx.core as mx
import numpy as np
import pytest

from tinydraft_mlx import SamplingParams, warp
from tinydraft_mlx.engine.sampling.rejection import greedy_accept, speculative_accept

N = 200_000
TOL = 5e-3
V = 8

P_LOGITS = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 0.7, -2.0])
Q_LOGITS = np.array([-1.0, 0.0, 2.5, 1.5, 0.3, 2.0, -1.5, 0.5])  # badly mismatched


def _dist(logits, **kw):
    probs = np.array(warp(mx.array(logits, dtype=mx.float32), SamplingParams(**kw)), np.float64)
    return probs / probs.sum()  # float32 -> float64 rounding, so NumPy's sampler accepts it


def _run(p_rows, q_rows, seed=0):
    """Draw d_i ~ q_i for N independent rounds and apply the rule. Returns (n, token, drafts)."""
    rng = np.random.default_rng(seed)
    k = len(q_rows)
    drafts = np.stack([rng.choice(V, size=N, p=q) for q in q_rows], axis=1)
    p = mx.array(np.broadcast_to(np.stack(p_rows), (N, k + 1, V)).astype(np.float32))
    q = mx.array(np.broadcast_to(np.stack(q_rows), (N, k, V)).astype(np.float32))
    n, token = speculative_accept(p, q, mx.array(drafts), mx.random.key(seed + 1))
    return np.array(n), np.array(token), drafts


def _first_emitted(n, token, drafts):
    return np.where(n >= 1, drafts[:, 0], token)


def _freq(tokens):
    return np.bincount(tokens, minlength=V) / len(tokens)


CASES = {
    "temperature": (dict(temperature=0.7), dict(temperature=0.7)),
    "top_k": (dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_k=3)),
    "top_p": (dict(temperature=1.0, top_p=0.7), dict(temperature=1.0, top_p=0.7)),
    "min_p": (dict(temperature=1.0, min_p=0.25), dict(temperature=1.0, min_p=0.25)),
    # the draft keeps only 2 tokens: zero mass where the target has mass
    "draft_zero_mass": (dict(temperature=1.0), dict(temperature=1.0, top_k=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_output_is_the_warped_target_distribution(case):
    p_kw, q_kw = CASES[case]
    p, q = _dist(P_LOGITS, **p_kw), _dist(Q_LOGITS, **q_kw)
    assert 0.05 < np.minimum(p, q).sum() < 0.9  # really mismatched, yet overlapping
    n, token, drafts = _run([p, p], [q])
    assert np.abs(_freq(_first_emitted(n, token, drafts)) - p).max() < TOL
    assert abs((n == 1).mean() - np.minimum(p, q).sum()) < TOL


def test_identical_draft_is_always_accepted():
    p = _dist(P_LOGITS, temperature=1.0)
    n, token, drafts = _run([p, p, p], [p, p])
    assert (n == 2).all()
    assert np.abs(_freq(drafts[:, 0]) - p).max() < TOL
    assert np.abs(_freq(token) - p).max() < TOL  # the bonus token comes from p_k


def test_disjoint_supports_never_accept_and_resample_from_target():
    p = np.array([0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0])
    q = np.array([0, 0, 0, 0, 0.25, 0.25, 0.25, 0.25])
    n, token, _ = _run([p, p], [q])
    assert (n == 0).all()
    assert np.abs(_freq(token) - p).max() < TOL


def test_three_positions_accept_counts_and_first_token():
    """With context-free rows, P(n = j) = a_1 ... a_j (1 - a_(j+1)), a_i = sum(min(p_i, q_i))."""
    rows_p = [_dist(P_LOGITS, temperature=t) for t in (0.6, 1.0, 1.6, 1.0)]
    rows_q = [_dist(Q_LOGITS, temperature=t) for t in (1.0, 0.8, 1.2)]
    a = [np.minimum(p, q).sum() for p, q in zip(rows_p, rows_q)]
    n, token, drafts = _run(rows_p, rows_q, seed=5)
    for j in range(4):
        expected = np.prod(a[:j]) * (1 - a[j] if j < 3 else 1)
        assert abs((n == j).mean() - expected) < TOL
    assert np.abs(_freq(_first_emitted(n, token, drafts)) - rows_p[0]).max() < TOL


def test_wider_target_than_draft():
    """The draft's logits may be narrower: q is zero beyond its width, p is used as it is."""
    p = _dist(np.append(P_LOGITS[:6], [1.8, 0.9]), temperature=1.0)  # 8 wide
    q6 = _dist(Q_LOGITS[:6], temperature=1.0)  # 6 wide
    rng = np.random.default_rng(3)
    d = rng.choice(6, size=(N, 1), p=q6)
    pm = mx.array(np.broadcast_to(p, (N, 2, V)).astype(np.float32))
    qm = mx.array(np.broadcast_to(q6, (N, 1, 6)).astype(np.float32))
    n, token = (np.array(x) for x in speculative_accept(pm, qm, mx.array(d), mx.random.key(4)))
    assert np.abs(_freq(np.where(n == 1, d[:, 0], token)) - p).max() < TOL
    assert (_freq(token)[6:] > 0).all()  # tokens beyond the draft's width are produced


def test_bound_detects_resampling_from_p_instead_of_residual():
    p, q = _dist(P_LOGITS, temperature=0.7), _dist(Q_LOGITS, temperature=0.7)
    rng = np.random.default_rng(9)
    d = rng.choice(V, size=N, p=q)
    accepted = rng.random(N) * q[d] < p[d]
    wrong = np.where(accepted, d, rng.choice(V, size=N, p=p))
    assert np.abs(_freq(wrong) - p).max() > 5 * TOL


def test_greedy_rule():
    argmax = mx.array([[3, 1, 4, 1], [3, 1, 4, 1], [3, 1, 4, 1]])
    drafts = mx.array([[3, 1, 4], [3, 2, 4], [0, 1, 4]])
    n, token = greedy_accept(argmax, drafts)
    assert n.tolist() == [3, 1, 0]
    assert token.tolist() == [1, 1, 3]  # bonus, correction at 1, correction at 0

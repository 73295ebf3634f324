"""The warp against an independent NumPy reference, and SamplingParams' range checks."""

import math

import mlx.core as mx
import numpy as np
import pytest

from tests.reference import chi2_threshold, warp_np
from tinydraft_mlx import ParameterError, SamplingParams, warp

SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=0.8, min_p=0.2),
    dict(temperature=0.9, top_k=12, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("setting", SETTINGS)
def test_warp_matches_reference(setting):
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(4, 50)).astype(np.float32)
    ours = np.array(warp(mx.array(logits), SamplingParams(**setting)))
    for row, got in zip(logits, ours):
        expected = warp_np(row, **setting)
        np.testing.assert_allclose(got, expected, atol=1e-6)
        assert math.isclose(got.sum(), 1.0, abs_tol=1e-5)
        assert np.array_equal(got > 0, expected > 0)  # identical support


def test_filters_remove_mass():
    """Guard against a reference that silently does nothing: each filter drops tokens here."""
    logits = np.linspace(3, -3, 20)
    assert (warp_np(logits, top_k=4) > 0).sum() == 4
    assert (warp_np(logits, top_p=0.5) > 0).sum() < 20
    assert (warp_np(logits, min_p=0.3) > 0).sum() < 20


def test_greedy_has_no_warp():
    with pytest.raises(ValueError, match="temperature"):
        warp(mx.zeros((3,)), SamplingParams(temperature=0.0))


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("temperature", -0.1, "0 (greedy) or in [1e-06, 1e+06]"),
        ("temperature", float("inf"), "0 (greedy) or in [1e-06, 1e+06]"),
        ("temperature", 1e-38, "0 (greedy) or in [1e-06, 1e+06]"),
        ("top_p", 0.0, "in (0, 1]"),
        ("top_p", 1.5, "in (0, 1]"),
        ("top_k", -1, "integer >= 0"),
        ("top_k", 2.5, "integer >= 0"),
        ("min_p", 1.0, "in [0, 1)"),
        ("min_p", -0.2, "in [0, 1)"),
        ("seed", -1, "integer in [0,"),
        ("temperature", "hot", "0 (greedy) or in [1e-06, 1e+06]"),
    ],
)
def test_out_of_range_names_parameter_range_and_value(field, value, allowed):
    with pytest.raises(ParameterError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert message.startswith(field) and allowed in message and repr(value) in message


def test_sampling_order_differs_from_mlx_lm_as_documented():
    """The guide's example (docs/guide.md): ours warps temperature -> top-k -> top-p -> min-p;
    mlx-lm filters at temperature 1, then divides by the temperature. Logits [2, 1, 0], T = 0.5,
    top_p = 0.7: ours keeps token 0 only (0.87 of the mass at T = 0.5); mlx-lm keeps 0 and 1 and
    gives token 1 probability 0.12. And top-k = 1 with a tie: both keep exactly one of the tied
    tokens."""
    from mlx_lm.sample_utils import apply_top_k, apply_top_p

    logits = mx.array([2.0, 1.0, 0.0])
    ours = np.array(warp(logits, SamplingParams(temperature=0.5, top_p=0.7)))
    np.testing.assert_allclose(ours, [1.0, 0.0, 0.0], atol=1e-7)
    kept = apply_top_p(logits - mx.logsumexp(logits), 0.7)
    theirs = np.array(mx.softmax(kept / 0.5))
    np.testing.assert_allclose(theirs, [np.exp(4) / (np.exp(4) + np.exp(2)),
                                        np.exp(2) / (np.exp(4) + np.exp(2)), 0.0], atol=1e-6)
    assert round(float(theirs[1]), 2) == 0.12

    tied = mx.array([1.0, 1.0, 0.0])
    ours = np.array(warp(tied, SamplingParams(temperature=1.0, top_k=1)))
    assert sorted(ours.tolist()) == [0.0, 0.0, 1.0] and ours[2] == 0.0
    theirs = np.array(apply_top_k(tied - mx.logsumexp(tied), 1))
    assert np.isfinite(theirs).sum() == 1


@pytest.mark.parametrize("setting", SETTINGS)
def test_fused_draws_and_acceptance_equal_the_separate_ops(setting):
    """A sampled round runs the warp fused with what follows it in one compiled graph
    (`draw`, `with_warp(speculative_accept, ...)`); the batched loop runs them as separate ops.
    Both must give the same tokens for the same keys (a seeded row of a batch is the
    generation alone: test_batch), so the fused graphs are checked draw for draw here."""
    from tinydraft_mlx.engine.sampling import draw, sample_rows, with_warp
    from tinydraft_mlx.engine.sampling.rejection import speculative_accept

    params = SamplingParams(**setting)
    rng = np.random.default_rng(1)
    row = mx.array(rng.normal(scale=2.0, size=(1, 50)).astype(np.float32))
    rows = mx.array(rng.normal(scale=2.0, size=(1, 4, 50)).astype(np.float32))
    q = warp(mx.array(rng.normal(scale=2.0, size=(1, 3, 50)).astype(np.float32)), params)
    drafts = mx.array([[int(np.argmax(np.array(q[0, i]))) for i in range(3)]], dtype=mx.int32)
    fused_accept = with_warp(speculative_accept, params)
    tokens, outcomes = set(), set()
    for seed in range(200):
        key = mx.random.key(seed)
        probs, token = draw(row, params, key)
        np.testing.assert_array_equal(np.array(probs), np.array(warp(row, params)))
        assert token.item() == sample_rows(warp(row, params), key).item()
        n, emitted = fused_accept(rows, q, drafts, key)
        n_ref, emitted_ref = speculative_accept(warp(rows, params), q, drafts, key)
        assert (n.item(), emitted.item()) == (n_ref.item(), emitted_ref.item())
        tokens.add(token.item())
        outcomes.add((n.item(), emitted.item()))
    assert len(tokens) > 1 and len(outcomes) > 2  # the draws vary: the comparison has teeth


def test_seeded_noise_is_standard_gumbel_and_independent_across_positions():
    """engine/sampling/seeded.py's (seed, position, token) noise against the Gumbel law written
    out here: Kolmogorov-Smirnov distance of 200k variates to F(g) = exp(-exp(-g)) below the
    1e-6 level (1.92 / sqrt(n) is the 0.2% level; 2.6 / sqrt(n) is beyond 1e-5), neighbouring
    positions and neighbouring seeds uncorrelated (|r| < 5 / sqrt(n)), and a position's noise
    the same however it is asked for."""
    from tinydraft_mlx.engine.sampling import seeded

    g = np.array(seeded.noise(2**40 + 3, 100, 200, 1000), dtype=np.float64)  # (200, 1000)
    flat = np.sort(g.ravel())
    n = flat.size
    cdf = np.exp(-np.exp(-flat))
    ks = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    assert ks < 2.6 / np.sqrt(n), ks
    pairs = [(g[:-1].ravel(), g[1:].ravel()),  # positions t and t + 1
             (g.ravel(), np.array(seeded.noise(2**40 + 4, 100, 200, 1000)).ravel()),  # seeds
             (g[:, :-1].ravel(), g[:, 1:].ravel())]  # neighbouring token ids
    for a, b in pairs:
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(a.size)
    again = np.array(seeded.noise(2**40 + 3, 150, 1, 2000))[0, :1000]
    assert np.array_equal(again, g[50])


def test_seeded_pick_draws_from_p():
    """Gumbel-max picks over 40k positions follow p (chi-square against p written here), and a
    zero-probability token is never picked."""
    from tinydraft_mlx.engine.sampling import seeded

    p = np.array([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    n = 40_000
    probs = mx.broadcast_to(mx.array(p, dtype=mx.float32)[None], (n, len(p)))
    picks = np.array(seeded.choose(probs, 5, 0))
    counts = np.bincount(picks, minlength=len(p))
    assert counts[-1] == 0
    stat = ((counts[:-1] - n * p[:-1]) ** 2 / (n * p[:-1])).sum()
    assert stat < chi2_threshold(len(p) - 2), (stat, counts)  # 4 degrees of freedom


def test_seeded_noise_reaches_the_gumbel_tails_a_small_probability_needs():
    """A token whose probability is e^-30 of the top one's wins a Gumbel-max draw only where
    its noise beats the top's by 30: the noise's extremes (the smallest and largest hashes) must
    span more than that. Checked against the Gumbel quantile -log(-log(1 - w)) in float64 at w
    from the same 48 bits (hand-picked and random hashes), to float32 rounding."""
    from tinydraft_mlx.engine.sampling import seeded

    rng = np.random.default_rng(0)
    high = np.concatenate([[0, 0, 255, 2**32 - 1, 2**32 - 1], rng.integers(0, 2**32, 2000)])
    low = np.concatenate([[0, 2**32 - 1, 0, 0, 2**32 - 1], rng.integers(0, 2**32, 2000)])
    got = np.array(seeded.gumbel_of(mx.array(high, dtype=mx.uint32),
                                    mx.array(low, dtype=mx.uint32)), dtype=np.float64)
    w = ((high >> 8) + ((low >> 8) + 0.5) / 2**24) / 2**24
    expected = -np.log(-np.log1p(-np.minimum(w, 1 - 2.0**-24)))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert got.max() > 33.0 and got.min() < -2.8 and got.max() - got.min() > 36.0


def test_a_draw_never_lands_on_a_zero_mass_token():
    """Inverting the cumulative distribution where u x total reaches the total (u = 1: what a
    kernel that rounds the product up gives; MLX's uniforms stop at 1 - 2^-24, whose float32
    product with a total stays below it), a draw that counted the entries at or below u x total
    would pick the trailing zero-mass token: the last token with mass is drawn instead, and u = 0
    draws the first token with mass."""
    from tinydraft_mlx.engine.sampling import invert_cdf

    probs = mx.array([[1.0, 2.0, 0.0, 0.0], [0.0, 1.0, 0.0, 2.0], [0.0, 0.5, 0.5, 0.0]])
    assert invert_cdf(probs, mx.ones((3, 1))).tolist() == [1, 3, 2]
    assert invert_cdf(probs, mx.zeros((3, 1))).tolist() == [0, 1, 1]
    top = mx.full((3, 1), 1 - 2.0**-24)
    assert invert_cdf(probs, top).tolist() == [1, 3, 2]

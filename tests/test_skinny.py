"""The CPU skinny-matmul path: same products as `x @ W.T`, only for few rows and large weights, and
reversible; with it forced on for every projection the engine still matches the oracle.
CPU-only: `skinny.enable` leaves models alone on a GPU, where Metal/CUDA handle few rows well."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tinydraft_mlx import generate
from tinydraft_mlx.engine import skinny
from tinydraft_mlx.engine.forward import COMPILE_ENV

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("cpu_fp32")]


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 64, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_plain(rows, bias):
    layer = nn.Linear(2048, 2049, bias=bias)  # 4.2M weights: above MIN_WEIGHT
    x = mx.random.normal((1, rows, 2048), key=mx.random.key(rows))
    expected = np.array(layer(x))
    assert skinny.enable(layer) == 1
    assert type(layer) is skinny.SkinnyLinear
    got = layer(x)
    assert got.shape == (1, rows, 2049)
    np.testing.assert_allclose(np.array(got), expected, rtol=1e-5, atol=1e-4)
    skinny.disable(layer)
    assert type(layer) is nn.Linear


def test_which_calls_take_the_fast_path():
    big = mx.zeros((2048, 2048))
    small = mx.zeros((64, 64))
    assert skinny._skinny(big, mx.zeros((1, 5, 2048))) is not None
    assert skinny._skinny(big, mx.zeros((1, 4, 2048))) is not None
    assert skinny._skinny(big, mx.zeros((1, 1, 2048))) is None  # one row: the plain gemv
    assert skinny._skinny(big, mx.zeros((1, 3, 2048))) is None  # 2-3 rows: MKL's is faster
    assert skinny._skinny(big, mx.zeros((1, 65, 2048))) is None  # prefill-sized
    assert skinny._skinny(small, mx.zeros((1, 5, 64))) is None  # small weight


def test_tied_head_equals_plain():
    emb = nn.Embedding(4096, 1024)
    x = mx.random.normal((1, 3, 1024), key=mx.random.key(0))
    expected = np.array(emb.as_linear(x))
    assert skinny.enable(emb) == 1 and type(emb) is skinny.SkinnyEmbedding
    np.testing.assert_allclose(np.array(emb.as_linear(x)), expected, rtol=1e-5, atol=1e-4)


def test_enable_is_idempotent_and_disable_restores(pair):
    """load_models swapped every Linear/Embedding of the fixture (7 per layer, the embedding and
    the untied head) on the CPU; enable again changes nothing, disable restores mlx's modules."""
    target, _, _ = pair
    swappable = 7 * len(target.model.layers) + 2
    kinds = [type(m) for _, m in target.named_modules()]
    assert kinds.count(skinny.SkinnyLinear) + kinds.count(skinny.SkinnyEmbedding) == swappable
    assert skinny.enable(target) == swappable
    skinny.disable(target)
    assert not any(type(m).__name__.startswith("Skinny") for _, m in target.named_modules())
    skinny.enable(target)


def test_forced_on_every_projection_still_matches_oracle(pair, oracle, monkeypatch):
    """The fixture's weights are below MIN_WEIGHT; lower it so every verify pass uses the path
    (counted: the run must really take it). Eager forwards: a compiled step traced earlier
    would replay the kernels it recorded without calling back into Python."""
    monkeypatch.setenv(COMPILE_ENV, "0")
    monkeypatch.setattr(skinny, "MIN_WEIGHT", 0)
    taken = []
    real = skinny._skinny

    def counting(weight, x):
        y = real(weight, x)
        taken.append(y is not None)
        return y

    monkeypatch.setattr(skinny, "_skinny", counting)
    target, draft, tok = pair
    ids = tok.encode("def parse_args(self, args=None, namespace=None):")
    ref, margin = oracle.greedy(ids, 32)
    assert margin > 1e-3 and len(set(ref)) >= 8
    out, stats = generate(target, draft, tok, ids, k=4, max_tokens=32)
    assert out == ref and stats.accepted > 0
    assert sum(taken) >= 7 * len(target.model.layers) * stats.rounds // 2, sum(taken)

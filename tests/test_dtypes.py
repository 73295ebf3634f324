"""Quantized (4-bit, 8-bit) and half-precision (float16, bfloat16) pairs: greedy speculative output
equals plain greedy output for k in 1..8, and sampling runs. These run on the run's default
device (the GPU on a Mac), where such checkpoints are the normal case.

Greedy identity holds up to the float difference between a one-row and a (k+1)-row forward pass.
On MLX's CPU backend that difference is 0 for these dtypes (measured: every row is computed
alike), so the outputs must be identical. On a GPU the kernels for 1 and k+1 rows may round
differently, and half-precision logits have exact ties (bf16 keeps 8 bits of mantissa): there a
divergence is allowed only at a near-tie of the plain path (top-2 gap below NEAR_TIE for the
dtype), the comparison ends there, and at least 3/4 of all tokens must have been compared.
A divergence at a clear margin fails.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import convert

from tinydraft_mlx import generate, load_models

CANDIDATES = [
    "def parse_args(self, args=None, namespace=None):",
    "import os\nimport sys\n\nclass Encoder(object):",
    "    for line in text.splitlines():\n        if",
    "# Copyright 2001 by the Python Software Foundation",
    "    def format_help(self):\n        formatter = self._get_formatter()",
    "class HelpFormatter(object):\n    def __init__(self, prog, indent_increment=2,",
]
NEW_TOKENS = 32
# a few units of the logits' rounding at their scale here (|logit| < 16): bf16 0.0625, fp16
# 0.0078; quantized weights with float32 activations round like float32 between kernels
NEAR_TIE = {"q4": 1e-3, "q8": 1e-3, "float16": 0.05, "bfloat16": 0.25}


@pytest.fixture(scope="module")
def variants(checkpoints, tmp_path_factory):
    """name -> (target, draft, tokenizer): 4- and 8-bit checkpoints made with mlx_lm.convert,
    and the float32 fixture loaded as float16 and bfloat16."""
    root = tmp_path_factory.mktemp("dtypes")
    out = {}
    for bits in (4, 8):
        paths = []
        for name in ("target", "draft"):
            path = root / f"{name}-q{bits}"
            convert(str(checkpoints[name]), str(path), quantize=True, q_bits=bits,
                    q_group_size=64)
            paths.append(str(path))
        out[f"q{bits}"] = load_models(*paths)
    for dtype in ("float16", "bfloat16"):
        out[dtype] = load_models(str(checkpoints["target"]), str(checkpoints["draft"]),
                                 dtype=dtype)
    return out


def _margins(target, ids: list[int], continuation: list[int]) -> np.ndarray:
    """Top-1/top-2 logit gap at each generated position of the plain path (one uncached pass)."""
    seq = ids + continuation
    logits = np.array(target(mx.array([seq]))[0].astype(mx.float32))
    top2 = np.sort(logits[len(ids) - 1 : len(seq) - 1], axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def _compared(plain: list[int], out: list[int], margins: np.ndarray, near_tie: float) -> int:
    """How many tokens agree before the first divergence (all, if none); a divergence where the
    plain path's margin is clear fails the test."""
    for i, (a, b) in enumerate(zip(plain, out)):
        if a != b:
            assert margins[i] < near_tie, f"diverged at {i} with a clear margin {margins[i]:.3g}"
            return i
    assert len(out) == len(plain)
    return len(plain)


def test_weights_are_what_the_name_says(variants):
    for bits in (4, 8):
        target, draft, _ = variants[f"q{bits}"]
        for model in (target, draft):
            layer = model.model.layers[0].mlp.up_proj
            assert isinstance(layer, nn.QuantizedLinear) and layer.bits == bits
    for dtype in ("float16", "bfloat16"):
        target, draft, _ = variants[dtype]
        assert target.model.layers[0].mlp.up_proj.weight.dtype == getattr(mx, dtype)
        assert draft.model.norm.weight.dtype == getattr(mx, dtype)


@pytest.mark.parametrize("name", ["q4", "q8", "float16", "bfloat16"])
def test_greedy_speculative_equals_plain(variants, name):
    target, draft, tok = variants[name]
    compared = total = accepted = 0
    for text in CANDIDATES:
        ids = tok.encode(text)
        plain, _ = generate(target, None, tok, ids, max_tokens=NEW_TOKENS)
        assert len(set(plain)) >= 8, f"degenerate plain path for {text!r} in {name}"
        margins = _margins(target, ids, plain)
        for k in (1, 2, 4, 8):
            out, stats = generate(target, draft, tok, ids, k=k, max_tokens=NEW_TOKENS)
            if mx.default_device() == mx.cpu:
                assert out == plain, (text, k)  # identical rounding for 1 and k+1 rows here
            compared += _compared(plain, out, margins, NEAR_TIE[name])
            total += len(plain)
            accepted += stats.accepted
    assert compared >= 0.75 * total, (compared, total)
    assert accepted > 0


@pytest.mark.parametrize("name", ["q4", "q8", "float16", "bfloat16"])
def test_sampling_runs(variants, name):
    target, draft, tok = variants[name]
    runs = [generate(target, draft, tok, CANDIDATES[0], k=3, max_tokens=24, temperature=1.0,
                     top_p=0.9, seed=seed) for seed in (1, 1, 2)]
    (a, stats), (b, _), (c, _) = runs
    assert len(a) == 24 and stats.finish_reason == "length" and stats.drafted > 0
    assert a == b and a != c  # seeded: reproducible, and seeds differ
    # every sampled token lies in the target's top-p 0.9 nucleus at its position (numpy on one
    # uncached pass; a margin of 0.05 of mass for the dtype's rounding between passes)
    ids = tok.encode(CANDIDATES[0])
    for out in (a, c):
        seq = ids + out
        logits = np.array(target(mx.array([seq]))[0].astype(mx.float32))[len(ids) - 1 : -1]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        for row, token in zip(probs, out):
            before = row[row > row[token]].sum()  # mass ranked strictly above the token
            assert before < 0.9 + 0.05, (name, token, before)

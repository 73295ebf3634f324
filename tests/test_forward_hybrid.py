"""The compiled forward on hybrid models (`tinydraft_mlx.engine.forward`, `_StateSlot`): the
recurrent layers' window and state are inputs and outputs of the step, and so is what their
tape records, so that a rollback after a compiled verify replays as after an eager one.

Against the eager forward on tiny checkpoints of every hybrid family (tests/fixtures.py):
random forwards of 1, 2 and 5 positions with random rollbacks: every logit row to float32
rounding, the same argmax, the compiled step is what ran, and at the end every layer's
keys/values, convolution window and recurrence state; and the decode loop emits the same
tokens compiled or eager (plain and speculative). The oracle tests of hybrids (test_hybrid,
test_mtp, test_tree_hybrid) run the default path, i.e. compiled."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from tests.fixtures import HYBRIDS, build_hybrid_pair
from tests.reference import decoded_compiled_and_eager, prefilled_rows
from tinydraft_mlx import load_models
from tinydraft_mlx.engine.cache import make_cache, rollback
from tinydraft_mlx.engine.cache.recurrent import RecurrentCache
from tinydraft_mlx.engine.forward import forward, traces
from tinydraft_mlx.engine.speculative import prefill

pytestmark = pytest.mark.usefixtures("cpu_fp32")


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """family -> (target, draft, tokenizer), float32."""
    root = tmp_path_factory.mktemp("forward_hybrid")
    out = {}
    for family in HYBRIDS:
        target_dir, draft_dir = build_hybrid_pair(root, family)
        out[family] = load_models(str(target_dir), str(draft_dir), dtype="float32")
    return out


def _layers(cache) -> list[np.ndarray]:
    out = []
    for layer in cache:
        if isinstance(layer, RecurrentCache):
            out += [np.array(layer.cache[0]), np.array(layer.cache[1])]
        else:
            n = layer.offset
            out += [np.array(layer.keys[..., :n, :]), np.array(layer.values[..., :n, :])]
    return out


@pytest.mark.parametrize("family", HYBRIDS)
def test_compiled_matches_eager_through_rollbacks(hybrids, family):
    """80 random forwards of 1, 2 or 5 positions after a 30-token prompt, each followed half the
    time by a rollback of some of its positions (the tape's replay) on both caches."""
    target, _, tok = hybrids[family]
    rng = random.Random(0)
    vocab = 200
    prompt = [rng.randrange(vocab) for _ in range(30)]
    ours, eager = make_cache(target, margin=6), make_cache(target, margin=6)
    prefill(target, ours, prompt)
    prefill(target, eager, prompt)
    assert any(isinstance(layer, RecurrentCache) for layer in ours)
    before, worst, rolled = traces(target), 0.0, 0
    for _ in range(80):
        n = rng.choice([1, 2, 5])
        tokens = mx.array([[rng.randrange(vocab) for _ in range(n)]], dtype=mx.int32)
        got, want = forward(target, tokens, ours), target(tokens, cache=eager)
        worst = max(worst, mx.abs(got - want).max().item())
        assert (mx.argmax(got, -1) == mx.argmax(want, -1)).all().item()
        drop = rng.randrange(n + 1) if rng.random() < 0.5 else 0
        rolled += drop > 0
        keep = ours[0].offset - drop
        rollback(ours, keep)
        rollback(eager, keep)
    assert traces(target) > before  # the compiled step ran (not a silent eager fallback)
    assert worst < 1e-4 and rolled > 10
    assert ours[0].offset == eager[0].offset
    for a, b in zip(_layers(ours), _layers(eager), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_decode_gives_the_same_tokens_compiled_or_eager(hybrids, monkeypatch, family, k):
    target, draft, tok = hybrids[family]
    ids = tok.encode("def parse_args(self, args=None, namespace=None):")

    compiled, eager = decoded_compiled_and_eager(target, draft, ids, k, 48, monkeypatch)
    assert compiled == eager and len(set(compiled)) > 5


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "mamba2"])
def test_a_batchs_compiled_forward_matches_eager_through_rollbacks(hybrids, family):
    """Three rows of different lengths in a BatchCache: 40 forwards of 1 or 2 positions per row
    (`forward_batch`, compiled) against the eager forward on a second BatchCache, each followed
    half the time by a rollback of each row by its own amount; logits to float32 rounding, and
    at the end every row's windows, states and keys/values."""
    from tinydraft_mlx.engine.forward import forward_batch

    target, _, _ = hybrids[family]
    rng = random.Random(1)
    prompts = [[rng.randrange(200) for _ in range(n)] for n in (12, 20, 7)]
    ours, eager = (prefilled_rows(target, prompts, margin=4) for _ in range(2))
    before, worst = traces(target), 0.0
    for _ in range(40):
        n = rng.choice([1, 2])
        tokens = mx.array([[rng.randrange(200) for _ in range(n)] for _ in prompts],
                          dtype=mx.int32)
        got = forward_batch(target, tokens, ours)
        eager.reserve(n)
        want = target(tokens, cache=eager.layers)
        eager.advance(n)
        worst = max(worst, mx.abs(got - want).max().item())
        if rng.random() < 0.5:
            keep = [length - rng.randrange(n + 1) for length in ours.lengths]
            ours.rollback(keep)
            eager.rollback(keep)
    assert traces(target) > before and worst < 1e-4
    for b in range(len(prompts)):
        for a, c in zip(_layers(ours.extract(b)), _layers(eager.extract(b)), strict=True):
            np.testing.assert_allclose(a, c, atol=1e-4)

"""The compiled forward (`tinydraft_mlx.engine.forward`): same logits and caches as the eager
forward through rollbacks and buffer growth (and around a bounded cache's ring), the same tokens
from the decode loop either way, and the eager fallback wherever the compiled step does not
apply.

The oracle tests (test_lossless, test_sampling_exactness) run the default path, i.e. compiled;
here `traces` shows that the compiled step is what ran."""

import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.reference import decoded_compiled_and_eager
from tests.scripted import scripted
from tinydraft_mlx.engine import forward as forward_module
from tinydraft_mlx.engine import skinny
from tinydraft_mlx.engine.cache import make_cache, rollback
from tinydraft_mlx.engine.forward import COMPILE_ENV, buffer_size, forward, trace_count, traces
from tinydraft_mlx.engine.speculative import decode, prefill

PROMPT = "def parse_args(self, args=None, namespace=None):"


def test_buffer_sizes():
    assert [buffer_size(n) for n in (1, 256, 257, 600, 4096, 4097, 9000)] == [
        256, 256, 512, 1024, 4096, 8192, 12288]


def _random_steps(target, ours, eager, rng, vocab, steps, sizes) -> float:
    """`steps` forwards of random tokens (a length from `sizes` each), compiled on `ours` and
    eager on `eager`, each followed half the time by a rollback of some of its tokens on both;
    every row's argmax equal. Returns the largest logit difference."""
    worst = 0.0
    for _ in range(steps):
        n = rng.choice(sizes)
        tokens = mx.array([[rng.randrange(vocab) for _ in range(n)]], dtype=mx.int32)
        got, want = forward(target, tokens, ours), target(tokens, cache=eager)
        worst = max(worst, mx.abs(got - want).max().item())
        assert (mx.argmax(got, -1) == mx.argmax(want, -1)).all().item()
        drop = rng.randrange(n + 1) if rng.random() < 0.5 else 0
        keep = ours[0].offset - drop
        rollback(ours, keep)
        rollback(eager, keep)
    return worst


def test_compiled_matches_eager_through_rollbacks_and_growth(pair):
    """200 random steps of 1, 2 or 5 tokens with random rollbacks, from 240 cached tokens to
    past two buffer sizes (256, 512): every logit row equal to the eager forward's within float
    rounding, the same argmax, and the caches equal at the end."""
    target, _, tok = pair
    rng = random.Random(0)
    vocab = len(tok.get_vocab())
    prompt = [rng.randrange(vocab) for _ in range(240)]
    ours, eager = make_cache(target), make_cache(target)
    prefill(target, ours, prompt)
    prefill(target, eager, prompt)
    before = traces(target)
    worst = _random_steps(target, ours, eager, rng, vocab, 200, [1, 2, 5])
    assert traces(target) > before  # the compiled step ran (not a silent eager fallback)
    assert ours[0].offset == eager[0].offset > 512
    assert ours[0].keys.shape[2] == buffer_size(ours[0].offset) == 1024
    assert worst < 1e-4
    end = ours[0].offset
    for a, b in zip(ours, eager):
        for x, y in [(a.keys, b.keys), (a.values, b.values)]:
            np.testing.assert_allclose(np.array(x[..., :end, :]), np.array(y[..., :end, :]),
                                       atol=1e-4)


def test_trace_count_counts_each_shapes_first_trace(pair):
    """`trace_count` (what the decode loops read around a round to leave a traced round out of
    k="auto"'s costs): up by one for each shape a model's compiled step runs for the first
    time, unchanged when a traced shape runs again."""
    target, _, tok = pair
    forward_module.reset(target)
    cache = make_cache(target)
    prefill(target, cache, tok.encode(PROMPT))
    start = trace_count()
    forward(target, mx.array([[5]], dtype=mx.int32), cache)
    forward(target, mx.array([[6, 7]], dtype=mx.int32), cache)
    assert trace_count() == start + 2 and traces(target) == 2
    forward(target, mx.array([[8]], dtype=mx.int32), cache)
    forward(target, mx.array([[9, 10]], dtype=mx.int32), cache)
    assert trace_count() == start + 2


@pytest.mark.parametrize("window,margin", [(64, 5), (48, 1)])
def test_bounded_compiled_matches_eager_through_wraps_and_rollbacks(pair, window, margin):
    """A bounded cache (`max_kv_size`, rollback margin): 150 random steps of 1, 2 or margin + 1
    tokens (what decode steps and verifies write in place) with random rollbacks, from 40 cached
    tokens to several times around the ring: every logit row equal to the eager forward's within
    float rounding, the same argmax, the compiled step is what ran, and the buffers equal at the
    end (the same positions in the same slots)."""
    target, _, tok = pair
    rng = random.Random(1)
    vocab = len(tok.get_vocab())
    prompt = [rng.randrange(vocab) for _ in range(40)]
    ours = make_cache(target, max_kv_size=window, margin=margin)
    eager = make_cache(target, max_kv_size=window, margin=margin)
    prefill(target, ours, prompt)
    prefill(target, eager, prompt)
    before = traces(target)
    worst = _random_steps(target, ours, eager, rng, vocab, 150, [1, 2, margin + 1])
    assert traces(target) > before  # the compiled step ran (not a silent eager fallback)
    assert ours[0].offset == eager[0].offset > 3 * window
    assert worst < 1e-4
    for a, b in zip(ours, eager):
        for x, y in [(a.keys, b.keys), (a.values, b.values)]:
            np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-4)


@pytest.mark.parametrize("k", [0, 3])
def test_decode_gives_the_same_tokens_compiled_or_eager(pair, monkeypatch, k):
    """Greedy, plain (k=0) and speculative: compiled and eager forwards emit the same tokens."""
    target, draft, tok = pair
    ids = tok.encode(PROMPT)

    compiled, eager = decoded_compiled_and_eager(target, draft, ids, k, 80, monkeypatch)
    assert compiled == eager and len(set(compiled)) > 5  # non-degenerate


def test_eager_where_the_compiled_step_does_not_apply(pair):
    target, _, tok = pair
    ids = tok.encode(PROMPT)
    before = traces(target)
    bounded = make_cache(target, max_kv_size=64, margin=2)  # a rotating cache written past
    prefill(target, bounded, ids)  # its margin + 1 (it reads buffer and new keys): eager
    forward(target, mx.array([[5, 6, 7, 8]], dtype=mx.int32), bounded)
    assert bounded[0].offset == len(ids) + 4 and traces(target) == before

    class Other(nn.Module):  # an architecture the compiled step does not claim
        def __init__(self):
            super().__init__()
            self.args = type("Args", (), {"model_type": "gemma3_text"})()
            self.inner = target

        def __call__(self, inputs, cache=None):
            return self.inner(inputs, cache=cache)

    other = Other()
    cache = make_cache(target)
    prefill(target, cache, ids)
    out = forward(other, mx.array([[5]], dtype=mx.int32), cache)
    assert out.shape[1] == 1 and traces(other) == 0


@pytest.mark.cpu_only
def test_swapping_kernels_switches_the_compiled_step(load):
    """A compiled step replays the modules it traced: `skinny.disable` switches to another step
    (traced anew), `skinny.enable` back to the first one (kept)."""
    target, _, tok = load("target", "none")
    cache = make_cache(target)
    prefill(target, cache, tok.encode(PROMPT))
    forward(target, mx.array([[5]], dtype=mx.int32), cache)
    skinny_traces = traces(target)
    assert skinny_traces > 0
    skinny.disable(target)
    try:
        assert traces(target) == 0
        forward(target, mx.array([[6]], dtype=mx.int32), cache)
        assert traces(target) == 1
    finally:
        skinny.enable(target)
    assert traces(target) == skinny_traces


def test_a_round_that_traced_books_acceptance_but_not_its_time(pair, monkeypatch):
    """A round that traced a compiled step (once per shape and process) says nothing about later
    rounds' cost: k="auto" books its acceptance only. Here every round looks as if it traced."""
    import itertools

    import tinydraft_mlx.engine.rounds as rounds
    from tinydraft_mlx.engine import policy

    monkeypatch.setattr(policy, "_PAIRS", {})
    monkeypatch.setattr(rounds, "trace_count", itertools.count().__next__)
    scripted(monkeypatch, (1, 0))
    target, draft, _ = pair
    tokens = list(decode(target, draft, [5, 6, 7, 8], k="auto", max_tokens=12))
    pair_policy = tokens[-1].stats.policy
    assert all(not c.timings for c in pair_policy.costs.values())
    assert tokens[-1].stats.drafted > 0
    assert pair_policy.acceptance((0.0, 1.0, 0, 0.0)).observed > 0
@pytest.mark.parametrize("how", ["assign", "update"])
def test_a_weight_changed_after_tracing_is_used_by_the_compiled_step(load, how):
    """Generate (tracing the step), change a weight, generate again: the compiled decode equals
    the eager decode of the changed model, and differs from the unchanged model's output (so
    the change matters). A step that closes over the weights would replay the old ones."""
    from tinydraft_mlx.generation.loading import DEMO_DIR

    target, _, tok = load(str(DEMO_DIR / "target"), "none")
    ids = tok.encode(PROMPT)

    def run(compiled: bool) -> list[int]:
        import os

        before = os.environ.get(COMPILE_ENV)
        os.environ[COMPILE_ENV] = "1" if compiled else "0"
        try:
            return [t.id for t in decode(target, None, ids, max_tokens=24)]
        finally:
            os.environ.pop(COMPILE_ENV) if before is None else os.environ.update(
                {COMPILE_ENV: before})

    original = target.model.embed_tokens.weight
    old = run(compiled=True)
    assert traces(target) > 0
    changed = original * 0.5 + mx.random.normal(original.shape, key=mx.random.key(0)) * 0.05
    try:
        if how == "assign":
            target.model.embed_tokens.weight = changed
        else:
            target.update({"model": {"embed_tokens": {"weight": changed}}})
        new_compiled, new_eager = run(compiled=True), run(compiled=False)
    finally:
        target.model.embed_tokens.weight = original
    assert new_compiled == new_eager and new_compiled != old
    assert run(compiled=True) == old  # and back

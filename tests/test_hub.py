"""Real Qwen2.5 checkpoints from the Hugging Face hub. Opt-in (TINYDRAFT_HUB_TESTS=1) because they
download gigabytes; skipped with the reason when the hub cannot provide them."""

import os

import pytest

from tinydraft_mlx import ModelLoadError, generate, load_models

pytestmark = [
    pytest.mark.hub,
    pytest.mark.skipif(os.environ.get("TINYDRAFT_HUB_TESTS") != "1",
                       reason="hub tests are opt-in: set TINYDRAFT_HUB_TESTS=1"),
]
TARGET, DRAFT = "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.fixture(scope="module")
def qwen():
    try:
        return load_models(TARGET, DRAFT, dtype="float32")
    except ModelLoadError as err:
        pytest.skip(f"hub unreachable: {err}")


def test_qwen25_pair_greedy_matches_transformers(qwen):
    from huggingface_hub import snapshot_download

    from tests.oracle import Oracle

    target, draft, tok = qwen
    ids = tok.encode("def fibonacci(n):")
    oracle = Oracle(snapshot_download(TARGET))
    ref, margin = oracle.greedy(ids, 32, eos=tok.eos_token_id)
    assert margin > 1e-3 and len(set(ref)) >= 8
    for k in (2, 4):
        out, stats = generate(target, draft, tok, ids, k=k, max_tokens=32)
        assert out == ref
        assert stats.acceptance_rate > 0.3

"""Real checkpoints from the Hugging Face hub (Qwen2.5; hybrid Qwen3.5 and Nemotron-H; a real MTP
layer and a public EAGLE-3 head). Opt-in (TINYDRAFT_HUB_TESTS=1) because they download
gigabytes; skipped with the reason when the hub cannot provide them."""

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


def test_qwen25_calls_a_tool_through_the_server_and_hybrid_stays_exact(qwen):
    """The real pair writes a tool call the server parses (Qwen2.5's own template), and hybrid
    drafting on a copy-heavy prompt is plain greedy decoding's output."""
    import json

    from tests.test_server import Served
    from tinydraft_mlx import Hybrid
    from tinydraft_mlx.server import Defaults, create_app
    from tinydraft_mlx.serving.worker import Worker

    target, draft, tok = qwen
    served = Served(create_app(Worker(target, draft, tok, max_batch=2), "qwen",
                               Defaults(k=3, max_tokens=96)))
    try:
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "The current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]
        r = served.client().chat.completions.create(
            model="qwen", tools=tools, extra_body={"draft": "hybrid"},
            messages=[{"role": "user", "content": "What is the weather in Paris right now?"}])
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather"
        assert "paris" in json.loads(call.function.arguments)["city"].lower()
    finally:
        served.close()
    code = ("def area(r):\n    return 3.14159 * r * r\n\n\ndef perimeter(r):\n"
            "    return 2 * 3.14159 * r\n")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Repeat this code exactly:\n"
                                       + code}], add_generation_prompt=True, tokenize=False)
    plain, _ = generate(target, None, tok, prompt, max_tokens=64)
    hybrid, stats = generate(target, Hybrid(draft), tok, prompt, k=4, max_tokens=64)
    assert hybrid == plain
    assert stats.acceptance_rate > 0.5


@pytest.mark.parametrize("target, draft, acceptance", [
    ("Qwen/Qwen3.5-2B", "Qwen/Qwen3.5-0.8B", 0.0),  # Gated DeltaNet + attention, a hybrid draft
    ("nvidia/NVIDIA-Nemotron-Nano-9B-v2", "prompt-lookup", 0.0),  # Mamba-2 + attention
    ("Qwen/Qwen3.5-0.8B", "mtp", 0.2),  # the checkpoint's own mtp.* layer
    ("Qwen/Qwen2.5-0.5B-Instruct", "BalajiAI/qwen2.5-0.5b.eagle3", 0.2),  # a speculators EAGLE-3
])
def test_a_real_checkpoint_decodes_exactly(target, draft, acceptance):
    """A real hybrid checkpoint (recurrent layers rolled back by replay), a real MTP layer, a
    public EAGLE-3 head: greedy speculative output is the transformers oracle's, one sequence
    and in a batch of two; a head is accepted (a mis-wired head would not be)."""
    from huggingface_hub import snapshot_download

    from tests.oracle import Oracle
    from tinydraft_mlx import batch_generate

    try:
        t, d, tok = load_models(target, draft, dtype="float32")
    except ModelLoadError as err:
        pytest.skip(f"hub unreachable: {err}")
    ids = tok.encode("def fibonacci(n):")
    ref, margin = Oracle(snapshot_download(target)).greedy(ids, 24, eos=tok.eos_token_id)
    assert margin > 1e-3
    out, stats = generate(t, d, tok, ids, k=3, max_tokens=24)
    assert out == ref
    assert stats.acceptance_rate >= acceptance, stats.summary()
    outs = batch_generate(t, d, tok, [ids, tok.encode("import os\n")], k=3, max_tokens=24)
    assert outs[0][0] == ref

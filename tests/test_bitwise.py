"""The bit-for-bit mode (engine/bitwise.py): with bitwise=True greedy speculative output is plain
greedy decoding's (also bitwise=True) bit for bit: the same tokens, and the same log-probabilities
at every position to the last bit, whatever drafted them and whatever k. This is the numerics
contract that must hold on every device, so these tests run on the run's default device (the GPU
on a Mac, MLX's CUDA backend with TINYDRAFT_TEST_DEVICE=gpu) in the checkpoint's dtype: float32,
bfloat16 and 4-bit.

On this CPU the default mode already differs between a one-row and a k + 1-row pass in float32
(MKL's GEMM: logits up to ~8e-6 apart, `results/README.md`); `test_row_dependent_rounding`
forces a rounding that depends on the row count, on any device, to show the default mode's
output leave plain decoding's where the bit-for-bit mode's does not.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import convert

from tests.fixtures import build_family_pair
from tests.test_server import Served
from tinydraft_mlx import batch_generate, generate, load_models, stream_generate
from tinydraft_mlx.engine.forward import set_kernels
from tinydraft_mlx.engine.rounds import BatchDecoder
from tinydraft_mlx.engine.sampling import ParameterError
from tinydraft_mlx.server import Defaults, create_app
from tinydraft_mlx.serving.worker import Worker

PROMPTS = [
    "def parse_args(self, args=None, namespace=None):",
    "    for line in text.splitlines():\n        if",
    "x = f(a, b)\ny = f(a, b)\nz = f(a, b)\nw = f(",  # repeats: prompt lookup drafts
]
NEW_TOKENS = 40


def run(target, draft, tok, prompt, **kwargs) -> tuple[list[int], mx.array, int]:
    """(token ids, (n, V) log-probabilities, draft tokens accepted; -1 where none was
    drafted)."""
    out = list(stream_generate(target, draft, tok, prompt, max_tokens=NEW_TOKENS, **kwargs))
    stats = out[-1].stats
    return ([r.token for r in out], mx.stack([r.logprobs for r in out]),
            stats.accepted if stats.drafted else -1)


def assert_bit_for_bit(target, draft, tok, cases, **kwargs) -> None:
    """Every (drafter, k) of `cases` gives plain decoding's tokens and log-probabilities, bit
    for bit, on each prompt; over the prompts every drafter drafted (verifies ran), and at a
    fixed k a model's or a head's drafts were accepted."""
    accepted = {i: -1 for i in range(len(cases))}
    for prompt in PROMPTS:
        ids, logprobs, _ = run(target, None, tok, prompt, bitwise=True, **kwargs)
        assert len(ids) == NEW_TOKENS
        for i, (source, k) in enumerate(cases):
            got, got_logprobs, n = run(target, source, tok, prompt, k=k, bitwise=True, **kwargs)
            assert got == ids, (source, k)
            assert mx.array_equal(got_logprobs, logprobs).item(), (source, k)
            accepted[i] = max(accepted[i], n)
    for i, (source, k) in enumerate(cases):
        # k="auto" starts from a clean policy in every test (conftest): it drafts too
        floor = -1 if source == "prompt-lookup" or k == "auto" else 0
        assert accepted[i] > floor, (source, k)


@pytest.fixture(scope="module")
def q4_pair(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("bitwise-q4")
    paths = []
    for name in ("target", "draft"):
        convert(str(checkpoints[name]), str(root / name), quantize=True, q_bits=4,
                q_group_size=64)
        paths.append(str(root / name))
    return load_models(*paths)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "q4"])
def test_greedy_is_plain_greedy_bit_for_bit(load, q4_pair, dtype):
    target, draft, tok = q4_pair if dtype == "q4" else load("target", "draft", dtype=dtype)
    cases = [(draft, 1), (draft, 3), (draft, 8), (draft, "auto"), ("prompt-lookup", 4)]
    assert_bit_for_bit(target, draft, tok, cases)


def test_seeded_sampling_is_plain_sampling_bit_for_bit(pair):
    target, draft, tok = pair
    assert_bit_for_bit(target, draft, tok, [(draft, 2), (draft, 5)], temperature=0.8,
                       top_p=0.9, seed=11)


def test_heads_are_plain_greedy_bit_for_bit():
    """The demo target's MTP layer and EAGLE-3 head (they read the padded verify's states)."""
    from tinydraft_mlx.generation.loading import DEMO_DIR

    target, head, tok = load_models(None, "mtp", dtype="float32")
    _, eagle, _ = load_models(None, str(DEMO_DIR / "eagle3"), dtype="float32")
    eagle.target = target  # the same target instance, so both heads read it
    assert_bit_for_bit(target, head, tok, [("mtp", 3), (eagle, 4)])


@pytest.mark.usefixtures("cpu_fp32")
def test_matches_the_oracle(pair, oracle):
    target, draft, tok = pair
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ref, margin = oracle.greedy(ids, NEW_TOKENS, eos=tok.eos_token_id)
        assert margin > 1e-3, f"near-tie on the path ({margin:.2e})"
        for k in (3, "auto"):
            out, _ = generate(target, draft, tok, ids, k=k, max_tokens=NEW_TOKENS, bitwise=True)
            assert out == ref, k


def _row_rounded(cls: type) -> type:
    """`cls` (a Linear kind) whose result rounds differently for more than one row (position):
    to 1/8 there, as computed for one row. The kind of difference TF32 or half-precision
    kernels make between row counts, made large enough to change tokens."""

    class RowRounded(cls):
        def __call__(self, x: mx.array) -> mx.array:
            y = super().__call__(x)
            return mx.round(y * 8) / 8 if x.shape[-2] > 1 else y

    return RowRounded


def test_row_dependent_rounding(checkpoints):
    """Default mode: the verify's rows round otherwise than the plain steps', so speculative
    output leaves plain decoding's. Bit-for-bit mode: every forward has the same row count, so
    both round alike and agree bit for bit."""
    target, draft, tok = load_models(str(checkpoints["target"]), str(checkpoints["draft"]),
                                     dtype="float32")
    swapped = 0
    for module in target.modules():
        if isinstance(module, nn.Linear):  # also the CPU's SkinnyLinear (engine/skinny.py)
            module.__class__ = _row_rounded(type(module))
            swapped += 1
    assert swapped >= 7 * 4  # q, k, v, o, gate, up, down in each of the 4 layers
    set_kernels(target, "row-rounded")  # compiled steps traced with the swapped modules
    prompt = PROMPTS[0]
    plain, plain_logprobs, _ = run(target, None, tok, prompt)
    spec, spec_logprobs, _ = run(target, draft, tok, prompt, k=4)
    assert mx.abs(spec_logprobs - plain_logprobs).max().item() > 1e-2
    assert spec != plain
    plain, plain_logprobs, _ = run(target, None, tok, prompt, bitwise=True)
    spec, spec_logprobs, accepted = run(target, draft, tok, prompt, k=4, bitwise=True)
    assert spec == plain and accepted > 0
    assert mx.array_equal(spec_logprobs, plain_logprobs).item()


def test_batch_generate_runs_each_prompt_bit_for_bit(pair):
    target, draft, tok = pair
    outs = batch_generate(target, draft, tok, PROMPTS, k=3, max_tokens=NEW_TOKENS, bitwise=True)
    for prompt, (ids, stats) in zip(PROMPTS, outs):
        plain, _ = generate(target, None, tok, prompt, max_tokens=NEW_TOKENS, bitwise=True)
        assert ids == plain and stats.accepted > 0


def test_server_serves_bit_for_bit(pair):
    """--bitwise: concurrent requests, one at a time, each plain decoding's tokens; k beyond
    the mode's 8 is a 400 naming the field."""
    target, draft, tok = pair
    with pytest.raises(ValueError, match="max_batch must be 1 with bitwise"):
        Worker(target, draft, tok, max_batch=2, bitwise=True)
    worker = Worker(target, draft, tok, max_batch=1, bitwise=True)
    served = Served(create_app(worker, "m", Defaults(k=3, max_tokens=NEW_TOKENS)))
    try:
        client = served.client()

        def ask(prompt: str) -> list[int]:
            r = client.completions.create(model="m", prompt=prompt, max_tokens=16,
                                          temperature=0.0, extra_body={"num_draft_tokens": 3})
            return r.choices[0].model_extra["tinydraft"]["token_ids"]

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, PROMPTS + PROMPTS[:1]))
        for prompt, got in zip(PROMPTS + PROMPTS[:1], answers):
            plain, _ = generate(target, None, tok, prompt, max_tokens=16, bitwise=True)
            assert got == plain
        import httpx

        r = httpx.post(f"{served.url}/v1/completions", timeout=30,
                       json={"model": "m", "prompt": "x", "num_draft_tokens": 9})
        assert r.status_code == 400 and "num_draft_tokens" in r.text and "[1, 8]" in r.text
    finally:
        served.close()


def test_refusals(pair, tmp_path):
    """One line each: a bound on the caches, a target without a compiled step (Gemma 3), k
    beyond 8, a value that is not a bool."""
    target, draft, tok = pair
    with pytest.raises(ParameterError, match=r"^bitwise must be False with max_kv_size 64 "):
        generate(target, draft, tok, "x", max_kv_size=64, bitwise=True)
    with pytest.raises(ParameterError, match=r'^k must be an integer in \[1, 8\] or "auto" '
                                             r"with bitwise \(got 9\)$"):
        generate(target, draft, tok, "x", k=9, bitwise=True)
    with pytest.raises(ParameterError, match=r"^bitwise must be True or False \(got 'yes'\)$"):
        generate(target, draft, tok, "x", bitwise="yes")
    gemma, gemma_draft = build_family_pair(tmp_path, "gemma3")
    g_target, _, g_tok = load_models(str(gemma), str(gemma_draft), dtype="float32")
    with pytest.raises(ParameterError, match=r"^bitwise must be False for this target \(it "
                                             r"needs a decode step that runs compiled"):
        generate(g_target, None, g_tok, "x", bitwise=True)
    with pytest.raises(ParameterError, match="^bitwise must be False for this target"):
        BatchDecoder(g_target, bitwise=True)

"""Beyond Qwen2: the mlx-lm architectures Mac users run with a standard KV cache decode exactly.

For Qwen3, Llama 3.x (with its "llama3" RoPE scaling), Mistral and Gemma 3 a tiny target/draft
pair is built at test time with transformers 5 (tests/fixtures.py) and loaded through
`load_models`. Greedy speculative output equals the transformers CPU fp32 oracle token for token,
for k in {1, 3, 6}, on paths with clear top-1/top-2 margins. Qwen3, Llama and Mistral run the
compiled decode forward (checked: it traced); Gemma 3's sliding-window layers (window 8, shorter
than every sequence here) keep bounded caches that must roll back after they wrap, and a control
shows that mlx-lm's own rotating cache, which cannot, gives a wrong output on the same path; they
also share batches (each row in its window's ring) and the server's batches, as gpt-oss's
alternating layers and Gemma 4's shared-KV layers do.
One family (Llama) is also checked sampled: the joint of its first two tokens against the oracle.
Hybrid models with recurrent layers are checked in tests/test_hybrid.py.
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.fixtures import (
    FAMILIES,
    GEMMA_WINDOW,
    build_family_pair,
    build_gemma4,
    build_gpt_oss_pair,
)
from tests.reference import check_first_two_in_batches, two_step_joint
from tinydraft_mlx import (
    BatchDecoder,
    PromptCache,
    SamplingParams,
    batch_generate,
    generate,
    load_models,
)
from tinydraft_mlx.engine.cache import RollbackRotatingKVCache, make_cache
from tinydraft_mlx.engine.cache import kv as cache_module
from tinydraft_mlx.engine.forward import SUPPORTED, traces

pytestmark = pytest.mark.usefixtures("cpu_fp32")

PROMPTS = [
    "def parse_args(self, args=None, namespace=None):\n    if args is None:",
    "import os\nimport sys\n\nclass Encoder(object):\n    def",
]
NEW_TOKENS = 40
MIN_MARGIN = 1e-3  # frameworks agree to ~1e-5 in fp32; a greedy match is meaningful above this


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (target dir, draft dir, (target, draft, tokenizer) loaded in float32)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        target, draft = build_family_pair(root, family)
        out[family] = (target, draft, load_models(str(target), str(draft), dtype="float32"))
    return out


@pytest.fixture(scope="module")
def references(families):
    """family -> [(prompt ids, the oracle's greedy continuation)], each a meaningful reference."""
    from tests.oracle import Oracle

    refs = {}
    for family, (target_dir, _, (_, _, tok)) in families.items():
        refs[family] = Oracle(target_dir).references(tok, PROMPTS, NEW_TOKENS, MIN_MARGIN, family)
        for _, ref in refs[family]:
            assert len(set(ref)) >= 8, f"{family}: degenerate reference {ref}"
    return refs


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_equals_the_oracle(families, references, family):
    target, draft, tok = families[family][2]
    accepted = drafted = 0
    for k in (1, 3, 6):
        for ids, ref in references[family]:
            out, stats = generate(target, draft, tok, ids, k=k, max_tokens=NEW_TOKENS)
            assert out == ref, (family, k, tok.decode(ids))
            accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
    assert 0 < accepted < drafted, (accepted, drafted)  # both paths: accepted and rejected drafts
    if family in SUPPORTED:
        assert traces(target) > 0 and traces(draft) > 0  # the compiled decode forward ran
    else:
        assert traces(target) == 0


def _after_a_rejected_chain(target, ids, extra):
    """Logits of the last token after a draft-like history: the prompt prefilled, `extra` fed one
    token at a time, all but the first rolled back, then the second fed again."""
    from tinydraft_mlx.engine.cache import rollback
    from tinydraft_mlx.engine.forward import prefill

    cache = make_cache(target, margin=8)
    prefill(target, cache, ids)
    for token in extra:
        target(mx.array([[token]]), cache=cache)
    rollback(cache, len(ids) + 1)
    return np.array(target(mx.array([[extra[1]]]), cache=cache)[0, -1], dtype=np.float64), cache


def test_gemma3_sliding_layers_roll_back_after_they_wrap(families, references, monkeypatch):
    """The sliding layers get rollback-able bounded caches of the model's window: after single
    steps that wrapped the ring and a rollback, the next logits are the oracle's. With mlx-lm's
    `RotatingKVCache` (what the model asks for: it overwrites the oldest slot in place, so a
    rollback after a wrap loses positions still inside the window) they are not, which is what
    this test would catch."""
    from tests.oracle import Oracle

    target_dir, _, (target, _, tok) = families["gemma3"]
    ids, ref = references["gemma3"][0]
    assert len(ids) > 2 * GEMMA_WINDOW
    extra = ref[:6]
    expected = Oracle(target_dir).logits(ids + extra[:2])[-1]
    ours, cache = _after_a_rejected_chain(target, ids, extra)
    sliding = [c for c in cache if isinstance(c, RollbackRotatingKVCache)]
    assert len(sliding) == 5 and {c.window for c in sliding} == {GEMMA_WINDOW}
    assert np.abs(ours - expected).max() < 1e-4
    monkeypatch.setattr(cache_module, "_rollback_able", lambda layer, margin: layer)
    theirs, _ = _after_a_rejected_chain(target, ids, extra)
    assert np.abs(theirs - expected).max() > 1e-2


def test_gemma3_batches_with_its_sliding_layers(families, references):
    """Sliding-window layers share a batch (each row in its window's ring): a batch of three
    (two oracle prompts whose windows wrap, and a short one ending early) equals the oracle and
    the short prompt alone; bounded caches bound the full-attention layers only."""
    target, draft, tok = families["gemma3"][2]
    (a, ref_a), (b, ref_b) = references["gemma3"]
    decoder = BatchDecoder(target, draft)
    assert not decoder.single
    kinds = cache_module.layer_kinds(target)
    assert kinds.count(("window", GEMMA_WINDOW, 0)) == 5 and kinds.count("kv") == 1
    short = tok.encode("x = 1")
    alone = generate(target, draft, tok, short, k=3, max_tokens=9)[0]
    for k in (1, 3, 6):
        outs = batch_generate(target, draft, tok, [a, short, b], k=k,
                              max_tokens=[NEW_TOKENS, 9, NEW_TOKENS])
        assert [o[0] for o in outs] == [ref_a, alone, ref_b], k
    bounded = batch_generate(target, draft, tok, [a, b], k=3, max_tokens=NEW_TOKENS,
                             max_kv_size=256)
    assert [o[0] for o in bounded] == [ref_a, ref_b]
    with pytest.raises(ValueError, match="k must be at most max_k"):
        BatchDecoder(target, draft, max_k=4).insert(a, draft="model", k=6)


def _oracle_refs(directory, tok) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the oracle's greedy continuation) for PROMPTS and a short prompt, each with
    clear margins on its path."""
    from tests.oracle import Oracle

    return Oracle(directory).references(tok, PROMPTS + ["x = 1"], NEW_TOKENS, MIN_MARGIN)


def test_gpt_oss_batches_with_its_alternating_layers(tmp_path_factory):
    """gpt-oss (sliding-window and full attention alternating, attention sinks, MoE): a batch of
    three (two oracle prompts whose windows wrap, one ending early) with its 2-layer draft
    equals the oracle for k in {1, 3, 6}, accepting some drafts and rejecting others."""
    oracle_dir, target_dir, draft_dir = build_gpt_oss_pair(tmp_path_factory.mktemp("gpt_oss"))
    target, draft, tok = load_models(str(target_dir), str(draft_dir), dtype="float32")
    assert not BatchDecoder(target, draft).single
    refs = _oracle_refs(oracle_dir, tok)
    accepted = drafted = 0
    for k in (1, 3, 6):
        outs = batch_generate(target, draft, tok, [ids for ids, _ in refs], k=k,
                              max_tokens=[NEW_TOKENS, NEW_TOKENS, 9])
        assert [o for o, _ in outs] == [refs[0][1], refs[1][1], refs[2][1][:9]], k
        accepted += sum(s.accepted for _, s in outs)
        drafted += sum(s.drafted for _, s in outs)
    assert 0 < accepted < drafted
    mx.clear_cache()


def test_gemma4_batches_with_its_shared_kv_layers(tmp_path_factory):
    """Gemma 4 text (sliding and full layers, the last two sharing earlier layers' caches):
    plain and prompt-lookup decoding, one sequence and a batch of three with ragged prompts,
    equal the oracle."""
    directory = build_gemma4(tmp_path_factory.mktemp("gemma4"))
    target, _, tok = load_models(str(directory), "none", dtype="float32")
    assert not BatchDecoder(target).single
    refs = _oracle_refs(directory, tok)
    assert generate(target, None, tok, refs[0][0], max_tokens=NEW_TOKENS)[0] == refs[0][1]
    for draft in (None, "prompt-lookup"):
        outs = batch_generate(target, draft, tok, [ids for ids, _ in refs], k=3,
                              max_tokens=[NEW_TOKENS, 17, NEW_TOKENS])
        assert [o for o, _ in outs] == [refs[0][1], refs[1][1][:17], refs[2][1]], draft
    mx.clear_cache()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_batches_and_bounded_caches_of_other_families(families, references, family):
    """A batch of three (two oracle prompts and a short one ending early) equals each prompt
    alone; Llama and Qwen3 also take bounded caches (their own caches are standard)."""
    target, draft, tok = families[family][2]
    (a, ref_a), (b, ref_b) = references[family]
    short = tok.encode("x = 1")
    alone = generate(target, draft, tok, short, k=3, max_tokens=9)[0]
    outs = batch_generate(target, draft, tok, [a, short, b], k=3, max_tokens=[NEW_TOKENS, 9,
                                                                             NEW_TOKENS])
    assert [o[0] for o in outs] == [ref_a, alone, ref_b]
    bounded = generate(target, draft, tok, a, k=3, max_tokens=NEW_TOKENS, max_kv_size=256)[0]
    assert bounded == ref_a  # a window longer than the sequence: exactly the unbounded output


def test_llama_sampled_first_two_tokens_follow_the_oracle(families):
    """At T = 1, top-p 0.8, k = 2: 2000 rows' first two tokens (in batches of 100, each from a
    copy of the prompt's prefilled caches) against the oracle's exact joint (tests/reference.py's
    warp). Bound as test_sampling_exactness: Pearson chi-square against the
    1 - 3.2e-5 quantile; the same samples scored against the joint without top-p must fail it."""
    from tests.oracle import Oracle

    target_dir, _, (target, draft, tok) = families["llama"]
    oracle = Oracle(target_dir)
    ids = tok.encode("def parse_args(self, args=None):")
    warp_kw = dict(temperature=1.0, top_p=0.8)
    exact = two_step_joint(oracle.logits, ids, **warp_kw)
    wrong = two_step_joint(oracle.logits, ids, temperature=1.0)
    assert 10 < len(exact) < 2000
    check_first_two_in_batches(lambda: BatchDecoder(target, draft), ids, "model",
                               SamplingParams(**warp_kw), [(SamplingParams(), None, 0)],
                               [ids], exact, wrong, batches=20, rows=100, every=100)


def test_gemma3_prompt_cache_reuse_and_the_server_batches_it(families, references, capsys):
    """A prompt cache over mixed layers (full and sliding) is reused exactly, one sequence and
    in a batch (its rings relaid into the batch's margin); the server batches such a model."""
    from tinydraft_mlx import server

    target_dir, draft_dir, (target, draft, tok) = families["gemma3"]
    (ids, ref), (other, other_ref) = references["gemma3"]
    cache = PromptCache(target, draft)
    cached = []
    for prompt, expected in [(ids, ref), (ids, ref), (other, other_ref)]:
        out, stats = generate(target, draft, tok, prompt, k=3, max_tokens=NEW_TOKENS,
                              prompt_cache=cache)
        assert out == expected
        cached.append(stats.cached_tokens)
    assert cached[0] == 0 and cached[1] == len(ids) - 1, cached
    args = server.setup_arg_parser().parse_args(
        ["--target", str(target_dir), "--draft", str(draft_dir), "--max-batch", "8"])
    app = server.build_app(args)
    assert app.state.service.worker.max_batch == 8
    assert "one at a time" not in capsys.readouterr().err
    pc = PromptCache(target, draft)
    generate(target, draft, tok, ids, k=3, max_tokens=NEW_TOKENS, prompt_cache=pc)
    outs = batch_generate(target, draft, tok, [ids, other], k=3, max_tokens=NEW_TOKENS,
                          prompt_cache=[pc, None])
    assert [o[0] for o in outs] == [ref, other_ref]
    assert outs[0][1].cached_tokens == len(ids) - 1

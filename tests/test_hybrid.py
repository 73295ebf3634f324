"""Hybrid models: recurrent layers (Gated DeltaNet: Qwen3-Next, Qwen3.5 dense and MoE; Mamba-2:
Nemotron-H, Granite 4, and Mamba-2 alone) beside full attention, decoded speculatively and
exactly, one sequence and in batches.

Tiny checkpoints are built at test time with transformers 5 (tests/fixtures.py: a 4-layer
target, recurrent / attention / recurrent / attention (Nemotron-H: Mamba-2, attention, Mamba-2,
MLP), and a 2-layer draft copied from its first layers: a hybrid draft) and loaded through
`load_models`. Checked against independent references:
- greedy speculative output == the transformers fp32 oracle (full recompute), k in {1, 3, 6,
  auto}, with the draft model, prompt lookup and a dense (Qwen2) draft; rejections at the first
  position, in the middle, and fully accepted rounds (the bonus token's state) all occur;
- batches of 3 and 8 (ragged prompts, rows finishing early, mixed drafters) == the oracle;
- a rolled-back recurrent state (convolution window and recurrence state) == the state mlx-lm's
  own `ArraysCache` holds after running the accepted prefix, per row of a ragged batch; and
  without the rollback it is not (the control), nor is the output;
- sampled: the joint of the first two tokens of rows inside mixed batches == the oracle's exact
  joint (chi-square, the suite's bound), and a seeded row's tokens do not depend on its batch.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.fixtures import HYBRIDS, build_hybrid_pair, build_tokenizer
from tests.reference import (
    check_first_two_in_batches,
    drain,
    prefilled_rows,
    seeded_row_in_a_batch,
    two_step_joint,
)
from tinydraft_mlx import (
    BatchDecoder,
    Hybrid,
    PromptCache,
    SamplingParams,
    batch_generate,
    generate,
    load_models,
)
from tinydraft_mlx.engine.cache import layer_kinds, make_cache
from tinydraft_mlx.engine.cache.recurrent import RecurrentCache
from tinydraft_mlx.engine.forward import prefill
from tinydraft_mlx.generation.loading import ModelLoadError, load_model

pytestmark = pytest.mark.usefixtures("cpu_fp32")

PROMPTS = [
    "def parse_args(self, args=None, namespace=None):\n    if args is None:",
    "import os\nimport sys\n\nclass Encoder(object):\n    def",
]
SHORT = ["x = 1", "for i in range(10):\n    print(i)\n", "class", "import json\n"]
NEW = 32
MIN_MARGIN = 1e-3


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """family -> (target dir, (target, draft, tokenizer) in float32, [(ids, oracle greedy)])."""
    from tests.oracle import Oracle

    root = tmp_path_factory.mktemp("hybrids")
    out = {}
    for family in HYBRIDS:
        target_dir, draft_dir = build_hybrid_pair(root, family)
        models = load_models(str(target_dir), str(draft_dir), dtype="float32")
        oracle = Oracle(target_dir)
        refs = oracle.references(models[2], PROMPTS + SHORT, NEW, MIN_MARGIN, family)
        out[family] = (target_dir, models, refs, oracle)
    return out


def test_the_layers_are_recurrent_and_batchable(hybrids):
    for family in HYBRIDS:
        target, draft, _ = hybrids[family][1]
        kinds = layer_kinds(target)
        recurrent = 4 if family == "mamba2" else 2  # Mamba-2 alone has no attention layer
        assert kinds is not None and kinds.count("recurrent") == recurrent, (family, kinds)
        cache = make_cache(target, margin=7)
        assert sum(isinstance(c, RecurrentCache) for c in cache) == recurrent
        assert not BatchDecoder(target, draft).single


@pytest.mark.parametrize("family", HYBRIDS)
def test_greedy_speculative_equals_the_oracle(hybrids, family):
    """k in {1, 3, 6, auto}, the hybrid draft and prompt lookup: the oracle's tokens; rounds
    rejected at the first position, rejected in the middle, and fully accepted all occur."""
    _, (target, draft, tok), refs, _ = hybrids[family]
    first = middle = full = 0
    for k in (1, 3, 6, "auto"):
        for ids, ref in refs[:2]:
            out, stats = generate(target, draft, tok, ids, k=k, max_tokens=NEW)
            assert out == ref, (family, k)
            counts = stats.accepted_length_counts
            if k != "auto":
                first += counts[0] if counts else 0
                middle += sum(counts[1:k])
                full += counts[k] if len(counts) > k else 0
    assert first and middle and full, (first, middle, full)
    for ids, _ in refs[:2]:
        out, _ = generate(target, "prompt-lookup", tok, ids + ids[-6:], k=3, max_tokens=NEW)
        assert out == hybrids[family][3].greedy(ids + ids[-6:], NEW)[0]


def test_a_dense_draft_drafts_for_a_hybrid_target(hybrids, pair):
    """A Qwen2 draft (the suite's fixture pair's, same tokenizer) on a Qwen3.5 target."""
    _, (target, _, tok), refs, _ = hybrids["qwen3_5"]
    dense = pair[1]
    for k in (2, 5):
        for ids, ref in refs[:2]:
            out, stats = generate(target, dense, tok, ids, k=k, max_tokens=NEW)
            assert out == ref and stats.drafted > 0


@pytest.mark.parametrize("family", HYBRIDS)
def test_batches_equal_the_oracle(hybrids, family):
    """B = 3 and B = 8: ragged prompts, rows finishing early, the draft model, prompt lookup,
    hybrid drafting and no draft side by side; every row is the oracle's."""
    _, (target, draft, tok), refs, _ = hybrids[family]
    prompts = [ids for ids, _ in refs]
    limits = [NEW, NEW, 9, NEW, 5, NEW]
    for k in (1, 3, 6):
        outs = batch_generate(target, draft, tok, prompts[:3], k=k, max_tokens=limits[:3])
        assert [o for o, _ in outs] == [ref[:n] for (_, ref), n in zip(refs[:3], limits)]
    decoder = BatchDecoder(target, draft)
    assert not decoder.single
    uids = []
    for i in range(8):
        ids, _ = refs[i % len(refs)]
        kind = ["model", "prompt-lookup", None, Hybrid(draft)][i % 4]
        uids.append(decoder.insert(ids, draft=kind, k=[2, 4, "auto"][i % 3],
                                   max_tokens=[NEW, 11, NEW, 7][i % 4]))
    out = drain(decoder)
    for i, uid in enumerate(uids):
        _, ref = refs[i % len(refs)]
        assert out[uid] == ref[: [NEW, 11, NEW, 7][i % 4]], i


def _reference_state(model, ids):
    """mlx-lm's own caches after one forward of `ids`: each recurrent layer's (window, state)."""
    cache = make_prompt_cache(model)
    model(mx.array([ids]), cache=cache)
    return [(np.array(c[0]), np.array(c[1])) for c in cache if type(c).__name__ == "ArraysCache"]


@pytest.mark.parametrize("family", HYBRIDS)
def test_a_rolled_back_state_is_the_accepted_prefix_state(hybrids, family):
    """Rows of a batch fed 5 tokens in one forward and rolled back to 0..5 of them: each
    recurrent layer's convolution window and recurrence state equal those of mlx-lm's own cache
    after the prompt + the kept tokens (an independent run without our caches). The state as the
    forward left it (no rollback) differs from that reference by far more."""
    _, (target, _, _), refs, _ = hybrids[family]
    prompts = [ids for ids, _ in refs[:3]]
    fed = [7, 11, 13, 17, 19]
    batch = prefilled_rows(target, prompts, margin=6)
    batch.forward(target, mx.array([fed] * 3))
    unrolled = [[(np.array(c[0][b]), np.array(c[1][b])) for c in batch.layers
                 if isinstance(c, RecurrentCache)] for b in range(3)]
    keeps = [0, 2, 5]
    batch.rollback([len(ids) + n for ids, n in zip(prompts, keeps)])
    control = 0.0
    for b, (ids, n) in enumerate(zip(prompts, keeps)):
        expected = _reference_state(target, ids + fed[:n])
        ours = [(np.array(c[0][b]), np.array(c[1][b])) for c in batch.layers
                if isinstance(c, RecurrentCache)]
        for (w, s), (rw, rs), (_, us) in zip(ours, expected, unrolled[b]):
            np.testing.assert_allclose(w, rw[0], atol=2e-5, rtol=1e-4)
            np.testing.assert_allclose(s, rs[0], atol=2e-5, rtol=1e-4)
            if n < len(fed):
                control = max(control, float(np.abs(us - rs[0]).max()))
    assert control > 1e-2, control
    # one sequence: trim through the cache protocol, then a further step matches the reference
    for n in (0, 3):
        cache = make_cache(target, margin=6)
        prefill(target, cache, prompts[0])
        for token in fed:
            target(mx.array([[token]]), cache=cache)  # one segment per step, as a draft chain
        for layer in cache:
            layer.trim(len(fed) - n)
        expected = _reference_state(target, prompts[0] + fed[:n])
        ours = [(np.array(c[0]), np.array(c[1])) for c in cache if isinstance(c, RecurrentCache)]
        for (w, s), (rw, rs) in zip(ours, expected):
            np.testing.assert_allclose(w, rw, atol=2e-5, rtol=1e-4)
            np.testing.assert_allclose(s, rs, atol=2e-5, rtol=1e-4)


def test_without_the_rollback_the_output_is_wrong(hybrids, monkeypatch):
    """The control: recurrent layers whose rollback only moves the length (as a KV cache's
    does) give another output than the oracle on the same paths."""
    _, (target, draft, tok), refs, _ = hybrids["qwen3_5"]
    monkeypatch.setattr(RecurrentCache, "rollback_rows", lambda self, backs: None)
    wrong = 0
    for ids, ref in refs[:2]:
        out, stats = generate(target, draft, tok, ids, k=3, max_tokens=NEW)
        assert stats.drafted > stats.accepted
        wrong += out != ref
    assert wrong == 2


def test_sampled_first_two_tokens_inside_mixed_batches(hybrids):
    """Qwen3.5 target, hybrid draft, T = 1 top-p 0.8, k = 2: 1,440 rows' first two tokens (in
    batches of 48 beside greedy, seeded and prompt-lookup companions) against the oracle's exact
    joint; the joint without top-p must be rejected by the same samples."""
    _, (target, draft, tok), refs, oracle = hybrids["qwen3_5"]
    ids = refs[1][0]  # ten tokens in the first step's nucleus
    joint = two_step_joint(oracle.logits, ids, temperature=1.0, top_p=0.8)
    wrong = two_step_joint(oracle.logits, ids, temperature=1.0)
    companions = [(SamplingParams(), "model", 3), (SamplingParams(0.7, seed=5), "model", 2),
                  (SamplingParams(0.9), "prompt-lookup", 2)]
    check_first_two_in_batches(lambda: BatchDecoder(target, draft), ids, "model",
                               SamplingParams(1.0, top_p=0.8), companions,
                               [refs[2 + i][0] for i in range(3)], joint, wrong, rows=48,
                               every=16)


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_a_seeded_row_does_not_depend_on_its_batch(hybrids, family):
    _, (target, draft, tok), refs, _ = hybrids[family]
    seeded_row_in_a_batch(target, draft, tok, refs, draft, ["model", "prompt-lookup"])


def test_prompt_caches_are_reused_at_their_end(hybrids):
    """A recurrent state is a snapshot at its last token: a prompt that extends the cached
    sequence reuses it (exactly: the oracle's tokens); one that shares only part of it cannot
    be rolled back that far and is prefilled from the start (nothing reused), still exact."""
    _, (target, draft, tok), refs, oracle = hybrids["qwen3_next"]
    ids, ref = refs[0]
    cache = PromptCache(target, draft)
    out, stats = generate(target, draft, tok, ids, k=3, max_tokens=12, prompt_cache=cache)
    assert out == ref[:12] and stats.cached_tokens == 0
    longer = ids + out + tok.encode("\n    return")
    out2, stats2 = generate(target, draft, tok, longer, k=3, max_tokens=12, prompt_cache=cache)
    assert stats2.cached_tokens == len(ids) + len(out) - 1
    assert out2 == oracle.greedy(longer, 12)[0]
    other = ids[:-4] + tok.encode(" pass")
    out3, stats3 = generate(target, draft, tok, other, k=3, max_tokens=12, prompt_cache=cache)
    assert stats3.cached_tokens == 0 and out3 == oracle.greedy(other, 12)[0]


def test_bounded_attention_beside_recurrent_layers(hybrids):
    """max_kv_size bounds the attention layers (recurrent ones hold O(1) state): a window longer
    than the sequence gives the unbounded output, one sequence and in a batch."""
    _, (target, draft, tok), refs, _ = hybrids["qwen3_5"]
    (a, ref_a), (b, ref_b) = refs[:2]
    assert generate(target, draft, tok, a, k=3, max_tokens=NEW, max_kv_size=256)[0] == ref_a
    outs = batch_generate(target, draft, tok, [a, b], k=3, max_tokens=NEW, max_kv_size=256)
    assert [o for o, _ in outs] == [ref_a, ref_b]


def test_the_server_batches_hybrid_models(hybrids):
    """Nemotron-H served with batches of 8: concurrent greedy requests (the draft model, prompt
    lookup, none) each return the oracle's tokens."""

    from tests.test_server import Served, assert_concurrent_greedy
    from tinydraft_mlx import server

    target_dir, _, refs, _ = hybrids["nemotron_h"]
    args = server.setup_arg_parser().parse_args(
        ["--target", str(target_dir), "--draft", str(target_dir.parent / "draft"),
         "--max-batch", "8", "--model-name", "m"])
    app = server.build_app(args)
    assert app.state.service.worker.max_batch == 8
    served = Served(app)
    try:
        assert_concurrent_greedy(served, refs, ["model", "prompt-lookup", "none"], 6)
    finally:
        served.close()


def test_a_state_no_one_rolls_back_is_refused_at_load(tmp_path):
    """Mamba-1's selective-scan layers keep an ArraysCache this engine does not replay: loading
    names the architecture, the layer state and what does run, in one line."""
    import torch
    import transformers as tf

    directory = tmp_path / "mamba"
    build_tokenizer(directory)
    config = tf.MambaConfig(vocab_size=448, hidden_size=64, state_size=8, num_hidden_layers=2,
                            expand=2, conv_kernel=4)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    with pytest.raises(ModelLoadError) as err:
        load_model(directory)
    message = str(err.value)
    assert "mamba" in message and "ArraysCache" in message and "Gated DeltaNet" in message
    assert "\n" not in message


def test_a_layer_layout_mlx_lm_cannot_build_is_refused():
    from tinydraft_mlx.generation.loading import config_overrides

    types = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    with pytest.raises(ModelLoadError, match="every p-th layer"):
        config_overrides({"model_type": "qwen3_next", "layer_types": types})
    assert config_overrides({"model_type": "qwen3_5_text", "layer_types": types[:2] * 2}) == {
        "full_attention_interval": 2, "model_type": "qwen3_5"}


def test_the_check_tool_passes_a_hybrid_pair(hybrids, tmp_path, capsys):
    """`python -m tinydraft_mlx.check` on a Qwen3.5 pair: its own forwards roll back (the cost
    curve), greedy identity and the sampling check pass."""
    import json

    from tinydraft_mlx.programs.check import main

    target_dir = hybrids["qwen3_5"][0]
    report = tmp_path / "check.json"
    assert main(["--target", str(target_dir), "--draft", str(target_dir.parent / "draft"),
                 "--quick", "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["greedy_identical"] and "result: EXACT" in capsys.readouterr().out

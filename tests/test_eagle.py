"""EAGLE-3 heads in the speculators format as drafters (engine/eagle.py, on chains.py's
HeadChain).

A tiny Qwen3 target is built at test time with transformers 5 (tests/fixtures.py), and an
EAGLE-3 directory for it (config.json + model.safetensors under the speculators names, a draft
vocabulary of 256 of the target's 448 ids), trained a little on the target's own distributions
by tests/eagle_reference.py's torch module, so that it agrees with the target on some positions.
Checked against independent references:
- the head's logits == that torch module's (written from the format's description: its own RoPE,
  attention and MLP) fed the oracle's hidden states of layers 1, 2, 3 (transformers'
  `output_hidden_states`), to float32 rounding; -inf exactly outside the draft vocabulary;
- after speculative decoding with rejections, the head's cache keys == the torch module's keys
  over the final sequence on the oracle's states;
- greedy output == the transformers fp32 oracle, k in {1, 3, 6, auto}, one sequence and batches
  of 3 and 8 beside the draft model, the MTP layer, prompt lookup and plain rows;
- sampled: the joint of the first two tokens of EAGLE-3 rows in mixed batches == the oracle's
  exact joint (chi-square, the suite's bound), a target token outside the draft vocabulary
  reachable only by resampling.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from tests.fixtures import EAGLE_LAYERS, HEAD_PROMPTS
from tests.reference import check_first_two_in_batches, drain, two_step_joint
from tinydraft_mlx import (
    BatchDecoder,
    Hybrid,
    ModelLoadError,
    SamplingParams,
    batch_generate,
    generate,
    load_models,
)
from tinydraft_mlx.engine.drafters.chains import HeadChain
from tinydraft_mlx.engine.drafters.eagle import Eagle3Head

pytestmark = pytest.mark.usefixtures("cpu_fp32")

PROMPTS = HEAD_PROMPTS
NEW = 24
MIN_MARGIN = 1e-3


def _reference(eagle_dir, target_dir, oracle, ids):
    """The torch module loaded from the head's own files, and the oracle's states of `ids`."""
    import torch
    from safetensors.torch import load_file

    from tests.eagle_reference import Eagle3Reference

    config = json.loads((eagle_dir / "config.json").read_text())
    tensors = load_file(str(eagle_dir / "model.safetensors"))
    kept = (torch.arange(len(tensors["d2t"])) + tensors["d2t"]).tolist()
    ref = Eagle3Reference(config, oracle.model.model.embed_tokens.weight, kept)
    names = {v: k for k, v in _names(ref).items()}
    ref.load_state_dict({names[k]: v for k, v in tensors.items() if k in names} |
                        {"embed": ref.embed, "kept": ref.kept})
    with torch.no_grad():
        out = oracle.model(torch.tensor([ids]), output_hidden_states=True)
        states = torch.cat([out.hidden_states[i] for i in EAGLE_LAYERS], dim=-1)
    return ref, states


def _names(ref) -> dict[str, str]:
    """The torch module's parameter names -> the speculators names."""
    layer = "layers.0."
    out = {"fc.weight": "fc.weight", "w_norm": "norm.weight", "lm_head.weight": "lm_head.weight",
           "w_in": layer + "input_layernorm.weight", "w_hidden": layer + "hidden_norm.weight",
           "w_post": layer + "post_attention_layernorm.weight"}
    for mine, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
        out[f"{mine}.weight"] = f"{layer}self_attn.{theirs}.weight"
    for mine in ("gate", "up", "down"):
        out[f"{mine}.weight"] = f"{layer}mlp.{mine}_proj.weight"
    return out


# -- the head itself ----------------------------------------------------------------------------
def test_the_heads_logits_equal_an_independent_reference(eagle):
    import torch

    target_dir, eagle_dir, (target, head, tok), _, refs, oracle = eagle
    assert isinstance(head, Eagle3Head) and head.after == tuple(i - 1 for i in EAGLE_LAYERS)
    ids = refs[0][0] + refs[0][1][:8]
    ref, states = _reference(eagle_dir, target_dir, oracle, ids)
    ours = head.target_states(ids)  # the layers' outputs, as the engine captures them
    np.testing.assert_allclose(np.array(ours[0]), states[0].numpy(), atol=2e-4, rtol=1e-4)
    with torch.no_grad():
        expected, _, _ = ref(torch.tensor([ids[1:]]), states[:, :-1])
    expected = expected[0].double().numpy()
    logits, _ = head(mx.array([ids[1:]]), None, hidden=ours[:, :-1])
    got = np.array(logits[0]).astype(np.float64)
    outside = np.isinf(expected)
    assert outside.sum() == (448 - 256) * len(ids[1:]) and np.isinf(got[outside]).all()
    assert np.abs(got[~outside] - expected[~outside]).max() < 1e-3
    # the control: the states of the wrong layers give other logits
    wrong, _ = head(mx.array([ids[1:]]), None, hidden=ours[:, :-1, ::-1])
    assert np.abs(np.array(wrong[0])[~outside] - expected[~outside]).max() > 0.1


def test_the_heads_cache_holds_the_target_states_of_accepted_positions(eagle):
    import torch

    target_dir, eagle_dir, (target, head, tok), _, refs, oracle = eagle
    ids = refs[1][0]
    decoder = BatchDecoder(target, head)
    uid = decoder.insert(ids, draft=head, k=3, max_tokens=16)
    stats, out = None, []
    while len(out) < 12:
        tokens = decoder.step().get(uid, [])
        out += [t.id for t in tokens]
        stats = tokens[-1].stats if tokens else stats
    assert stats.accepted > 0 and stats.rounds * 3 > stats.accepted
    chain = next(c for c in decoder.drafting.chains.values() if isinstance(c, HeadChain)
                 and c.model is head)
    entries = chain.caches.lengths[0]
    seq = decoder.rows[0].seq[: entries + 1]
    ref, states = _reference(eagle_dir, target_dir, oracle, seq)
    with torch.no_grad():
        _, _, keys = ref(torch.tensor([seq[1:]]), states[:, :-1])
    got = np.array(chain.caches.layers[0].keys[0, :, :entries])
    np.testing.assert_allclose(got, keys[0].numpy(), atol=2e-4)


def test_a_head_for_another_vocabulary_is_refused_in_one_line(eagle, tmp_path):
    target_dir, eagle_dir, (target, _, _), _, _, _ = eagle
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((eagle_dir / "config.json").read_text())
    config["transformer_layer_config"]["vocab_size"] = 1000
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        load_models(str(target_dir), str(other), dtype="float32")
    assert "\n" not in str(err.value) and "1000" in str(err.value)


# -- exact output -------------------------------------------------------------------------------
def test_greedy_equals_the_oracle(eagle):
    _, _, (target, head, tok), _, refs, _ = eagle
    accepted = rejected = 0
    for k in (1, 3, 6, "auto"):
        for ids, ref in refs:
            out, stats = generate(target, head, tok, ids, k=k, max_tokens=NEW)
            assert out == ref, (k, ids)
            accepted += stats.accepted
            rejected += stats.drafted - stats.accepted
    assert accepted > 0 and rejected > 0, (accepted, rejected)


def test_batches_equal_the_oracle(eagle):
    _, _, (target, head, tok), draft, refs, _ = eagle
    prompts = [ids for ids, _ in refs[:3]]
    for k in (1, 3, 6):
        outs = batch_generate(target, head, tok, prompts, k=k, max_tokens=NEW)
        assert [o for o, _ in outs] == [ref for _, ref in refs[:3]], k
    decoder = BatchDecoder(target, draft, prefill_step=9)
    kinds = [head, "model", "mtp", Hybrid(head), None, head, "prompt-lookup", "mtp"]
    ks = [2, 3, 4, 3, 0, "auto", 4, 1]
    expected = {}
    for j, (kind, k) in enumerate(zip(kinds, ks)):
        ids, ref = refs[j % len(refs)]
        n = NEW - 3 * (j % 3)
        expected[decoder.insert(ids, draft=kind, k=k, max_tokens=n)] = ref[:n]
    assert drain(decoder) == expected


def test_sampled_first_two_tokens_inside_mixed_batches(eagle):
    """T = 1, k = 2, EAGLE-3 rows: 1,200 rows' first two tokens (in batches of 40 beside
    greedy, seeded, MTP and draft-model companions) against the oracle's exact joint; the joint
    at T = 0.7 is rejected by the same samples."""
    _, _, (target, head, tok), draft, refs, oracle = eagle
    ids = refs[2][0]
    joint = two_step_joint(oracle.logits, ids, temperature=1.0)
    wrong = two_step_joint(oracle.logits, ids, temperature=0.7)
    companions = [(SamplingParams(), "model", 3), (SamplingParams(0.7, seed=5), "mtp", 2),
                  (SamplingParams(0.9), head, 2)]
    check_first_two_in_batches(lambda: BatchDecoder(target, draft), ids, head,
                               SamplingParams(1.0), companions, [refs[0][0], refs[1][0]],
                               joint, wrong)


def test_every_drafter_kind_in_one_sampled_same_warp_batch_with_a_narrower_draft(eagle):
    """T = 0.7, one warp for every row, the draft model's vocabulary 64 ids narrower than the
    target's (as Qwen2.5-0.5B's beside 7B): rows drafting with the draft model (k = 2) share
    batches with prompt lookup on a repeating prompt (point masses of the target's width), the
    hybrid, the MTP layer, the EAGLE-3 head (its own small vocabulary) and plain rows, at k = 2
    (their q stacked with the model's) and k = 3 (padded to the longest). The model rows' first
    two tokens against the oracle's exact joint (chi-square, the suite's bound); the joint at
    T = 1 is rejected by the same samples."""
    _, _, (target, head, tok), draft, refs, oracle = eagle
    ids = refs[2][0]
    assert draft.model.embed_tokens.weight.shape[0] < target.model.embed_tokens.weight.shape[0]
    joint = two_step_joint(oracle.logits, ids, temperature=0.7)
    wrong = two_step_joint(oracle.logits, ids, temperature=1.0)
    same = SamplingParams(0.7)
    companions = [(same, "prompt-lookup", 2), (same, "hybrid", 3), (same, "mtp", 2),
                  (same, head, 3), (same, None, 0), (same, "prompt-lookup", 3)]
    repeating = refs[0][0] * 3  # its suffix occurs earlier: prompt lookup proposes
    check_first_two_in_batches(lambda: BatchDecoder(target, draft), ids, "model", same,
                               companions, [repeating, repeating], joint, wrong)


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_heads_with_bounded_caches_past_several_wraps(eagle, kind, monkeypatch):
    """max_kv_size = 24 with a head (the MTP layer, the EAGLE-3 head), k="auto" playing plain
    stretches of 12 rounds between drafting ones (a catch-up of 12 tokens, past the bounded
    cache's rollback margin of 9), 72 tokens (several wraps of the window): one sequence, a
    batch of two and a prompt cache's two turns give plain decoding's tokens with the same
    bound, and the head drafts on the bounded cache it was given (the one-sequence engine's and
    the prompt cache's)."""
    from tests.scripted import scripted
    from tinydraft_mlx import PromptCache
    from tinydraft_mlx.engine.cache import RollbackRotatingKVCache, make_cache
    from tinydraft_mlx.engine.policy import AUTO_MAX_K
    from tinydraft_mlx.engine.speculative import decode

    _, _, (target, head, tok), _, refs, _ = eagle
    drafter = "mtp" if kind == "mtp" else head
    window, new, margin = 24, 72, AUTO_MAX_K + 1
    prompts = [refs[0][0], refs[1][0]]
    plain = [generate(target, None, tok, ids, max_tokens=new, max_kv_size=window)[0]
             for ids in prompts]
    scripted(monkeypatch, (0,) * 12 + (3, 2, 3))
    from tinydraft_mlx.engine.drafters import resolve_drafter

    model = resolve_drafter(drafter, target=target).model
    target_cache = make_cache(target, window, margin)
    head_cache = make_cache(model, window, margin)
    got = [t.id for t in decode(target, drafter, prompts[0], k="auto", max_tokens=new,
                                target_cache=target_cache, draft_cache=head_cache)]
    assert got == plain[0]
    assert all(isinstance(c, RollbackRotatingKVCache) and c.offset > window for c in head_cache)
    batch = batch_generate(target, drafter, tok, prompts, k="auto", max_tokens=new,
                           max_kv_size=window)
    assert [tokens for tokens, _ in batch] == plain
    cache = PromptCache(target, drafter, max_kv_size=window)
    first, _ = generate(target, drafter, tok, prompts[0], k="auto", max_tokens=new // 2,
                        prompt_cache=cache)
    assert first == plain[0][: new // 2]
    assert all(isinstance(c, RollbackRotatingKVCache) and c.max_kv_size == window
               for c in cache.draft_cache)
    second, _ = generate(target, drafter, tok, prompts[0] + first, k="auto",
                         max_tokens=new // 2, prompt_cache=cache)
    assert first + second == plain[0]


def test_the_cli_and_the_check_tool_take_an_eagle3_directory(eagle, tmp_path, capsys):
    from tinydraft_mlx.programs.check import main as check
    from tinydraft_mlx.programs.cli import main as cli

    target_dir, eagle_dir = eagle[0], eagle[1]
    assert cli(["--target", str(target_dir), "--draft", str(eagle_dir), "--prompt", "x = 1",
                "--max-tokens", "8", "-k", "2"]) == 0
    report = tmp_path / "check.json"
    assert check(["--target", str(target_dir), "--draft", str(eagle_dir), "--quick",
                  "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["greedy_identical"] and data["drafts"][0]["costs"]["t_d"] > 0


def test_heads_beside_a_quantized_target_are_quantized_alike(eagle):
    """A 4-bit target (group 32): its EAGLE-3 head and its MTP layer (float tensors: the
    speculators directory, the original checkpoint's `mtp.*`) load quantized alike (their
    linear layers 4-bit), draft, and greedy and seeded outputs equal that target's plain
    decoding."""
    import mlx.nn as nn

    from tinydraft_mlx import load_head
    from tinydraft_mlx.engine.drafters.eagle import load_eagle3

    target, _, tok = load_models(str(eagle[0]), "none", dtype="float32")
    nn.quantize(target, group_size=32, bits=4)
    heads = {"eagle3": load_eagle3(target, eagle[1]), "mtp": load_head(target, eagle[0])}
    assert isinstance(heads["eagle3"].fc, nn.QuantizedLinear)
    assert isinstance(heads["mtp"].layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert {h.fc.bits for h in heads.values()} == {4}
    for name, head in heads.items():
        drafted = 0
        for ids, _ in eagle[4][:2]:
            plain, _ = generate(target, None, tok, ids, max_tokens=NEW)
            out, stats = generate(target, head, tok, ids, k=3, max_tokens=NEW)
            assert out == plain, name
            drafted += stats.drafted
            kw = dict(max_tokens=NEW, temperature=0.8, seed=3)
            assert generate(target, head, tok, ids, k=3, **kw)[0] == \
                generate(target, None, tok, ids, **kw)[0]
        assert drafted > 0

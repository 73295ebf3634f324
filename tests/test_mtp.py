"""The target's own MTP layer as a drafter (engine/mtp.py, engine/chains.py's HeadChain).

Tiny checkpoints are built at test time with transformers 5 (a dense Qwen3, Qwen3-Next with MoE
(experts stored one by one), Qwen3.5 dense and MoE (experts fused)): the target (its layers but
the first attention one damped, tests/fixtures.py) and its MTP tensors under the hub's names
(Qwen3-Next / Qwen3.5: inside model.safetensors, as the hub ships them; the dense one beside it
in mtp.safetensors; DeepSeek-V3's layout once), the layer a noisy copy of the target's first
attention layer, so that it agrees with the target on some positions and not others.
Checked against independent references:
- the head's logits == a reference built from transformers' own modules (the same tensors: its
  decoder layer, RoPE and causal mask, with the norms and projection written here in torch),
  fed the oracle's final hidden states, to float32 rounding; and a mis-wired head (its two
  inputs swapped) does not match;
- after speculative decoding with rejections, the head's cache == the head run once on the
  oracle's states of the final sequence (the states of accepted positions only were fed);
- greedy output == the transformers fp32 oracle of the target alone (it ignores the `mtp.*`
  tensors), k in {1, 3, 6, auto}, one sequence and batches of 3 and 8 (beside the draft model,
  prompt lookup, lookup + MTP, and plain rows), rejections and acceptances both counted;
- sampled: the joint of the first two tokens of MTP rows inside mixed batches == the oracle's
  exact joint (chi-square, the suite's bound); a seeded row does not depend on its batch.
"""

from __future__ import annotations

import json

import httpx
import mlx.core as mx
import numpy as np
import pytest

from tests.fixtures import (
    FIRST_ATTENTION,
    HEAD_PROMPTS,
    MTP_FAMILIES,
    ZERO_CENTRED,
    build_family_pair,
    build_hybrid_pair,
    damp_layers,
    write_mtp,
)
from tests.hub_layouts import nest_as_hub
from tests.reference import (
    check_first_two_in_batches,
    drain,
    seeded_row_in_a_batch,
    two_step_joint,
)
from tinydraft_mlx import (
    BatchDecoder,
    Hybrid,
    ModelLoadError,
    MtpHead,
    SamplingParams,
    batch_generate,
    generate,
    load_head,
    load_models,
)
from tinydraft_mlx.engine.drafters.chains import HeadChain
from tinydraft_mlx.engine.drafters.mtp import attach

pytestmark = pytest.mark.usefixtures("cpu_fp32")

PROMPTS = HEAD_PROMPTS
NEW = 24
MIN_MARGIN = 1e-3
DAMP = {"qwen3": 0.1, "qwen3_next": 0.02, "qwen3_5": 0.02, "qwen3_5_moe": 0.02}


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    """family -> (target dir, (target, head, tokenizer), draft model, [(ids, oracle greedy)],
    oracle)."""
    from tests.oracle import Oracle

    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for family in MTP_FAMILIES:
        if family == "qwen3":
            target_dir, draft_dir = build_family_pair(root, family)
        else:
            target_dir, draft_dir = build_hybrid_pair(root, family)
        damp_layers(target_dir, DAMP[family], FIRST_ATTENTION[family])
        write_mtp(target_dir, family,
                  into="mtp.safetensors" if family == "qwen3" else "model.safetensors")
        target, head, tok = load_models(str(target_dir), "mtp", dtype="float32")
        _, draft, _ = load_models(str(target_dir), str(draft_dir), dtype="float32")
        oracle = Oracle(target_dir)
        refs = oracle.references(tok, PROMPTS, NEW, MIN_MARGIN, family)
        out[family] = (target_dir, (target, head, tok), draft, refs, oracle)
    return out


# -- the head itself ----------------------------------------------------------------------------
def _reference_head(target_dir, family, oracle, ids):
    """(len(ids) - 1, V) logits of the MTP layer at positions 0..n-2 (position i reads the
    oracle's final state h_i and token ids[i + 1]), from the checkpoint's tensors through
    transformers' own decoder layer, rotary embedding and mask."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    tensors = {}
    for path in sorted(target_dir.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    mtp = {k[len("mtp."):]: v for k, v in tensors.items() if k.startswith("mtp.")}
    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"]
    one = AutoModelForCausalLM.from_config(config).eval()  # one layer: the MTP layer
    state = {f"model.layers.0.{k[len('layers.0.'):]}": v for k, v in mtp.items()
             if k.startswith("layers.0.")}
    experts = sorted({int(k.split(".")[5]) for k in state
                      if ".mlp.experts." in k and k.split(".")[5].isdigit()})
    if experts:  # transformers keeps the experts fused in memory: (E, 2I, H) gate first
        e = "model.layers.0.mlp.experts"
        state[f"{e}.gate_up_proj"] = torch.stack([torch.cat(
            [state.pop(f"{e}.{i}.gate_proj.weight"), state.pop(f"{e}.{i}.up_proj.weight")])
            for i in experts])
        state[f"{e}.down_proj"] = torch.stack([state.pop(f"{e}.{i}.down_proj.weight")
                                               for i in experts])
    state["model.norm.weight"] = mtp["norm.weight"]
    state["lm_head.weight"] = tensors["lm_head.weight"]
    state["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    missing, unexpected = one.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    eps = config.rms_norm_eps
    shift = 1.0 if family in ZERO_CENTRED else 0.0

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (shift + w)

    with torch.no_grad():
        states = oracle.model.model(torch.tensor([ids])).last_hidden_state[0, :-1]
        embeds = tensors["model.embed_tokens.weight"][torch.tensor(ids[1:])]
        x = torch.cat([rms(embeds, mtp["pre_fc_norm_embedding.weight"]),
                       rms(states, mtp["pre_fc_norm_hidden.weight"])], dim=-1)
        x = x @ mtp["fc.weight"].T
        logits = one(inputs_embeds=x[None]).logits[0]
    return logits.double().numpy(), states.numpy()


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_the_heads_logits_equal_an_independent_reference(mtp, family):
    target_dir, (target, head, tok), _, refs, oracle = mtp[family]
    ids = refs[0][0] + refs[0][1][:8]
    expected, states = _reference_head(target_dir, family, oracle, ids)
    ours = head.target_states(ids)  # our target's own states, as the engine captures them
    np.testing.assert_allclose(np.array(ours[0, :-1]), np.asarray(states), atol=2e-4, rtol=1e-4)
    logits, _ = head(mx.array([ids[1:]]), None, hidden=ours[:, :-1])
    got = np.array(logits[0]).astype(np.float64)
    assert np.abs(got - expected).max() < 2e-3 * max(1.0, np.abs(expected).max()), \
        np.abs(got - expected).max()
    # the control: the same head fed its two inputs the other way round is far off
    wrong, _ = head(mx.array([ids[:-1]]), None, hidden=ours[:, 1:])
    assert np.abs(np.array(wrong[0]) - expected).max() > 0.1


@pytest.mark.parametrize("interval", [True, False], ids=["hub-keys", "layer-types-only"])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_hub_checkpoint_that_nests_its_text_model_gives_the_same_head(mtp, family, interval,
                                                                        tmp_path):
    """The hub's Qwen3.5 checkpoints are vision-language ones: config.json nests the text model
    under `text_config` (model_type "qwen3_5_text" / "qwen3_5_moe_text") and the body's tensors
    sit under `model.language_model.`. The same tensors in that layout give an MTP layer whose
    logits equal the independent reference's (its norms read as weight + 1, as the flat
    layout's), whether the nested config carries `full_attention_interval` (the hub's do) or
    only transformers 5's `layer_types`."""
    target_dir, _, _, refs, oracle = mtp[family]
    hub = nest_as_hub(target_dir, tmp_path / family, family, interval)
    target, head, _ = load_models(str(hub), "mtp", dtype="float32")
    ids = refs[0][0] + refs[0][1][:8]
    expected, _ = _reference_head(target_dir, family, oracle, ids)
    states = head.target_states(ids)
    logits, _ = head(mx.array([ids[1:]]), None, hidden=states[:, :-1])
    got = np.array(logits[0]).astype(np.float64)
    assert np.abs(got - expected).max() < 2e-3 * max(1.0, np.abs(expected).max()), \
        np.abs(got - expected).max()


def test_the_deepseek_layout_gives_the_same_head(mtp, tmp_path):
    """model.layers.{N}.eh_proj / enorm / hnorm / shared_head.norm (DeepSeek-V3, GLM-4.5) map
    onto the same head as mtp.* for the same tensors."""
    target_dir, (target, head, tok), _, refs, _ = mtp["qwen3"]
    write_mtp(target_dir, "qwen3", layout="deepseek", into="deep.safetensors")
    other = load_head(target, target_dir / "deep.safetensors")
    ids = mx.array([refs[0][0]])
    states = head.target_states(refs[0][0])
    a, _ = head(ids[:, 1:], None, hidden=states[:, :-1])
    b, _ = other(ids[:, 1:], None, hidden=states[:, :-1])
    assert mx.array_equal(a, b)
    attach(target, head)  # the fixture's head is the target's again


def test_a_checkpoint_without_mtp_tensors_is_refused_in_one_line(mtp, tmp_path):
    target_dir, (target, _, _), _, _, _ = mtp["qwen3_5"]
    empty = tmp_path / "none"
    empty.mkdir()
    with pytest.raises(ModelLoadError) as err:
        load_head(target, empty)
    message = str(err.value)
    assert "\n" not in message and "mtp.*" in message and "mlx-community" in message
    with pytest.raises(ModelLoadError):  # the draft checkpoint of the pair has none either
        load_models(str(target_dir.parent / "draft"), "mtp", dtype="float32")


def test_the_heads_cache_holds_the_target_states_of_accepted_positions(mtp):
    """After rounds that accepted and rejected, the head's cache == the head run once over the
    final sequence on the oracle's states: nothing of a rejected position's state remains."""

    _, (target, head, tok), _, refs, oracle = mtp["qwen3_next"]
    ids = refs[0][0]
    decoder = BatchDecoder(target)
    uid = decoder.insert(ids, draft="mtp", k=3, max_tokens=14)
    out, stats = [], None
    for _ in range(40):
        tokens = decoder.step().get(uid, [])
        out += [t.id for t in tokens]
        stats = tokens[-1].stats if tokens else stats
        if len(out) >= 10:
            break
    assert stats.accepted > 0 and stats.rounds * 3 > stats.accepted  # accepted and rejected
    chain = next(c for c in decoder.drafting.chains.values() if isinstance(c, HeadChain))
    row = decoder.rows[0]
    entries = chain.caches.lengths[0]
    skip = chain.feeds[row.uid].skip
    assert skip == 1 and entries >= len(ids) - 1
    _assert_cache_holds_oracle_states([chain.caches.layers[0]], head, oracle,
                                      decoder.rows[0].seq, entries)


def test_plain_stretches_of_a_head_row_are_pipelined_and_fed_to_the_head(mtp, monkeypatch):
    """k="auto" playing 4 plain rounds between drafting ones (k = 2): the plain rounds are
    queued ahead of the previous round's read, as a plain row's are (their captured target
    states carried with them), the tokens are the oracle's, and the head's cache then holds
    the oracle's states of the accepted positions (the plain stretches' fed as a backlog)."""
    from tests.scripted import scripted

    _, (target, head, tok), _, refs, oracle = mtp["qwen3_5"]
    ids, ref = refs[0]
    scripted(monkeypatch, (0, 0, 0, 0, 2))
    queued = []
    verify = BatchDecoder._verify

    def counted(self, proposals, inputs=None):
        queued.append(inputs is not None)
        return verify(self, proposals, inputs)

    monkeypatch.setattr(BatchDecoder, "_verify", counted)
    decoder = BatchDecoder(target)
    uid = decoder.insert(ids, draft="mtp", k="auto", max_tokens=NEW)
    assert drain(decoder)[uid] == ref
    assert sum(queued) >= 6, queued
    decoder = BatchDecoder(target)
    uid = decoder.insert(ids, draft="mtp", k="auto", max_tokens=NEW)
    for _ in range(14):  # stop within a drafting stretch's commit: the head has read it all
        decoder.step()
    chain = next(c for c in decoder.drafting.chains.values() if isinstance(c, HeadChain))
    entries = chain.caches.lengths[0]
    assert entries > len(ids)
    _assert_cache_holds_oracle_states([chain.caches.layers[0]], head, oracle,
                                      decoder.rows[0].seq, entries)


def _assert_cache_holds_oracle_states(cache, head, oracle, seq: list[int],
                                      entries: int | None = None) -> None:
    """The head's cache (its first `entries` entries: all by default) == the head run once on
    the oracle's final states of `seq` (entry i: state i and token i + 1)."""
    import torch

    entries = cache[0].offset if entries is None else entries
    seq = seq[: entries + 1]
    with torch.no_grad():
        states = oracle.model.model(torch.tensor([seq])).last_hidden_state[0, :-1].numpy()
    ref = head.make_cache()
    head(mx.array([seq[1:]]), ref, hidden=mx.array(states)[None])
    np.testing.assert_allclose(np.array(cache[0].keys[0, :, :entries]),
                               np.array(ref[0].keys[0, :, :entries]), atol=2e-4)


# -- exact output -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_greedy_equals_the_oracle(mtp, family):
    _, (target, head, tok), _, refs, _ = mtp[family]
    accepted = rejected = 0
    for k in (1, 3, 6, "auto"):
        for ids, ref in refs:
            draft = head if k == 1 else "mtp"  # the head object and its name
            out, stats = generate(target, draft, tok, ids, k=k, max_tokens=NEW)
            assert out == ref, (family, k, ids)
            accepted += stats.accepted
            rejected += stats.drafted - stats.accepted
    assert accepted > 0 and rejected > 0, (accepted, rejected)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_batches_equal_the_oracle(mtp, family):
    _, (target, head, tok), draft, refs, _ = mtp[family]
    prompts = [ids for ids, _ in refs[:3]]
    for k in (1, 3, 6):
        outs = batch_generate(target, head, tok, prompts, k=k, max_tokens=NEW)
        assert [o for o, _ in outs] == [ref for _, ref in refs[:3]], (family, k)
    # eight rows, each drafting its own way, in one batch: MTP, the draft model, prompt lookup,
    # lookup + MTP, none; ragged lengths, rows leaving early, prompts prefilled 7 tokens a step
    decoder = BatchDecoder(target, draft, prefill_step=7)
    kinds = ["mtp", "model", "prompt-lookup", Hybrid(head), None, "mtp", "mtp", "model"]
    ks = [2, 3, 4, 3, 0, "auto", 5, 2]
    uids = {}
    for j, (kind, k) in enumerate(zip(kinds, ks)):
        ids, ref = refs[j % len(refs)]
        n = NEW - 3 * (j % 3)
        uids[decoder.insert(ids, draft=kind, k=k, max_tokens=n)] = ref[:n]
    assert drain(decoder) == uids


def test_sampled_first_two_tokens_inside_mixed_batches(mtp):
    """Qwen3-Next target, T = 1 top-p 0.8, k = 2, MTP rows: 1,200 rows' first two tokens (in
    batches of 100 beside greedy, seeded, draft-model and prompt-lookup companions) against the
    oracle's exact joint; the joint without top-p is rejected by the same samples."""
    _, (target, head, tok), draft, refs, oracle = mtp["qwen3_next"]
    ids = refs[2][0]
    joint = two_step_joint(oracle.logits, ids, temperature=1.0, top_p=0.8)
    wrong = two_step_joint(oracle.logits, ids, temperature=1.0)
    companions = [(SamplingParams(), "model", 3), (SamplingParams(0.7, seed=5), "mtp", 2),
                  (SamplingParams(0.9), "prompt-lookup", 2)]
    check_first_two_in_batches(lambda: BatchDecoder(target, draft), ids, "mtp",
                               SamplingParams(1.0, top_p=0.8), companions,
                               [refs[0][0], refs[1][0]], joint, wrong, batches=12, rows=100,
                               every=50)


def test_a_seeded_row_does_not_depend_on_its_batch(mtp):
    _, (target, head, tok), draft, refs, _ = mtp["qwen3_5"]
    seeded_row_in_a_batch(target, draft, tok, refs, "mtp", ["model", "mtp"])


def test_mtp_names_the_head_only_where_one_is_loaded(mtp):
    _, (target, head, tok), _, refs, _ = mtp["qwen3"]
    assert isinstance(head, MtpHead) and head.target is target
    other, _, _ = load_models(str(mtp["qwen3"][0]), "none", dtype="float32")
    from tinydraft_mlx import ParameterError

    with pytest.raises(ParameterError, match="mtp"):
        generate(other, "mtp", tok, refs[0][0], max_tokens=2)


# -- everywhere a drafter goes ------------------------------------------------------------------
def test_prompt_caches_keep_the_head_where_it_stopped(mtp, tmp_path):
    """A prompt cache made for the MTP layer keeps the head's cache with the target state it had
    not read (at the cached prefix's end): a prompt that extends the cached sequence resumes the
    head (it still counts from the first turn's first token) and the output is the oracle's; a
    prompt that shares less restarts it, a stop string's cut and a saved file too, all exact;
    batch_generate records it the same way."""
    from tinydraft_mlx import PromptCache
    from tinydraft_mlx.engine.drafters.chains import HeadCache

    _, (target, head, tok), _, refs, oracle = mtp["qwen3"]
    ids, ref = refs[0]
    cache = PromptCache(target, "mtp")
    out, _ = generate(target, "mtp", tok, ids, k=3, max_tokens=12, prompt_cache=cache)
    kept = cache.draft_cache
    assert out == ref[:12] and isinstance(kept, HeadCache) and kept.skip == 1
    fed = kept[0].offset + kept.skip  # tokens the head consumed; then its unread states
    assert fed - 1 + sum(s.shape[0] for s in kept.states) == cache.target_cache[0].offset
    longer = ids + out + tok.encode("\n    return")
    out2, stats2 = generate(target, head, tok, longer, k=3, max_tokens=16, prompt_cache=cache)
    assert stats2.cached_tokens == len(ids) + len(out) - 1 and stats2.drafted > 0
    assert out2 == oracle.greedy(longer, 16)[0]
    assert cache.draft_cache.skip == 1  # resumed, not restarted after the cached prefix
    _assert_cache_holds_oracle_states(cache.draft_cache, head, oracle, longer + out2)
    copy = cache.copy()
    other = ids[:-2] + tok.encode(" pass")  # shares less: the head starts again
    out3, _ = generate(target, "mtp", tok, other, k=3, max_tokens=12, prompt_cache=cache)
    assert out3 == oracle.greedy(other, 12)[0] and cache.draft_cache.skip > 1
    third = longer + out2 + tok.encode("\n")
    out4, _ = generate(target, "mtp", tok, third, k=3, max_tokens=12, prompt_cache=copy)
    assert out4 == oracle.greedy(third, 12)[0] and copy.draft_cache.skip == 1
    text = tok.decode(out4[:6])
    cut, _ = generate(target, "mtp", tok, third, k=3, max_tokens=12, prompt_cache=copy,
                      stop=text[-2:])  # a stop string cuts the round's tokens
    after = third + cut + tok.encode("x")
    assert generate(target, "mtp", tok, after, k=3, max_tokens=8,
                    prompt_cache=copy)[0] == oracle.greedy(after, 8)[0]
    copy.save(tmp_path / "pc.safetensors")
    loaded = PromptCache.load(tmp_path / "pc.safetensors", target, "mtp")
    assert generate(target, "mtp", tok, after, k=3, max_tokens=8,
                    prompt_cache=loaded)[0] == oracle.greedy(after, 8)[0]
    batched = [PromptCache(target, "mtp") for _ in range(2)]
    prompts = [refs[1][0], refs[2][0]]
    batch_generate(target, "mtp", tok, prompts, k=2, max_tokens=8, prompt_cache=batched)
    assert all(isinstance(c.draft_cache, HeadCache) and c.draft_cache.skip == 1
               for c in batched)
    again = [p + refs[i + 1][1][:8] + tok.encode("\n") for i, p in enumerate(prompts)]
    outs = batch_generate(target, "mtp", tok, again, k=2, max_tokens=8, prompt_cache=batched)
    assert [o for o, _ in outs] == [oracle.greedy(p, 8)[0] for p in again]


def test_the_server_serves_mtp_beside_a_draft_model(mtp):
    """Qwen3-Next served with its draft model and --mtp, batches of 8: concurrent greedy
    requests drafting with "mtp", "model", "hybrid" and none each return the oracle's tokens,
    and the metrics count drafts per kind."""

    from tests.test_server import Served, assert_concurrent_greedy
    from tinydraft_mlx import server

    target_dir, _, _, refs, _ = mtp["qwen3_next"]
    args = server.setup_arg_parser().parse_args(
        ["--target", str(target_dir), "--draft", str(target_dir.parent / "draft"), "--mtp",
         "--max-batch", "8", "--model-name", "m"])
    served = Served(server.build_app(args))
    try:
        assert_concurrent_greedy(served, refs, ["mtp", "model", "hybrid", "none"], 8)
        metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
        assert 'tinydraft_draft_tokens_total{draft="mtp"}' in metrics
    finally:
        served.close()


def test_a_server_drafting_with_the_mtp_layer_resumes_it_across_turns(mtp):
    """--draft mtp: the pool's prompt caches are made for the head, so a second turn that
    extends the first resumes its head; both turns == the oracle, and the pool holds a head."""
    from tests.test_server import Served
    from tinydraft_mlx import server
    from tinydraft_mlx.engine.drafters.chains import HeadCache

    target_dir, (_, _, tok), _, refs, oracle = mtp["qwen3_next"]
    args = server.setup_arg_parser().parse_args(
        ["--target", str(target_dir), "--draft", "mtp", "--model-name", "m"])
    app = server.build_app(args)
    assert app.state.service.defaults.draft == "mtp"
    served = Served(app)
    try:
        client = served.client()
        ids, ref = refs[0]
        first = client.completions.create(model="m", prompt=ids, max_tokens=10, temperature=0.0)
        out = first.choices[0].model_extra["tinydraft"]["token_ids"]
        assert out == ref[:10]
        longer = ids + out + tok.encode("\n")
        second = client.completions.create(model="m", prompt=longer, max_tokens=10,
                                           temperature=0.0)
        assert second.choices[0].model_extra["tinydraft"]["token_ids"] == \
            oracle.greedy(longer, 10)[0]
        assert second.usage.prompt_tokens_details.cached_tokens > len(ids)
        pool = app.state.service.worker.pool
        assert any(isinstance(c.draft_cache, HeadCache) and c.draft_cache.skip == 1
                   for c in pool)
    finally:
        served.close()


def test_a_server_without_the_mtp_layer_refuses_mtp_requests(mtp):
    from tests.test_server import Served
    from tinydraft_mlx import server

    target_dir = mtp["qwen3"][0]
    args = server.setup_arg_parser().parse_args(
        ["--target", str(target_dir), "--draft", "none", "--model-name", "m"])
    served = Served(server.build_app(args))
    try:
        r = httpx.post(f"{served.url}/v1/completions", timeout=30, json={
            "model": "m", "prompt": "x", "max_tokens": 2, "draft": "mtp"})
        assert r.status_code == 400 and "--mtp" in r.json()["error"]["message"]
    finally:
        served.close()


def test_the_check_tool_and_the_cli_take_mtp(mtp, tmp_path, capsys):

    from tinydraft_mlx.programs.check import main as check
    from tinydraft_mlx.programs.cli import main as cli

    target_dir = mtp["qwen3"][0]  # (the check tool on a hybrid target: test_hybrid)
    report = tmp_path / "check.json"
    assert check(["--target", str(target_dir), "--draft", "mtp", "--quick",
                  "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["greedy_identical"] and data["drafts"][0]["costs"]["t_d"] > 0
    assert "result: EXACT" in capsys.readouterr().out
    assert cli(["--target", str(target_dir), "--draft", "mtp", "--prompt", "x = 1",
                "--max-tokens", "8", "-k", "2", "--verbose"]) == 0
    assert "draft: mtp" in capsys.readouterr().err

"""`python -m tinydraft_mlx.check`: passes on the demo pair and the fixtures, and fails when the
acceptance rule is broken, once for each check: a correction sampled from p instead of the
residual max(0, p - q) (the sampling check), and a greedy rule that keeps one draft too many
(the greedy check)."""

import json

import mlx.core as mx
import pytest

import tinydraft_mlx.engine.acceptance as acceptance
import tinydraft_mlx.engine.rounds as rounds
from tinydraft_mlx.engine.sampling.rejection import _leading_true, _pad_vocab
from tinydraft_mlx.programs.check import P_FAIL, main

KEYS = ["greedy_identical", "sampling_p_value", "costs", "acceptance", "recommended_k",
        "predicted_speedup", "measured_speedup"]


def correction_from_p(p, q, draft_tokens, key):
    """rejection.speculative_accept with the classic bug: a rejected position resamples from p
    itself instead of the residual max(0, p - q)."""
    k = p.shape[1] - 1
    width = max(p.shape[-1], q.shape[-1])
    p, q = _pad_vocab(p, width), _pad_vocab(q, width)
    accept_key, sample_key = mx.random.split(key)
    d = draft_tokens.astype(mx.int32)[..., None]
    p_d = mx.take_along_axis(p[:, :k], d, axis=-1)[..., 0]
    q_d = mx.take_along_axis(q, d, axis=-1)[..., 0]
    n = _leading_true(mx.random.uniform(shape=p_d.shape, key=accept_key) * q_d < p_d)
    row = mx.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    return n, mx.random.categorical(mx.log(row), key=sample_key).astype(mx.int32)


def correction_from_p_rows(p, q, draft_tokens, lengths, keys):
    """rejection.speculative_accept_rows with the same bug, row by row."""
    if isinstance(keys, mx.array):
        keys = list(mx.random.split(keys, len(lengths)))
    out = [correction_from_p(p[b : b + 1, : n + 1], q[b : b + 1, :n],
                             draft_tokens[b : b + 1, :n], key)
           for b, (n, key) in enumerate(zip(lengths, keys))]
    return mx.concatenate([n for n, _ in out]), mx.concatenate([t for _, t in out])


def one_too_many(target_argmax, draft_tokens):
    """The greedy rule keeping the first rejected draft as well."""
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_argmax[n]:
        n += 1
    n = min(n + 1, len(draft_tokens))
    return n, target_argmax[n]


@pytest.fixture
def report_file(tmp_path):
    return tmp_path / "report.json"


def test_demo_pair_quick_is_exact(report_file, tmp_path, capsys):
    plot = tmp_path / "check.png"
    assert main(["--quick", "--json", str(report_file), "--plot", str(plot)]) == 0
    report = json.loads(report_file.read_text())
    assert all(key in report for key in KEYS)
    assert report["greedy_identical"] and report["sampling_p_value"] >= P_FAIL
    draft = report["drafts"][0]
    assert draft["greedy"]["compared_tokens"] == 2 * 32 * 4
    assert set(draft["predicted_speedup"]) == set(draft["measured_speedup"]) == {"1", "2", "4",
                                                                                 "8"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "result: EXACT" in out and "recommended: " in out


def test_fixtures_with_several_drafts(checkpoints, pair, report_file, tmp_path, monkeypatch):
    """Also: what the check measured becomes k="auto"'s policy file entry for each drafting
    draft (round costs of every k it timed and of plain rounds, acceptance per position), which a
    new process's policy for the pair starts from."""
    from tinydraft_mlx.engine import policy, policy_store

    policy_file = tmp_path / "policies.json"
    monkeypatch.setenv("TINYDRAFT_POLICY_FILE", str(policy_file))
    monkeypatch.setattr(policy, "_PAIRS", {})
    assert main(["--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"]),
                 "--draft", "prompt-lookup", "--draft", "none", "--quick", "--top-p", "0.9",
                 "--json", str(report_file)]) == 0
    report = json.loads(report_file.read_text())
    assert [d["draft"] for d in report["drafts"]] == [str(checkpoints["draft"]), "prompt-lookup",
                                                      "none"]
    assert [d["plain"] for d in report["drafts"]] == [False, False, True]
    # plain decoding is the baseline, never recommended on its own noise: the recommendation is
    # the best measured draft and k when it beats 1, else plain decoding with k = 0
    candidates = [(s, d["draft"], int(k)) for d in report["drafts"] if not d["plain"]
                  for k, s in d["measured_speedup"].items()]
    best = max(candidates)
    if best[0] > 1.0:
        assert (report["recommended"]["draft"], report["recommended_k"]) == best[1:]
    else:
        assert (report["recommended"]["draft"], report["recommended_k"]) == ("none", 0)
    assert report["drafts"][0]["sampling"]["first_token_paths"].keys() == {"accepted",
                                                                          "resampled"}
    entries = json.loads(policy_file.read_text())["entries"]
    assert len(entries) == 2  # the draft model and prompt lookup; plain decoding has none
    target, draft, _ = pair  # the same checkpoints: the same fingerprints
    model_entry = entries[policy_store.pair_key(target, draft)]
    costs = model_entry["costs"]["1"]  # one sequence's rounds
    assert set(costs) == {"0", "1", "2", "4", "8"}
    per_k = report["drafts"][0]["greedy"]["per_k"]
    for k in ("1", "2", "4", "8"):
        assert costs[k] and costs[k][-1] == pytest.approx(per_k[k]["round_ms"] / 1000)
        assert len(costs[k]) == min(per_k[k]["rounds"], policy.RECENT) > 0
    greedy = model_entry["regimes"]["[0.0, 1.0, 0, 0.0]"]
    assert greedy["accepted"][0] == sum(per_k[k]["position_accepted"][0] for k in per_k)
    assert len(model_entry["regimes"]) == 2  # greedy and the check's top-p 0.9
    # a new process (no pair in memory) starts from the entry
    monkeypatch.setattr(policy, "_PAIRS", {})
    fresh = policy.shared_policy(target, draft)
    assert fresh.round_costs(1).cost(2) == pytest.approx(per_k["2"]["round_ms"] / 1000)
    assert fresh.acceptance((0.0, 1.0, 0, 0.0)).accepted[0] > 0


def test_a_correction_from_p_fails_the_sampling_check(monkeypatch, report_file, capsys):
    monkeypatch.setattr(acceptance, "speculative_accept", correction_from_p)
    monkeypatch.setattr(acceptance, "speculative_accept_rows", correction_from_p_rows)
    assert main(["--quick", "--json", str(report_file)]) == 1
    report = json.loads(report_file.read_text())
    assert report["greedy_identical"]  # greedy does not use the stochastic rule
    assert report["sampling_p_value"] < P_FAIL
    assert "sampling exactness" in capsys.readouterr().out


@pytest.fixture
def sampling_passes(monkeypatch):
    """The sampling check (2000 seeded runs, ~30 s of a `--quick` check here) reports a pass:
    for tests of another part of the report (test_demo_pair_quick_is_exact and
    test_a_correction_from_p_fails_the_sampling_check run it), where a failure can then come
    from that part only."""
    import tinydraft_mlx.programs.check as check

    passed = {"p_value": 0.5, "statistic": 1.0, "df": 1, "samples": 0, "prompt": 0,
              "first_acceptance_probability": 0.5, "first_token_paths": {}, "seconds": 0.0,
              "support": 1}
    monkeypatch.setattr(check, "sampling_check", lambda *a, **kw: passed)


def test_one_draft_too_many_fails_the_greedy_check(monkeypatch, report_file, capsys,
                                                   sampling_passes):
    monkeypatch.setattr(rounds, "greedy_accept_ids", one_too_many)
    assert main(["--quick", "--json", str(report_file)]) == 1
    report = json.loads(report_file.read_text())
    assert not report["greedy_identical"]
    clear = [d for d in report["drafts"][0]["greedy"]["divergences"] if not d["near_tie"]]
    assert clear and all(d["margin"] >= report["settings"]["near_tie_tolerance"] for d in clear)
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--temp", "0"], "--temp must be > 0 for the sampling check (got 0.0)"),
    (["--top-p", "0"], "top_p must be in (0, 1] (got 0.0)"),
    (["--top-k", "-1"], "--top-k must be an integer >= 0 (got -1)"),
    (["--prompts", "/no/such/file.json"], "No such file"),
    (["--draft", "OTHER"], "tokenizer differs from the target's"),
])
def test_bad_arguments_exit_2(checkpoints, capsys, args, message):
    args = [str(checkpoints["other_tokenizer"]) if a == "OTHER" else a for a in args]
    with pytest.raises(SystemExit) as exit_info:
        main(["--target", str(checkpoints["target"]), "--quick"] + args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_cost_curve_that_does_not_rise_is_flagged_not_predicted_from(monkeypatch,
                                                                       report_file, capsys,
                                                                       sampling_passes):
    """Under load t_v(4) = 113 ms after t_v(3) = 2.5 ms was measured, and 9.78x predicted where
    1.18x was real: such a curve is flagged and no speedup is predicted from it."""
    import tinydraft_mlx.programs.check as check

    curve = {1: 2.0, 2: 2.2, 3: 2.5, 4: 113.0, 5: 3.0, 6: 3.2, 7: 3.4, 8: 3.6, 9: 3.8}
    monkeypatch.setattr(check, "target_costs", lambda *a: {"t_1": 2.0, "t_v": curve})
    assert main(["--quick", "--json", str(report_file)]) == 0
    report = json.loads(report_file.read_text())
    draft = report["drafts"][0]
    assert draft["costs"]["rising"] is False
    assert set(draft["predicted_speedup"].values()) == {None}
    out = capsys.readouterr().out
    assert "does not rise with n" in out and "k=1 - /" in out


def test_rising():
    from tinydraft_mlx.programs.check import rising

    assert rising({1: 2.0, 2: 2.1, 3: 2.0, 4: 2.6})  # noise below 20% is a rising curve
    assert not rising({1: 2.0, 2: 2.2, 3: 2.5, 4: 113.0, 5: 3.0})
    assert not rising({1: 5.0, 2: 3.0})


def test_a_quantized_target_gets_its_compute_dtypes_tolerance(demo):
    """A quantized model's weights are uint32: its tolerance comes from what it computes in
    (its scales and the rest), not the float32 default that a uint32 lookup fell back to."""
    import mlx.nn as nn

    from tinydraft_mlx import load_models
    from tinydraft_mlx.programs.check import NEAR_TIE, compute_dtype, is_quantized

    target, _, _ = load_models(None, "none", dtype="float16")
    nn.quantize(target, group_size=64, bits=4)
    assert str(target.model.layers[0].mlp.up_proj.weight.dtype) == "mlx.core.uint32"
    assert is_quantized(target) and compute_dtype(target) == "float16"
    assert NEAR_TIE[compute_dtype(target)] > NEAR_TIE["float32"]
    assert compute_dtype(demo[0]) == "float32" and not is_quantized(demo[0])


def test_a_failure_while_checking_exits_3_not_2(monkeypatch, capsys):
    """2 means bad arguments; the check failing to run is another thing (it said 2 for both)."""
    import tinydraft_mlx.programs.check as check

    def broken(*args, **kwargs):
        raise ValueError("[matmul] shapes (1,3) and (4,5) cannot be multiplied")

    monkeypatch.setattr(check, "greedy_runs", broken)
    assert main(["--quick"]) == 3
    err = capsys.readouterr().err
    assert "error while checking: ValueError: [matmul]" in err and len(err.splitlines()) == 1


def test_the_checks_own_forwards_run_on_the_generation_stream(demo):
    """A forward on the default stream makes a second thread call the BLAS, which slowed every
    figure measured after it (the two-stream trap): the check's own model calls run on the
    generation stream."""
    import mlx.nn as nn

    from tinydraft_mlx.engine.sampling import SamplingParams
    from tinydraft_mlx.programs.check import _first_distributions

    target, draft, tok = demo
    outside = str(mx.default_stream(mx.default_device()))
    seen = []

    class Spy(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner = model

        def __call__(self, *args, **kwargs):
            seen.append(str(mx.default_stream(mx.default_device())))
            return self.inner(*args, **kwargs)

    _first_distributions(Spy(target), Spy(draft), tok.encode("def f(x):"), SamplingParams(1.0))
    assert len(seen) == 2 and outside not in seen


def test_trees_are_checked(report_file, capsys):
    """--tree 8 on the demo pair: exact (greedy identity and the sampling check on trees),
    nothing predicted from a chain's cost model."""
    assert main(["--quick", "--tree", "8", "--json", str(report_file)]) == 0
    report = json.loads(report_file.read_text())
    assert report["settings"]["tree"] == 8 and report["greedy_identical"]
    draft = report["drafts"][0]
    assert draft["greedy"]["compared_tokens"] == 2 * 32 * 4
    assert all(v is None for v in draft["predicted_speedup"].values())
    assert "candidate trees of 8 nodes" in capsys.readouterr().out


def test_a_walk_that_leaves_the_targets_choice_fails_the_greedy_check(
        monkeypatch, report_file, sampling_passes):
    """A tree walk that descends one node past where the target's choice stops it."""
    from tinydraft_mlx.engine.trees import Tree

    walk = Tree.walk

    def one_node_too_far(self, choices, *tests):
        path, tokens = walk(self, choices, *tests)
        children = self.children.get(path[-1])
        if not children:
            return path, tokens
        child = next(iter(children.values()))  # none of them holds the target's choice
        return path + [child], tokens[:-1] + [self.tokens[child], choices[child]]

    monkeypatch.setattr(Tree, "walk", one_node_too_far)
    assert main(["--quick", "--tree", "8", "--json", str(report_file)]) == 1
    assert not json.loads(report_file.read_text())["greedy_identical"]

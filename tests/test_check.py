"""`python -m tinydraft_mlx.check`: passes on the demo pair and the fixtures, and fails when the
acceptance rule is broken, once for each check: a correction sampled from p instead of the
residual max(0, p - q) (the sampling check), and a greedy rule that keeps one draft too many
(the greedy check)."""

import json

import mlx.core as mx
import pytest

import tinydraft_mlx.speculative as spec
from tinydraft_mlx.check import P_FAIL, main
from tinydraft_mlx.rejection import _leading_true, _pad_vocab

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


def one_too_many(target_argmax, draft_tokens):
    """The greedy rule keeping the first rejected draft as well."""
    k = draft_tokens.shape[-1]
    n = _leading_true(draft_tokens.astype(mx.int32) == target_argmax[:, :k].astype(mx.int32))
    n = mx.minimum(n + 1, k)
    return n, mx.take_along_axis(target_argmax, n[:, None], axis=-1)[:, 0].astype(mx.int32)


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


def test_fixtures_with_several_drafts(checkpoints, report_file):
    assert main(["--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"]),
                 "--draft", "prompt-lookup", "--draft", "none", "--quick", "--top-p", "0.9",
                 "--json", str(report_file)]) == 0
    report = json.loads(report_file.read_text())
    assert [d["draft"] for d in report["drafts"]] == [str(checkpoints["draft"]), "prompt-lookup",
                                                      "none"]
    assert [d["plain"] for d in report["drafts"]] == [False, False, True]
    # plain decoding is the baseline, never "recommended with k" on its own noise
    assert report["recommended"]["draft"] != "none" or report["recommended_k"] == 0
    assert report["drafts"][0]["sampling"]["first_token_paths"].keys() == {"accepted",
                                                                          "resampled"}


def test_a_correction_from_p_fails_the_sampling_check(monkeypatch, report_file, capsys):
    monkeypatch.setattr(spec, "speculative_accept", correction_from_p)
    assert main(["--quick", "--json", str(report_file)]) == 1
    report = json.loads(report_file.read_text())
    assert report["greedy_identical"]  # greedy does not use the stochastic rule
    assert report["sampling_p_value"] < P_FAIL
    assert "sampling exactness" in capsys.readouterr().out


def test_one_draft_too_many_fails_the_greedy_check(monkeypatch, report_file, capsys):
    monkeypatch.setattr(spec, "greedy_accept", one_too_many)
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

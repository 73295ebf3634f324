"""k="auto"'s policy file (engine/policy_store.py): what a pair learned is saved when a generation
ends and a new process (here: the in-process pairs forgotten) starts from it; entries of other
models, devices and dtypes are never used; a corrupt or foreign file is ignored and replaced."""

from __future__ import annotations

import json
import logging
import platform
import subprocess

import pytest

from tinydraft_mlx import generate
from tinydraft_mlx.engine import policy as policy_module
from tinydraft_mlx.engine import policy_store
from tinydraft_mlx.engine.policy import shared_policy

pytestmark = pytest.mark.usefixtures("cpu_fp32")
PROMPT = "def parse_args(self, args=None, namespace=None):"
REGIME = (0.0, 1.0, 0, 0.0)


@pytest.fixture
def policy_file(tmp_path, monkeypatch):
    path = tmp_path / "policies.json"
    monkeypatch.setenv(policy_store.ENV, str(path))
    monkeypatch.setattr(policy_module, "_PAIRS", {})  # a process that has learned nothing
    monkeypatch.setattr(policy_store, "_WARNED", set())
    return path


def new_process(monkeypatch) -> None:
    monkeypatch.setattr(policy_module, "_PAIRS", {})


def test_a_new_process_starts_from_what_the_last_one_saved(pair, policy_file, monkeypatch):
    target, draft, tok = pair
    out, stats = generate(target, draft, tok, PROMPT, k="auto", max_tokens=24)
    entries = json.loads(policy_file.read_text())["entries"]
    assert len(entries) == 1
    (key, entry), = entries.items()
    assert json.loads(key)["dtype"] == "float32" and json.loads(key)["device"]
    saved = {int(k): v for k, v in entry["costs"]["1"].items()}  # one sequence's rounds
    assert 0 in saved and entry["regimes"]

    new_process(monkeypatch)
    policy = shared_policy(target, draft)
    costs = policy.round_costs(1)
    assert set(costs.timings) == set(saved)
    for k, values in saved.items():
        assert list(costs.timings[k]) == pytest.approx(values)
    assert policy.acceptance(REGIME).observed > 0  # acceptance too, as a prior
    # and the generation is still exact
    new_process(monkeypatch)
    assert generate(target, draft, tok, PROMPT, k="auto", max_tokens=24)[0] == out


def test_other_models_devices_and_dtypes_never_use_an_entry(pair, load, policy_file,
                                                             monkeypatch):
    target, draft, tok = pair
    generate(target, draft, tok, PROMPT, k="auto", max_tokens=16)
    (key,) = json.loads(policy_file.read_text())["entries"]
    fields = json.loads(key)
    # another draft (same shapes, other weights), another dtype: another key, nothing loaded
    other = load("target", "unrelated")[1]
    half_target = load("target", "draft", dtype="float16")[0]
    for t, d in [(target, other), (half_target, draft), (target, "PromptLookup()")]:
        new_process(monkeypatch)
        assert policy_store.pair_key(t, d) != key
        assert shared_policy(t, d).costs == {}
    # the same pair's entry written for another device or machine is not this one's
    data = json.loads(policy_file.read_text())
    for field, value in [("device", "Device(gpu, 0)"), ("machine", ["elsewhere"]),
                         ("mlx", "0.0.1")]:
        moved = json.dumps({**fields, field: value}, sort_keys=True)
        policy_file.write_text(json.dumps({**data, "entries": {moved: data["entries"][key]}}))
        new_process(monkeypatch)
        assert shared_policy(target, draft).costs == {}


@pytest.mark.parametrize("content", [
    "{not json", "[]", json.dumps({"version": 99, "entries": {}}),
    "ENTRY:" + json.dumps({"costs": {"1": {"0": [-1.0]}}, "regimes": {}}),
    "ENTRY:" + json.dumps({"costs": "nonsense", "regimes": {}}),
    "ENTRY:" + json.dumps({"costs": {"1": {"0": [1.0], "1": [float("nan")]}}, "regimes": {}}),
], ids=["not-json", "not-ours", "other-version", "negative-cost", "bad-entry", "nan-cost"])
def test_a_corrupt_or_foreign_file_is_ignored_and_replaced(pair, policy_file, monkeypatch,
                                                           caplog, content):
    target, draft, tok = pair
    if content.startswith("ENTRY:"):
        key = policy_store.pair_key(target, draft)
        content = json.dumps({"version": policy_store.VERSION,
                              "entries": {key: json.loads(content[6:])}})
    policy_file.write_text(content)
    with caplog.at_level(logging.WARNING, logger="tinydraft_mlx.policy"):
        assert shared_policy(target, draft).costs == {}
        new_process(monkeypatch)
        out, _ = generate(target, draft, tok, PROMPT, k="auto", max_tokens=12)
    assert "ignoring" in caplog.text
    assert out == generate(target, None, tok, PROMPT, max_tokens=12)[0]
    data = json.loads(policy_file.read_text())  # rewritten, whole and ours
    assert data["version"] == policy_store.VERSION and len(data["entries"]) == 1


def test_persistence_can_be_turned_off(pair, tmp_path, monkeypatch):
    target, draft, tok = pair
    monkeypatch.setenv(policy_store.ENV, "off")
    monkeypatch.setattr(policy_module, "_PAIRS", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    generate(target, draft, tok, PROMPT, k="auto", max_tokens=8)
    assert policy_store.policy_path() is None and not list(tmp_path.rglob("*.json"))
    monkeypatch.delenv(policy_store.ENV)
    assert policy_store.policy_path() == tmp_path / "tinydraft-mlx" / "policies.json"


def test_a_pair_key_is_cheap(pair, monkeypatch):
    """The key runs no subprocess (platform.processor() runs `uname -p`: 4.8 ms before a
    process's first token) and fingerprints each model object once."""
    target, draft, tok = pair
    monkeypatch.setattr(policy_store, "_FINGERPRINTS", {})
    key = policy_store.pair_key(target, draft)

    def refused(*args, **kwargs):
        raise AssertionError("a subprocess while keying the pair")

    monkeypatch.setattr(subprocess, "Popen", refused)
    monkeypatch.setattr(platform, "processor", refused)
    flattened = []
    real = policy_store.tree_flatten
    monkeypatch.setattr(policy_store, "tree_flatten",
                        lambda tree: flattened.append(1) or real(tree))
    assert policy_store.fingerprint(target) == json.loads(key)["target"]
    assert policy_store.fingerprint(draft) == json.loads(key)["draft"]
    assert flattened == []  # both were kept from the first key
    assert policy_store.pair_key(target, draft) == key

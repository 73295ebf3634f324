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
from tinydraft_mlx.engine.speculative import decode

pytestmark = pytest.mark.usefixtures("cpu_fp32")
PROMPT = "def parse_args(self, args=None, namespace=None):"
REGIME = (0.0, 1.0, 0, 0.0)


@pytest.fixture
def policy_file(tmp_path, monkeypatch):
    path = tmp_path / "policies.json"
    monkeypatch.setenv(policy_store.ENV, str(path))
    monkeypatch.setattr(policy_module, "_SHARED", {})  # a process that has learned nothing
    monkeypatch.setattr(policy_store, "_WARNED", set())
    return path


def new_process(monkeypatch) -> None:
    monkeypatch.setattr(policy_module, "_SHARED", {})


def test_a_new_process_starts_from_what_the_last_one_saved(pair, policy_file, monkeypatch):
    target, draft, tok = pair
    out, stats = generate(target, draft, tok, PROMPT, k="auto", max_tokens=24)
    entries = json.loads(policy_file.read_text())["entries"]
    assert len(entries) == 1
    (key, entry), = entries.items()
    assert json.loads(key)["dtype"] == "float32" and json.loads(key)["device"]
    saved = {int(k): v for k, v in entry["costs"]["round_seconds"].items()}
    assert 0 in saved and entry["regimes"]

    new_process(monkeypatch)
    policy = shared_policy(target, draft, 0.25, REGIME)
    assert policy.round_seconds == pytest.approx(saved)
    assert sum(policy.accepted) + sum(policy.rejected) > 0  # acceptance too, as a prior
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
        assert shared_policy(t, d, 0.25, REGIME).round_seconds == {}
    # the same pair's entry written for another device or machine is not this one's
    data = json.loads(policy_file.read_text())
    for field, value in [("device", "Device(gpu, 0)"), ("machine", ["elsewhere"]),
                         ("mlx", "0.0.1")]:
        moved = json.dumps({**fields, field: value}, sort_keys=True)
        policy_file.write_text(json.dumps({**data, "entries": {moved: data["entries"][key]}}))
        new_process(monkeypatch)
        assert shared_policy(target, draft, 0.25, REGIME).round_seconds == {}


@pytest.mark.parametrize("content", [
    "{not json", "[]", json.dumps({"version": 99, "entries": {}}),
    "ENTRY:" + json.dumps({"costs": {"round_seconds": {"0": -1.0}, "timed": {"0": 3},
                                     "switch_fit": [0.0] * 5, "switches": 0}, "regimes": {}}),
    "ENTRY:" + json.dumps({"costs": "nonsense", "regimes": {}}),
    "ENTRY:" + json.dumps({"costs": {"round_seconds": {"0": 1.0}, "timed": {"0": 3},
                                     "switch_fit": [0.0] * 5, "switches": 0,
                                     "hope": {"1": -1.5}}, "regimes": {}}),
], ids=["not-json", "not-ours", "other-version", "negative-cost", "bad-entry", "negative-hope"])
def test_a_corrupt_or_foreign_file_is_ignored_and_replaced(pair, policy_file, monkeypatch,
                                                           caplog, content):
    target, draft, tok = pair
    if content.startswith("ENTRY:"):
        key = policy_store.pair_key(target, draft)
        content = json.dumps({"version": policy_store.VERSION,
                              "entries": {key: json.loads(content[6:])}})
    policy_file.write_text(content)
    with caplog.at_level(logging.WARNING, logger="tinydraft_mlx.policy"):
        assert shared_policy(target, draft, 0.25, REGIME).round_seconds == {}
        new_process(monkeypatch)
        out, _ = generate(target, draft, tok, PROMPT, k="auto", max_tokens=12)
    assert "ignoring" in caplog.text
    assert out == generate(target, None, tok, PROMPT, max_tokens=12)[0]
    data = json.loads(policy_file.read_text())  # rewritten, whole and ours
    assert data["version"] == policy_store.VERSION and len(data["entries"]) == 1


def test_persistence_can_be_turned_off(pair, tmp_path, monkeypatch):
    target, draft, tok = pair
    monkeypatch.setenv(policy_store.ENV, "off")
    monkeypatch.setattr(policy_module, "_SHARED", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    generate(target, draft, tok, PROMPT, k="auto", max_tokens=8)
    assert policy_store.policy_path() is None and not list(tmp_path.rglob("*.json"))
    monkeypatch.delenv(policy_store.ENV)
    assert policy_store.policy_path() == tmp_path / "tinydraft-mlx" / "policies.json"


def test_a_generation_reads_the_file_after_its_first_token(pair, policy_file, monkeypatch):
    """k="auto" with a draft model: the first round is plain, so the file's entry (whose key
    fingerprints both models) is read once the first token is out, and still used."""
    target, draft, tok = pair
    prompt = tok.encode(PROMPT)
    want = [t.id for t in decode(target, draft, prompt, k="auto", max_tokens=24)]
    saved = json.loads(policy_file.read_text())
    (entry,) = saved["entries"].values()
    # another process whose file knows costs this one cannot have measured by its second token
    entry["costs"]["round_seconds"]["7"] = 0.123
    entry["costs"]["timed"]["7"] = 5
    policy_file.write_text(json.dumps(saved))
    new_process(monkeypatch)
    reads = []
    real = policy_store.load_entry
    monkeypatch.setattr(policy_store, "load_entry", lambda key: reads.append(key) or real(key))
    tokens = decode(target, draft, prompt, k="auto", max_tokens=24)
    first = next(tokens)
    assert reads == []  # nothing read (nor fingerprinted) before the first token
    rest = list(tokens)
    assert len(reads) == 1
    policy = first.stats.policy
    assert policy.round_seconds[7] == pytest.approx(0.123) and policy.timed[7] == 5
    assert sum(policy.accepted) + sum(policy.rejected) > 0
    assert [first.id] + [t.id for t in rest] == want  # exact either way
    # and what it saves keeps the file's entry
    entry = json.loads(policy_file.read_text())["entries"][reads[0]]
    assert entry["costs"]["round_seconds"]["7"] == pytest.approx(0.123)


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

"""load_models: RoPE base from transformers 5 configs, dtype, tokenizer checks, clear errors."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

from tinydraft_mlx import ModelLoadError, load_models
from tinydraft_mlx.loading import default_draft

PROMPT_IDS = [269, 70, 305, 83, 29, 342, 322, 12, 5, 77]


def test_transformers5_rope_base_is_honoured(checkpoints, oracle):
    config = json.loads((checkpoints["target"] / "config.json").read_text())
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 10000.0
    target, _, _ = load_models(str(checkpoints["target"]), "none")
    expected = oracle.logits(PROMPT_IDS)
    ours = np.array(target(mx.array([PROMPT_IDS]))[0])
    assert np.abs(ours - expected).max() < 1e-4
    # what plain mlx_lm.load gives for the same checkpoint: the trap this guards against
    naive, _ = mlx_lm_load(str(checkpoints["target"]))
    assert np.abs(np.array(naive(mx.array([PROMPT_IDS]))[0]) - expected).max() > 1e-2


def test_dtype_default_and_override(checkpoints):
    target, draft, _ = load_models(str(checkpoints["target"]), str(checkpoints["draft"]))
    assert target.model.embed_tokens.weight.dtype == mx.float32  # CPU backend default
    assert draft.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    half, _, _ = load_models(str(checkpoints["target"]), "none", dtype="float16")
    assert half.model.embed_tokens.weight.dtype == mx.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_models(str(checkpoints["target"]), "none", dtype="int8")


def test_draft_none_string_loads_no_draft(checkpoints):
    _, draft, tok = load_models(str(checkpoints["target"]), "none")
    assert draft is None and tok.eos_token_id is not None


def test_mismatched_tokenizers_are_refused(checkpoints):
    with pytest.raises(ModelLoadError, match="tokenizer differs"):
        load_models(str(checkpoints["target"]), str(checkpoints["other_tokenizer"]))


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_models(str(tmp_path / "nope"), "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_models(str(tmp_path / "empty"), "none")


def test_uncached_hub_id_offline_is_one_sentence(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as err:
        load_models("tinydraft-test/Qwen2.5-does-not-exist", "none")
    message = str(err.value)
    assert "\n" not in message and "not in the local Hugging Face cache" in message
    assert err.value.__cause__ is None  # no chained traceback from deep inside


@pytest.mark.parametrize(
    "target, draft",
    [
        ("mlx-community/Qwen2.5-3B", "mlx-community/Qwen2.5-0.5B"),
        ("mlx-community/Qwen2.5-7B-Instruct-4bit", "mlx-community/Qwen2.5-0.5B-Instruct-4bit"),
        ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
        ("mlx-community/Qwen2.5-0.5B-Instruct", None),
        ("meta-llama/Llama-3.2-1B", None),
    ],
)
def test_default_draft_for_qwen25(target, draft):
    assert default_draft(target) == draft

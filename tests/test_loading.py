"""load_models: RoPE base from transformers 5 configs, dtype per device, lazy casting, default
drafts, tokenizer checks, clear errors."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load

from tinydraft_mlx import ModelLoadError, load_models
from tinydraft_mlx.engine.backend import resolve_dtype
from tinydraft_mlx.generation.loading import default_draft, load_model

PROMPT_IDS = [269, 70, 305, 83, 29, 342, 322, 12, 5, 77]


@pytest.mark.usefixtures("cpu_fp32")
def test_transformers5_rope_base_is_honoured(checkpoints, oracle, load):
    config = json.loads((checkpoints["target"] / "config.json").read_text())
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 10000.0
    target, _, _ = load("target")
    expected = oracle.logits(PROMPT_IDS)
    ours = np.array(target(mx.array([PROMPT_IDS]))[0])
    assert np.abs(ours - expected).max() < 1e-4
    # what plain mlx_lm.load gives for the same checkpoint: the trap this guards against
    naive, _ = mlx_lm_load(str(checkpoints["target"]))
    assert np.abs(np.array(naive(mx.array([PROMPT_IDS]))[0]) - expected).max() > 1e-2


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A bfloat16 checkpoint (as Qwen2.5's are) with 4M weights: big enough to see a second copy
    of the weights in the peak memory."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.fixtures import build_tokenizer

    directory = tmp_path_factory.mktemp("bf16")
    build_tokenizer(directory)
    config = Qwen2Config(vocab_size=448, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def test_default_dtype_per_device():
    assert resolve_dtype(None, "cpu") == mx.float32  # BLAS-backed fp32 matmuls on the CPU
    assert resolve_dtype(None, "gpu") is None  # a GPU keeps the checkpoint's own dtype
    assert resolve_dtype("float16", "gpu") == mx.float16
    assert resolve_dtype(mx.bfloat16, "cpu") == mx.bfloat16


def test_dtype_default_and_override(bf16_checkpoint):
    """On the CPU a bf16 checkpoint becomes float32; on a GPU it stays bf16 (as mlx-lm)."""
    model, _ = load_model(bf16_checkpoint)
    expected = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    assert {w.dtype for _, w in tree_flatten(model.parameters())} == {expected}
    half, _ = load_model(bf16_checkpoint, "float16")
    assert {w.dtype for _, w in tree_flatten(half.parameters())} == {mx.float16}
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_models(str(bf16_checkpoint), "none", dtype="int8")


def test_cast_never_holds_two_copies(bf16_checkpoint):
    """Casting bf16 weights to float32 at load: the peak memory stays within the float32 weights
    plus a few stored tensors (materialising all bf16 weights first adds half again: measured
    +8.3 MB here against a bound of +2.1 MB)."""
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()  # other tests' models, alive in this session
    model, _ = load_model(bf16_checkpoint, "float32")
    weights = [w for _, w in tree_flatten(model.parameters())]
    total = sum(w.nbytes for w in weights)
    largest_stored = max(w.size for w in weights) * 2  # bf16
    assert total > 15e6
    peak = mx.get_peak_memory() - before
    assert peak <= total + 4 * largest_stored, (peak, total)


def test_draft_none_string_loads_no_draft(load):
    _, draft, tok = load("target", "none")
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
    # the reason is whole: it was cut mid-sentence ("... To enable repo look-ups a)")
    assert "(HF_HUB_OFFLINE is set, so it was not looked up: unset it to download it); a local " \
        "checkpoint directory works offline" in message


def test_first_sentence_is_never_cut_mid_word():
    from tinydraft_mlx.generation.loading import _first_sentence

    assert _first_sentence("Repo not found.  Check the id.\nMore") == "Repo not found."
    long = "word " * 100
    cut = _first_sentence(long, limit=50)
    assert cut.endswith("word ...") and len(cut) <= 54


@pytest.mark.parametrize(
    "target, draft",
    [
        ("mlx-community/Qwen2.5-3B", "mlx-community/Qwen2.5-0.5B"),
        ("mlx-community/Qwen2.5-7B-Instruct-4bit", "mlx-community/Qwen2.5-0.5B-Instruct-4bit"),
        ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
        ("mlx-community/Qwen2.5-0.5B-Instruct", None),
        ("meta-llama/Llama-3.2-1B", None),
        ("mlx-community/Qwen3-8B-4bit", "mlx-community/Qwen3-0.6B-4bit"),
        ("mlx-community/Qwen3-30B-A3B-Instruct-2507-4bit", "mlx-community/Qwen3-0.6B-4bit"),
        ("Qwen/Qwen3-0.6B", None),
        ("mlx-community/Meta-Llama-3.1-8B-Instruct-4bit",
         "mlx-community/Llama-3.2-1B-Instruct-4bit"),
        ("meta-llama/Llama-3.2-3B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
        ("mlx-community/Meta-Llama-3-8B-Instruct-4bit", None),  # Llama 3.0: other special tokens
        ("mlx-community/gemma-3-12b-it-qat-4bit", "mlx-community/gemma-3-1b-it-qat-4bit"),
        ("mlx-community/Mistral-7B-Instruct-v0.3-4bit", None),  # no small sibling shares it
        ("mlx-community/Qwen3.5-9B-4bit", "mlx-community/Qwen3.5-0.8B-4bit"),
        ("mlx-community/Qwen3.5-35B-A3B-8bit", "mlx-community/Qwen3.5-0.8B-8bit"),
        ("Qwen/Qwen3.5-0.8B", None),
        ("mlx-community/Qwen3-Next-80B-A3B-Instruct-4bit", None),  # no small sibling
    ],
)
def test_default_draft_per_family(target, draft):
    assert default_draft(target) == draft


def test_default_draft_for_a_local_directory(tmp_path, monkeypatch):
    """A relative local path such as models/Qwen2.5-7B is not a hub id: its default draft is the
    0.5B sibling directory when there is one, else none (never "models/Qwen2.5-0.5B" looked up
    on the hub)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "Qwen2.5-7B-Instruct").mkdir(parents=True)
    assert default_draft("models/Qwen2.5-7B-Instruct") is None
    (tmp_path / "models" / "Qwen2.5-0.5B-Instruct").mkdir()
    assert default_draft("models/Qwen2.5-7B-Instruct") == "models/Qwen2.5-0.5B-Instruct"
    assert default_draft("models/Qwen2.5-0.5B-Instruct") is None
    (tmp_path / "models" / "Qwen3-8B").mkdir()
    assert default_draft("models/Qwen3-8B") is None
    (tmp_path / "models" / "Qwen3-0.6B").mkdir()
    assert default_draft("models/Qwen3-8B") == "models/Qwen3-0.6B"


def test_the_demo_targets_directory_gets_the_demo_draft(tmp_path, monkeypatch):
    """Naming the bundled demo target by its directory (absolute, or relative) picks the demo
    draft, as loading it by default does; another directory gets none."""
    import os

    from tinydraft_mlx.generation.loading import DEMO_DIR, default_draft

    assert default_draft(None) == str(DEMO_DIR / "draft")
    assert default_draft(str(DEMO_DIR / "target")) == str(DEMO_DIR / "draft")
    monkeypatch.chdir(DEMO_DIR)
    assert default_draft(os.path.join(".", "target")) == str(DEMO_DIR / "draft")
    assert default_draft(str(tmp_path)) is None

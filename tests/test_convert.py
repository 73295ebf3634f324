"""`python -m tinydraft_mlx.convert` (tinydraft_mlx/programs/convert.py): a conversion that keeps
the checkpoint's MTP layer, and `--mtp-from` that adds one to an existing conversion.

On tiny checkpoints with hub-named MTP tensors (tests/fixtures.py; Qwen3.5 in the hub's nested
vision-language layout (converted through our config normalisation), Qwen3-Next flat with
the hub's top-level RoPE and layer keys): original -> 4-bit body
with the MTP layer quantized alike -> mlx-lm loads the body as any conversion, and
`generate(draft="mtp")` on the converted target == its plain greedy decoding, drafts accepted;
the converted layer's weights, dequantized, == the original tensors to 4-bit rounding (an
independent check of which tensor went where) and, kept in float, equal them exactly;
`--mtp-from` accepts the layer of the body's own original and refuses, in one line, another
checkpoint's (other embeddings: the fingerprint; other shapes) and a checkpoint without one;
a failed conversion leaves nothing behind."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.fixtures import FIRST_ATTENTION, build_hybrid_pair, damp_layers, write_mtp
from tests.hub_layouts import nest_as_hub
from tinydraft_mlx import generate, load_models
from tinydraft_mlx.programs.convert import main

pytestmark = pytest.mark.usefixtures("cpu_fp32")

PROMPT = "def parse_args(self, args=None, namespace=None):\n    if args is None:"
FAMILIES = ("qwen3_5", "qwen3_next")
Q4 = ["-q", "--q-bits", "4", "--q-group-size", "32"]


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """family -> (original checkpoint with MTP tensors, its MTP tensors as written)."""
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for family in FAMILIES:
        target_dir, _ = build_hybrid_pair(root, family)
        damp_layers(target_dir, 0.02, FIRST_ATTENTION[family])
        tensors = write_mtp(target_dir, family, into="model.safetensors")
        if family == "qwen3_5":  # as the hub ships Qwen3.5: a vision-language layout
            target_dir = nest_as_hub(target_dir, root / "hub", family)
        else:  # the top-level keys the hub's Qwen3-Next config carries (mlx-lm reads them)
            config = json.loads((target_dir / "config.json").read_text())
            rope = config["rope_parameters"]
            config.update(rope_theta=rope["rope_theta"],
                          partial_rotary_factor=rope["partial_rotary_factor"],
                          full_attention_interval=config["layer_types"].index(
                              "full_attention") + 1)
            (target_dir / "config.json").write_text(json.dumps(config))
        out[family] = (target_dir, tensors)
    return out


def _dequantized(layer) -> np.ndarray:
    return np.array(mx.dequantize(layer.weight, layer.scales, layer.biases,
                                  group_size=layer.group_size, bits=layer.bits))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_quantized_conversion_keeps_the_mtp_layer(originals, family, tmp_path):
    from mlx_lm import load

    original, tensors = originals[family]
    out = tmp_path / "q4"
    assert main(["--hf-path", str(original), "--mlx-path", str(out), *Q4]) == 0
    assert (out / "mtp.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing partial
    body, _ = load(str(out))  # mlx-lm reads it as any conversion (the MTP file unread)
    assert isinstance(body.language_model.model.embed_tokens
                      if hasattr(body, "language_model") else body.model.embed_tokens,
                      nn.QuantizedEmbedding)
    target, head, tok = load_models(str(out), "mtp", dtype="float32")
    assert isinstance(head.fc, nn.QuantizedLinear) and head.fc.bits == 4
    fc = tensors["mtp.fc.weight"]
    assert np.abs(_dequantized(head.fc) - fc).max() < 0.2 * np.abs(fc).max()
    name = "mtp.layers.0.self_attn.q_proj.weight"
    q = tensors[name]
    assert np.abs(_dequantized(head.layers[0].self_attn.q_proj) - q).max() < 0.2 * np.abs(q).max()
    ids = tok.encode(PROMPT)
    plain, _ = generate(target, None, tok, ids, max_tokens=24)
    drafted, stats = generate(target, "mtp", tok, ids, k=3, max_tokens=24)
    assert drafted == plain and stats.accepted > 0 and stats.drafted > stats.accepted


def test_the_mtp_layer_may_stay_in_its_float_dtype(originals, tmp_path):
    original, tensors = originals["qwen3_next"]
    out = tmp_path / "q4f"
    assert main(["--hf-path", str(original), "--mlx-path", str(out), *Q4,
                 "--mtp-dtype", "original"]) == 0
    _, metadata = mx.load(str(out / "mtp.safetensors"), return_metadata=True)
    assert json.loads(metadata["quantization"]) == {}
    target, head, tok = load_models(str(out), "mtp", dtype="float32")
    assert type(head.fc) is nn.Linear
    np.testing.assert_array_equal(np.array(head.fc.weight), tensors["mtp.fc.weight"])
    ids = tok.encode(PROMPT)
    assert generate(target, "mtp", tok, ids, k=2, max_tokens=16)[0] == \
        generate(target, None, tok, ids, max_tokens=16)[0]


def test_mtp_from_adds_the_layer_of_the_bodys_own_checkpoint_only(originals, tmp_path, capsys):
    """A body converted by mlx-lm alone (as mlx-community's conversions are: no MTP tensors);
    --mtp-from its original adds the layer; another checkpoint's layer is refused in one line:
    the same shapes with other embeddings (the fingerprint), other shapes, no MTP tensors."""
    from mlx_lm.convert import convert

    original, _ = originals["qwen3_next"]
    body = tmp_path / "community-4bit"
    convert(str(original), str(body), quantize=True, q_bits=4, q_group_size=32)
    assert not (body / "mtp.safetensors").exists()
    with pytest.raises(ValueError, match="has no MTP tensors"):
        load_models(str(body), "mtp")
    # another checkpoint of the same shapes: its embeddings differ
    other = tmp_path / "other"
    other.mkdir()
    for item in original.iterdir():
        if item.name != "model.safetensors":
            (other / item.name).write_bytes(item.read_bytes())
    weights = load_file(str(original / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * 1.5
    save_file(weights, str(other / "model.safetensors"))
    smaller = build_hybrid_pair(tmp_path / "small", "qwen3_5")[1]  # a 2-layer Qwen3.5 with
    write_mtp(smaller, "qwen3_5", into="model.safetensors")  # a narrower vocabulary
    bare = build_hybrid_pair(tmp_path / "bare", "qwen3_next")[0]  # no MTP tensors
    for source, words in ((other, "does not belong to this body: its embeddings differ"),
                          (smaller, "does not belong to this body"),
                          (bare, "has no MTP tensors")):
        capsys.readouterr()
        assert main(["--mlx-path", str(body), "--mtp-from", str(source)]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err, err
        assert not (body / "mtp.safetensors").exists()
        assert not [p for p in body.iterdir() if p.name.startswith(".")]
    assert main(["--mlx-path", str(body), "--mtp-from", str(original)]) == 0
    target, head, tok = load_models(str(body), "mtp", dtype="float32")
    assert isinstance(head.fc, nn.QuantizedLinear)
    ids = tok.encode(PROMPT)
    drafted, stats = generate(target, "mtp", tok, ids, k=3, max_tokens=24)
    assert drafted == generate(target, None, tok, ids, max_tokens=24)[0]
    assert stats.accepted > 0


def test_refusals_are_one_line_and_a_failure_leaves_nothing(originals, tmp_path, capsys,
                                                           monkeypatch):
    original, _ = originals["qwen3_next"]
    taken = tmp_path / "taken"
    taken.mkdir()
    for argv, words in (([], "--hf-path is required"),
                        (["--hf-path", str(tmp_path / "none"), "--mlx-path",
                          str(tmp_path / "x")], "is not a checkpoint directory"),
                        (["--hf-path", str(original), "--mlx-path", str(taken)], "exists"),
                        (["--mlx-path", str(tmp_path / "none"), "--mtp-from", str(original)],
                         "is not a conversion")):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tinydraft-mlx convert: error:") and words in err, err
        assert "\n" not in err
    import tinydraft_mlx.engine.drafters.mtp as mtp

    def broken(*_, **__):
        raise mtp.MtpError("the MTP tensors do not fit (injected)")

    monkeypatch.setattr(mtp, "build_head", broken)
    assert main(["--hf-path", str(original), "--mlx-path", str(tmp_path / "out"), *Q4]) == 2
    assert "injected" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_a_checkpoint_without_an_mtp_layer_converts_its_body_alone(tmp_path, capsys):
    """As transformers 5 saved it (its RoPE keys under rope_parameters: converted through the
    loader's config normalisation, which the conversion keeps for mlx-lm)."""
    from mlx_lm import load

    bare, _ = build_hybrid_pair(tmp_path, "qwen3_next")
    out = tmp_path / "bare-4bit"
    assert main(["--hf-path", str(bare), "--mlx-path", str(out), *Q4]) == 0
    assert "has no MTP tensors: the body alone" in capsys.readouterr().out
    assert not (out / "mtp.safetensors").exists()
    assert "rope_theta" in json.loads((out / "config.json").read_text())
    model, _ = load(str(out))
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

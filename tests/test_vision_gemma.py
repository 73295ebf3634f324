"""Gemma 3 targets that see images: mlx-vlm's prefill with Gemma 3's image attention (each image
position sees its whole image, as transformers' `token_type_ids` mask has it), then the engine
decodes on mlx-lm's Gemma 3 (sliding-window layers beside full attention).

On a tiny Gemma 3 vision-language checkpoint built at test time in the hub's layout
(tests/hub_layouts.build_gemma_vision), against transformers' Gemma 3 with its vision tower
(float32, image positions marked by `token_type_ids`):
- greedy, plain and prompt lookup: the oracle's tokens, each token's log-probabilities within
  2e-4 of the oracle's; the language model's weights are held once;
- the control: the prefill with the image attending causally (mlx-vlm's own rule) puts the log-
  probabilities after the prompt more than 1e-2 from the oracle's;
- text after the image running far past the sliding window (the target's own prefill) ==
  the oracle; an image past the window is refused in one line.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from tests.fixtures import build_family_pair
from tests.hub_layouts import build_gemma_vision
from tests.reference import log_softmax
from tinydraft_mlx import load_models, stream_generate
from tinydraft_mlx.generation.api import vision_prefill
from tinydraft_mlx.vision import vision_of

pytestmark = pytest.mark.usefixtures("cpu_fp32")

NEW = 12
PROMPT = "def parse(self, x):\n    <start_of_image> return"


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(target with its vision side, tokenizer, an image, the prompt's ids, the bound oracle)."""
    from tests.oracle import VisionOracle

    root = tmp_path_factory.mktemp("gemma_vision")
    target_dir, _ = build_family_pair(root, "gemma3")
    directory = build_gemma_vision(root, target_dir)
    target, _, tok = load_models(str(directory), "none", dtype="float32")
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3),
                                                                dtype=np.uint8))
    own = vision_prefill(target, PROMPT, [picture])
    oracle = VisionOracle(directory, vision_of(target).image_token_id, marks="token_type_ids")
    bound = oracle.bind({"pixel_values": own.prompt.inputs["pixel_values"]})
    return target, tok, picture, own.prompt.ids, bound


@pytest.mark.parametrize("drafter", [None, "prompt-lookup"])
def test_greedy_and_log_probabilities_equal_the_oracle(gemma, drafter):
    target, tok, picture, ids, oracle = gemma
    greedy, margin = oracle.greedy(ids, NEW)
    assert margin > 1e-3, margin
    out = list(stream_generate(target, drafter, tok, PROMPT, images=[picture], max_tokens=NEW,
                               k=3))
    assert [r.token for r in out] == greedy
    want = log_softmax(oracle.logits(ids + greedy)[len(ids) - 1 : -1])
    got = np.stack([np.array(r.logprobs.astype(mx.float32)) for r in out])
    assert np.abs(got - want[:, : got.shape[1]]).max() < 2e-4
    vision = vision_of(target)
    assert vision.shared == vision.total > 0


def test_a_causal_image_leaves_the_oracle(gemma, monkeypatch):
    import tinydraft_mlx.vision.prefill as prefill

    target, tok, picture, ids, oracle = gemma
    monkeypatch.setattr(prefill, "WHOLE_IMAGE", ())
    out = list(stream_generate(target, None, tok, PROMPT, images=[picture], max_tokens=2))
    want = log_softmax(oracle.logits(ids)[-1])
    got = np.array(out[0].logprobs.astype(mx.float32))
    assert np.abs(got - want[: got.shape[0]]).max() > 1e-2


def test_text_past_the_window_after_the_image_runs_and_an_image_past_it_is_refused(gemma):
    """mlx-vlm runs the prompt to the end of its image, the target the text after it (its own
    sliding windows): a prompt whose text runs far past the window after the image equals the
    oracle; an image past the window is refused in one line before any work."""
    target, tok, picture, _, _ = gemma
    long = PROMPT + "\n    x = 1" * 60
    own = vision_prefill(target, long, [picture])
    assert len(own.prompt.ids) > 2 * 128 > own.prompt.positions[-1]
    oracle = gemma[4]
    greedy, _ = oracle.greedy(own.prompt.ids, 4)
    out = list(stream_generate(target, "prompt-lookup", tok, long, images=[picture],
                               max_tokens=4, k=2))
    assert [r.token for r in out] == greedy
    want = log_softmax(oracle.logits(own.prompt.ids)[-1])
    got = np.array(out[0].logprobs.astype(mx.float32))
    assert np.abs(got - want[: got.shape[0]]).max() < 2e-4
    late = "x = 1\n" * 60 + PROMPT
    with pytest.raises(ValueError) as err:  # before any work
        stream_generate(target, None, tok, late, images=[picture], max_tokens=2)
    assert "past the sliding window of 128" in str(err.value) and "\n" not in str(err.value)


def test_a_tied_target_shares_its_embeddings_with_mlx_vlms_head():
    """mlx-vlm's Gemma 3 language model keeps an LM head where mlx-lm's ties it to the
    embeddings: the head takes the embeddings' arrays; a norm that differs shares nothing."""
    import mlx.nn as nn

    from tinydraft_mlx.vision.part import _share

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(10, 4)
            self.norm = nn.RMSNorm(4)

    class Ours(nn.Module):  # mlx-lm's shape: language_model.model.*, no head
        def __init__(self):
            super().__init__()
            self.language_model = nn.Module()
            self.language_model.model = Body()

    class Theirs(nn.Module):  # mlx-vlm's: model.*, lm_head
        def __init__(self):
            super().__init__()
            self.model = Body()
            self.lm_head = nn.Linear(4, 10, bias=False)

    ours, theirs = Ours(), Theirs()
    assert _share(ours, theirs) == (3, 3)
    embed = ours.language_model.model.embed_tokens.weight
    assert theirs.lm_head.weight is embed and theirs.model.embed_tokens.weight is embed
    other = Theirs()
    other.model.norm.weight = other.model.norm.weight + 1
    before = other.lm_head.weight
    assert _share(ours, other) == (0, 3) and other.lm_head.weight is before

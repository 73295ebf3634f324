"""Targets that see images (tinydraft_mlx/vision): mlx-vlm prefills a prompt with images, the
engine decodes it with any drafter.

On a tiny Qwen3.5 vision-language checkpoint built at test time in the hub's layout
(tests/hub_layouts.build_vision: the hybrid Qwen3.5 text fixture, its MTP layer, a one-block
vision tower, multimodal RoPE), against two independent references: transformers' own
Qwen3.5 (the oracle, float32, with the processor's pixel inputs) and mlx-vlm's own generation
(its own copy of the weights):
- greedy: plain decoding and every drafter that shares the tokenizer (a draft model, prompt
  lookup, the checkpoint's MTP layer, a DFlash block drafter, its candidate trees) == mlx-vlm's
  greedy output == the oracle's, for one image
  and for two images of different sizes between text (text after an image runs at positions
  moved by the image's `rope_deltas`); each token's log-probabilities == the oracle's;
- the control: with the keys left where mlx-vlm wrote them (no move), the log-probabilities
  leave the oracle's;
- the handed-over cache == mlx-vlm's own after its prefill (recurrent windows and states equal,
  values equal, keys equal once moved back);
- sampled: the first two tokens of draft-model rows inside batches that text rows join ==
  the oracle's exact joint (chi-square, the suite's bound);
- batched with text-only rows: each row == alone; prompt caches keyed by the image (another
  image reuses nothing of it, a conversation's next turn reuses the image);
- the states a head reads, captured from mlx-vlm's prefill == the oracle's hidden states;
- the server (OpenAI image_url data URLs, Anthropic base64 image blocks) and the CLI (--image)
  reply as the library does;
- refusals in one line; without mlx-vlm the package loads and generates text, images refused.
"""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from tests.fixtures import (
    FIRST_ATTENTION,
    build_hybrid_pair,
    damp_layers,
    write_dflash,
    write_mtp,
)
from tests.hub_layouts import build_vision
from tests.reference import check_first_two_in_batches, log_softmax, two_step_joint
from tinydraft_mlx import (
    BatchDecoder,
    PromptCache,
    SamplingParams,
    batch_generate,
    generate,
    load_models,
    stream_generate,
)
from tinydraft_mlx.generation.api import vision_prefill
from tinydraft_mlx.generation.loading import ModelLoadError, load_draft, load_eagle
from tinydraft_mlx.vision import VisionError, vision_of

pytestmark = pytest.mark.usefixtures("cpu_fp32")

NEW = 16
IMAGE_TOKEN = "<|image_pad|>"


def _picture(seed: int, height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


ONE = [{"role": "user", "content": [{"type": "image"},
                                    {"type": "text", "text": "def parse(self, x):"}]}]
TWO = [{"role": "user", "content": [
    {"type": "text", "text": "compare "}, {"type": "image"}, {"type": "text", "text": " with"},
    {"type": "image"}, {"type": "text", "text": " return"}]}]


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """(target with its vision side and MTP head, MTP head, draft model, tokenizer, images,
    mlx-vlm's own model and processor, the oracle, the checkpoint directory)."""
    import mlx_vlm.utils as vlm

    from tests.oracle import VisionOracle

    root = tmp_path_factory.mktemp("vision")
    target_dir, draft_dir = build_hybrid_pair(root, "qwen3_5")
    for directory in (target_dir, draft_dir):  # the draft copies the target's first layers
        damp_layers(directory, 0.02, FIRST_ATTENTION["qwen3_5"])
    mtp = write_mtp(target_dir, "qwen3_5", into="mtp.safetensors")
    directory, draft_dir = build_vision(root, target_dir, draft_dir, mtp)
    target, head, tok = load_models(str(directory), "mtp", dtype="float32")
    draft = load_draft(str(draft_dir), tok, dtype="float32")
    block = load_eagle(target, write_dflash(directory, root / "dflash", steps=20))
    images = [_picture(0, 48, 64), _picture(1, 64, 32), _picture(2, 48, 64)]
    model = vlm.load_model(directory)
    processor = vlm.load_processor(directory)
    oracle = VisionOracle(directory, vision_of(target).image_token_id)
    return dict(target=target, head=head, draft=draft, block=block, tok=tok, images=images,
                vlm=model,
                processor=processor, oracle=oracle, directory=directory)


def _inputs(seen, messages, images):
    from mlx_vlm.utils import prepare_inputs

    text = seen["processor"].tokenizer.apply_chat_template(messages, tokenize=False,
                                                           add_generation_prompt=True)
    return prepare_inputs(seen["processor"], images=images, prompts=[text])


def _mlx_vlm_greedy(seen, messages, images, n: int = NEW) -> list[int]:
    """mlx-vlm's own greedy generation on its own copy of the weights."""
    from mlx_vlm.generate.ar import generate_step

    inputs = _inputs(seen, messages, images)
    extra = {k: v for k, v in inputs.items()
             if k not in ("input_ids", "pixel_values", "attention_mask")}
    steps = generate_step(inputs["input_ids"], seen["vlm"], inputs["pixel_values"], None,
                          temperature=0.0, **extra)
    return [int(token) for (token, _), _ in zip(steps, range(n))]


def _bound_oracle(seen, messages, images):
    inputs = _inputs(seen, messages, images)
    ids = [int(i) for i in np.array(inputs["input_ids"][0])]
    pixels = {k: inputs[k] for k in ("pixel_values", "image_grid_thw")}
    return ids, seen["oracle"].bind(pixels)


CASES = [(ONE, [0]), (TWO, [0, 1])]


@pytest.fixture(scope="module")
def references(seen):
    """Per case: (prompt ids, the oracle's greedy tokens, the bound oracle), mlx-vlm's greedy
    asserted equal to the oracle's."""
    out = []
    for messages, which in CASES:
        images = [seen["images"][j] for j in which]
        ids, oracle = _bound_oracle(seen, messages, images)
        greedy, margin = oracle.greedy(ids, NEW)
        assert margin > 1e-3, margin
        assert _mlx_vlm_greedy(seen, messages, images) == greedy
        out.append((ids, greedy, oracle))
    return out


def _drafter(seen, name: str):
    return {"plain": None, "model": seen["draft"], "lookup": "prompt-lookup",
            "mtp": seen["head"], "dflash": seen["block"], "dflash-tree": seen["block"]}[name]


@pytest.mark.parametrize("drafter", ["plain", "model", "lookup", "mtp", "dflash", "dflash-tree"])
@pytest.mark.parametrize("case", [0, 1])
def test_greedy_equals_mlx_vlm_and_the_oracle(seen, references, drafter, case):
    messages, which = CASES[case]
    images = [seen["images"][j] for j in which]
    ids, greedy, oracle = references[case]
    tree = 8 if drafter == "dflash-tree" else None
    out = list(stream_generate(seen["target"], _drafter(seen, drafter), seen["tok"], messages,
                               images=images, max_tokens=NEW, k=3, tree=tree))
    assert [r.token for r in out] == greedy
    assert out[-1].stats.prompt_tokens == len(ids)
    if drafter in ("model", "mtp"):
        assert out[-1].stats.accepted > 0, out[-1].stats
    want = log_softmax(oracle.logits(ids + greedy)[len(ids) - 1 : -1])
    got = np.stack([np.array(r.logprobs.astype(mx.float32)) for r in out])
    assert np.abs(got - want[:, : got.shape[1]]).max() < 2e-4


def test_keys_not_moved_leave_the_oracle(seen, references, monkeypatch):
    """The control: text after two images runs at moved positions (rope_deltas); keys left
    where mlx-vlm wrote them put every distance to the prompt off by that much."""
    import tinydraft_mlx.vision.prefill as prefill

    monkeypatch.setattr(prefill, "_rotate", lambda keys, rope, offset: keys)
    ids, greedy, oracle = references[1]
    images = [seen["images"][0], seen["images"][1]]
    out = list(stream_generate(seen["target"], None, seen["tok"], TWO, images=images,
                               max_tokens=4))
    want = log_softmax(oracle.logits(ids)[-1])
    got = np.array(out[0].logprobs.astype(mx.float32))
    assert np.abs(got - want[: got.shape[0]]).max() > 1e-3


def test_the_handed_cache_is_mlx_vlms_own(seen):
    """After our prefill of two images (mlx-vlm's part: to the end of the last image): every
    recurrent layer's window and state == mlx-vlm's cache after its own prefill; values equal;
    keys equal once moved back by rope_deltas."""
    from mlx_vlm.models.cache import make_prompt_cache

    from tinydraft_mlx.engine.cache import make_cache
    from tinydraft_mlx.engine.cache.recurrent import RecurrentCache
    from tinydraft_mlx.engine.hidden import body

    target = seen["target"]
    images = [seen["images"][0], seen["images"][1]]
    own = vision_prefill(target, TWO, images)
    ours = make_cache(target, None, 4)
    n = own.prefill(target, ours, len(own.prompt.ids) - 1)  # to the end of the last image
    assert n == own.prompt.positions[-1] + 1
    inputs = _inputs(seen, TWO, images)
    model = seen["vlm"]
    features = model.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"],
                                          image_grid_thw=inputs["image_grid_thw"])
    theirs = make_prompt_cache(model.language_model)
    model.language_model(inputs["input_ids"][:, :n], inputs_embeds=features.inputs_embeds[:, :n],
                         cache=theirs, position_ids=features.position_ids[..., :n],
                         rope_deltas=features.rope_deltas)
    shift = int(features.rope_deltas.item())
    assert shift < 0
    layers = body(target).layers
    for i, (mine, other) in enumerate(zip(ours, theirs)):
        if isinstance(mine, RecurrentCache):
            assert mine.offset == n
            for a, b in zip(mine.cache, other.cache):
                assert np.array_equal(np.array(a), np.array(b)), i
            continue
        keys, values = (a[..., :n, :] for a in mine.state[:2])
        k, v = other.state[:2]
        assert mine.offset == n and np.array_equal(np.array(values), np.array(v))
        back = layers[i].self_attn.rope(keys.reshape(1, -1, 1, keys.shape[-1]), offset=shift)
        assert np.abs(np.array(back.reshape(k.shape)) - np.array(k)).max() < 1e-5


def test_the_language_model_weights_are_held_once(seen):
    """mlx-vlm's language model reads the target's buffers (after generations too: a compiled
    step hands the model new array objects over the same memory)."""
    from mlx.utils import tree_flatten

    def buffer(array):
        return np.asarray(array).__array_interface__["data"][0]

    generate(seen["target"], None, seen["tok"], "def main():", max_tokens=4)
    vision = vision_of(seen["target"])
    assert vision.shared == vision.total > 0
    ours = dict(tree_flatten(seen["target"].parameters()))
    theirs = tree_flatten(vision.model.language_model.parameters())
    assert all(buffer(array) == buffer(ours[f"language_model.{name}"])
               for name, array in theirs)


def test_sampled_first_two_tokens_inside_batches_with_text_rows(seen, references):
    """Draft-model rows (T = 1, top-k 20, k = 2) on the one-image prompt, 200 in batches that
    plain and lookup text rows join: the first two tokens against the oracle's exact joint (and
    not the joint at T = 0.7). (Top-k keeps the image token, which the oracle cannot score
    after the prompt, out of the joint. Against the T = 0.7 joint 200 rows expect a statistic of
    83, the bound being 27.)"""
    ids, _, oracle = references[0]
    exact = two_step_joint(oracle.logits, ids, temperature=1.0, top_k=20)
    wrong = two_step_joint(oracle.logits, ids, temperature=0.7, top_k=20)
    own = vision_prefill(seen["target"], ONE, [seen["images"][0]])
    tok = seen["tok"]
    texts = [tok.encode("def main():"), tok.encode("import json")]
    companions = [(SamplingParams(0.9), "prompt-lookup", 2), (SamplingParams(), None, 0)]
    check_first_two_in_batches(lambda: BatchDecoder(seen["target"], seen["draft"]), ids,
                               "model", SamplingParams(1.0, top_k=20), companions, texts, exact,
                               wrong,
                               batches=2, rows=100, every=50, prefill=own)


def test_batched_with_text_rows_each_row_as_alone(seen, references):
    tok, target = seen["tok"], seen["target"]
    images = seen["images"]
    prompts = [ONE, "def main():", TWO]
    given = [[images[0]], None, [images[0], images[1]]]
    out = batch_generate(target, seen["draft"], tok, prompts, images=given, max_tokens=NEW, k=2)
    assert out[0][0] == references[0][1] and out[2][0] == references[1][1]
    alone, _ = generate(target, seen["draft"], tok, "def main():", max_tokens=NEW, k=2)
    assert out[1][0] == alone


def test_a_prompt_cache_is_keyed_by_the_image(seen):
    """The same prompt and image again reuses the whole prompt, image included; another image
    of the same size (the same token ids) after the same text reuses nothing of the first (a
    recurrent state cannot go back before the image), and its output is its own,
    log-probabilities included."""
    tok, target, images = seen["tok"], seen["target"], seen["images"]
    pc = PromptCache(target, seen["draft"])

    def run(picture, cache, n=8):
        out = list(stream_generate(target, seen["draft"], tok, ONE, images=[picture],
                                   max_tokens=n, k=2, prompt_cache=cache))
        return [r.token for r in out], np.array(out[0].logprobs), out[-1].stats

    ids = vision_prefill(target, ONE, [images[0]]).prompt.ids
    run(images[0], pc, n=1)
    again, again_lp, stats = run(images[0], pc)
    alone, alone_lp, _ = run(images[0], None)
    assert stats.cached_tokens == len(ids) - 1
    assert again == alone and np.abs(again_lp - alone_lp).max() < 1e-5
    run(images[0], pc, n=1)  # the cache holds the prompt, image included, and one token more
    other, other_lp, stats = run(images[2], pc)
    alone, alone_lp, _ = run(images[2], None)
    assert stats.cached_tokens == 0
    assert other == alone and np.abs(other_lp - alone_lp).max() < 1e-5
    assert np.abs(other_lp - again_lp).max() > 1e-3  # the two images are told apart


def test_a_string_prompt_marks_its_images(seen, references):
    text = seen["processor"].tokenizer.apply_chat_template(ONE, tokenize=False,
                                                           add_generation_prompt=True)
    assert IMAGE_TOKEN in text
    out, _ = generate(seen["target"], None, seen["tok"], text, images=[seen["images"][0]],
                      max_tokens=NEW)
    assert out == references[0][1]


@pytest.mark.parametrize("prompt, images, words", [
    (ONE, [], "1 image parts in the messages for 0 images"),
    (ONE, ["a", "b"], "1 image parts in the messages for 2 images"),
    ("no marks", ["x.png"], "0 '<|image_pad|>' marks in the prompt for 1 images"),
    ([1, 2, 3], ["x.png"], "must be a string or chat messages"),
    (ONE, [object()], "images[0] must be a path"),
    (ONE, [b"not an image"], "images[0] is not an image that can be read"),
    (ONE, "x.png", "images must be a list of images"),
])
def test_bad_images_are_refused_in_one_line(seen, prompt, images, words):
    with pytest.raises(ValueError) as err:
        generate(seen["target"], None, seen["tok"], prompt, images=images, max_tokens=2)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_images_given_twice_and_batch_lengths_are_refused(seen):
    tok, target, images = seen["tok"], seen["target"], seen["images"]
    carried = [{"role": "user", "content": [{"type": "image", "image": images[0]},
                                            {"type": "text", "text": "x"}]}]
    with pytest.raises(VisionError, match="either in the messages' image parts or in images"):
        generate(target, None, tok, carried, images=[images[1]], max_tokens=2)
    out, _ = generate(target, None, tok, carried, images=None, max_tokens=2)
    with pytest.raises(ValueError, match="images must be a list of 2 entries"):
        batch_generate(target, None, tok, [ONE, ONE], images=[[images[0]]], max_tokens=2)
    assert len(out) == 2


def test_a_text_target_refuses_images(checkpoints, load):
    target, _, tok = load("target")
    with pytest.raises(ValueError, match="given to a vision-language target only .*tinydraft-"
                                         r"mlx\[vision\]"):
        generate(target, None, tok, ONE, images=["x.png"], max_tokens=2)
    with pytest.raises(ModelLoadError, match="has no vision tower"):
        load_models(str(checkpoints["target"]), "none", vision=True)


def test_without_mlx_vlm_text_still_runs_and_images_are_refused(seen):
    """A process where mlx-vlm cannot be imported: the vision-language checkpoint loads as a
    text target, generates, and refuses images naming the extra; vision=True fails to load."""
    code = f"""
import sys
sys.modules["mlx_vlm"] = None
from tinydraft_mlx import generate, load_models
from tinydraft_mlx.vision import vision_of
target, _, tok = load_models({str(seen['directory'])!r}, "none", dtype="float32")
assert vision_of(target) is None
out, _ = generate(target, None, tok, "def main():", max_tokens=4)
assert len(out) == 4
try:
    generate(target, None, tok, "x <|image_pad|>", images=["x.png"], max_tokens=2)
except ValueError as err:
    print(err)
try:
    load_models({str(seen['directory'])!r}, "none", vision=True)
except ValueError as err:
    print(err)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 and all("pip install 'tinydraft-mlx[vision]'" in x for x in lines)


def test_a_head_reads_the_image_positions_as_the_target_saw_them(seen, references):
    """The states an MTP layer reads, captured from mlx-vlm's prefill of two images == the
    oracle's final hidden states at those positions."""
    import torch

    from tinydraft_mlx.engine.cache import make_cache
    from tinydraft_mlx.engine.hidden import FINAL, capture, watched

    target = seen["target"]
    assert FINAL in watched(target)  # the MTP head watches the target's final states
    own = vision_prefill(target, TWO, [seen["images"][0], seen["images"][1]])
    with capture() as got:
        n = own.prefill(target, make_cache(target, None, 4), len(own.prompt.ids) - 1)
    states = mx.concatenate([a for tag, a in got if tag == FINAL], axis=1)
    ids, _, oracle = references[1]
    tokens = torch.tensor([ids[:n]])
    with torch.no_grad():
        out = oracle.model(input_ids=tokens, mm_token_type_ids=(
            tokens == oracle.image_token_id).long(), output_hidden_states=True, **oracle.inputs)
    want = out.hidden_states[-1][0].numpy()
    assert states.shape == (1, n, want.shape[-1])
    assert np.abs(np.array(states[0]) - want).max() < 1e-4 * max(1.0, np.abs(want).max())


def test_the_server_reads_images_in_both_apis(seen, references):
    """OpenAI's image_url parts (a data URL) and Anthropic's base64 image blocks: the reply is
    the library's greedy output on the same messages and image."""
    import base64
    import io

    import httpx

    from tests.test_server import Served
    from tinydraft_mlx.server import Defaults, create_app
    from tinydraft_mlx.serving.worker import Worker

    buffer = io.BytesIO()
    seen["images"][0].save(buffer, format="PNG")  # lossless: the same pixels come back
    data = base64.b64encode(buffer.getvalue()).decode()
    worker = Worker(seen["target"], seen["draft"], seen["tok"], max_batch=4)
    served = Served(create_app(worker, "vlm", Defaults(k=2, max_tokens=NEW)))
    text = "def parse(self, x):"
    want = "".join(r.text for r in stream_generate(seen["target"], None, seen["tok"], ONE,
                                                   images=[seen["images"][0]],
                                                   max_tokens=NEW))
    try:
        chat = served.client().chat.completions.create(model="vlm", max_tokens=NEW, messages=[
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                {"type": "text", "text": text}]}], temperature=0)
        assert chat.choices[0].message.content == want
        assert chat.usage.prompt_tokens == len(references[0][0])
        r = httpx.post(f"{served.url}/v1/messages", timeout=60, json={
            "model": "vlm", "max_tokens": NEW, "temperature": 0, "messages": [
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": data}},
                    {"type": "text", "text": text}]}]})
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["text"] == want
        r = httpx.post(f"{served.url}/v1/chat/completions", timeout=60, json={
            "model": "vlm", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}}]}]})
        assert r.status_code == 400 and "images[1] is not an image" in r.json()["error"][
            "message"], r.text
        _concurrent_requests_are_each_exact(seen, served)
    finally:
        served.close()


def _concurrent_requests_are_each_exact(seen, served) -> None:
    """Two image requests (different images) and a text request at once, in one batch: each
    reply is the library's alone."""
    import base64
    import io
    from concurrent.futures import ThreadPoolExecutor

    def url(picture):
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    text = "def parse(self, x):"
    cases = [[seen["images"][0]], [seen["images"][2]], []]

    def ask(images):
        content = [{"type": "image_url", "image_url": {"url": url(p)}} for p in images]
        reply = served.client().chat.completions.create(
            model="vlm", max_tokens=NEW, temperature=0,
            messages=[{"role": "user", "content": content + [{"type": "text", "text": text}]}])
        return reply.choices[0].message.content

    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(ask, cases))
    for images, reply in zip(cases, got):
        message = [{"role": "user", "content": [{"type": "image"}] * len(images)
                    + [{"type": "text", "text": text}]}]
        want = "".join(r.text for r in stream_generate(
            seen["target"], seen["draft"], seen["tok"], message, images=images or None,
            max_tokens=NEW, k=2))
        assert reply == want, (len(images), reply, want)


def test_the_command_line_takes_images(seen, tmp_path, capsys, checkpoints):
    """`--image` (repeatable): the prompt becomes one user message, images first; the text is
    the library's greedy output; a text target refuses it with one line and status 2."""
    from tinydraft_mlx.programs.cli import main

    path = tmp_path / "picture.png"
    seen["images"][0].save(path)
    text = "def parse(self, x):"
    message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    want = "".join(r.text for r in stream_generate(seen["target"], None, seen["tok"], message,
                                                   images=[seen["images"][0]], max_tokens=NEW))
    code = main(["--target", str(seen["directory"]), "--draft", "prompt-lookup", "--image",
                 str(path), "--prompt", text, "--max-tokens", str(NEW), "--dtype", "float32"])
    assert code == 0 and capsys.readouterr().out.rstrip("\n") == want
    with pytest.raises(SystemExit) as exit_:
        main(["--target", str(checkpoints["target"]), "--draft", "none", "--image", str(path),
              "--prompt", text, "--max-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "vision-language target" in err and "\n" not in err


def test_a_vision_config_without_its_tower_loads_as_text(seen, tmp_path):
    """A checkpoint whose config names a vision tower its files lack (a text-only conversion):
    it loads as a text model with one warning and refuses images; vision=True fails to load."""
    from tests.hub_layouts import nest_as_hub

    flat = seen["directory"].parents[1] / "qwen3_5" / "target"
    hub = nest_as_hub(flat, tmp_path / "hub", "qwen3_5")
    with pytest.warns(UserWarning, match="loads as a text model: mlx-vlm could not load") as w:
        target, _, tok = load_models(str(hub), "none", dtype="float32")
    assert len(w) == 1 and "\n" not in str(w[0].message)
    assert vision_of(target) is None
    out, _ = generate(target, None, tok, "def main():", max_tokens=4)
    assert len(out) == 4
    with pytest.raises(ValueError, match="vision-language target only"):
        generate(target, None, tok, ONE, images=[seen["images"][0]], max_tokens=2)
    with pytest.raises(ModelLoadError, match="mlx-vlm could not load its vision tower"):
        load_models(str(hub), "none", vision=True)


def test_a_cached_text_prefix_is_handed_to_mlx_vlm(seen):
    """A prompt cache holding a text prefix, then that text and an image: the prefix is handed
    to mlx-vlm's cache and only the rest is prefilled; the output is the uncached prompt's."""
    tok, target = seen["tok"], seen["target"]
    pc = PromptCache(target, seen["draft"])
    text = "def parse(self, x):\n    "
    prompt = text + "<|vision_start|><|image_pad|><|vision_end|> return"
    generate(target, seen["draft"], tok, text, max_tokens=1, prompt_cache=pc)

    def run(cache):
        out = list(stream_generate(target, seen["draft"], tok, prompt,
                                   images=[seen["images"][1]], max_tokens=8, k=2,
                                   prompt_cache=cache))
        return [r.token for r in out], np.array(out[0].logprobs), out[-1].stats

    cached, cached_lp, stats = run(pc)
    alone, alone_lp, _ = run(None)
    assert stats.cached_tokens == len(tok.encode(text)) > 0
    assert cached == alone and np.abs(cached_lp - alone_lp).max() < 1e-5


def test_a_draft_without_rows_for_the_image_tokens_reads_id_0_there(seen, references,
                                                                   tmp_path):
    """The text draft with its own narrower vocabulary (no rows for the image tokens, as
    gemma-3-1b has none for Gemma 3's): its embeddings read id 0 for them, and the output is
    the oracle's."""
    import shutil

    from tinydraft_mlx.engine.hidden import embeddings

    directory = tmp_path / "narrow"  # the text draft, with the target's tokenizer
    shutil.copytree(seen["directory"].parents[1] / "qwen3_5" / "draft", directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(seen["directory"] / name, directory / name)
    narrow = load_draft(str(directory), seen["tok"], dtype="float32")
    table = embeddings(narrow)
    rows = table.weight.shape[0]
    assert rows < vision_of(seen["target"]).image_token_id
    out, stats = generate(seen["target"], narrow, seen["tok"], ONE,
                          images=[seen["images"][0]], max_tokens=NEW, k=3)
    assert out == references[0][1] and stats.drafted > 0
    ids = mx.array([[3, rows + 2]])
    assert np.array_equal(np.array(table(ids)[0, 1]), np.array(table.weight[0]))


def test_a_prompt_cache_file_keeps_the_image_key(seen, tmp_path):
    """Saved and loaded (the CLI's --prompt-cache-file), a cache of an image prompt is reused by
    a prompt extending it with the same image, and not with another of the same size."""
    tok, target, images = seen["tok"], seen["target"], seen["images"]
    first = "<|vision_start|><|image_pad|><|vision_end|> def parse(self, x):"
    then = first + "\n    return x"
    pc = PromptCache(target, seen["draft"])
    generate(target, seen["draft"], tok, first, images=[images[0]], max_tokens=1,
             prompt_cache=pc)
    pc.save(tmp_path / "cache.safetensors")
    ids = vision_prefill(target, first, [images[0]]).prompt.ids
    assert vision_prefill(target, then, [images[0]]).prompt.ids[: len(ids)] == ids
    for picture, reused in ((images[0], len(ids)), (images[2], 0)):
        loaded = PromptCache.load(tmp_path / "cache.safetensors", target, seen["draft"])
        out, stats = generate(target, seen["draft"], tok, then, images=[picture], max_tokens=8,
                              k=2, prompt_cache=loaded)
        alone, _ = generate(target, seen["draft"], tok, then, images=[picture], max_tokens=8,
                            k=2)
        assert stats.cached_tokens == reused and out == alone

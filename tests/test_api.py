"""The generation API: mlx-lm-style responses, logprobs against the oracle, logits processors
against mlx-lm's own plain loop and an independent sampling oracle, stop strings, chat messages.
Prompt caches are in test_prompt_cache.py."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from tests.reference import check_first_two_tokens, warp_np
from tinydraft_mlx import (
    BatchDecoder,
    GenerationResponse,
    PromptCache,
    SamplingParams,
    generate,
    load_models,
    make_options,
    stream_generate,
)
from tinydraft_mlx.engine.cache import cache_length
from tinydraft_mlx.generation.text import StopStrings

PROMPT = "def parse_args(self, args=None, namespace=None):"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_responses_carry_mlx_lm_fields(demo):
    """On the demo pair (real text: the random fixture emits ids its tokenizer lacks)."""
    target, draft, tok = demo
    out = list(stream_generate(target, draft, tok, "class Stack:\n    def push(self, item):",
                               k=3, max_tokens=24))
    assert all(isinstance(r, GenerationResponse) for r in out)
    assert [r.generation_tokens for r in out] == list(range(1, 25))
    assert [r.finish_reason for r in out] == [None] * 23 + ["length"]
    tokens = [r.token for r in out]
    assert "".join(r.text for r in out) == tok.decode(tokens)
    assert any(r.from_draft for r in out) and not all(r.from_draft for r in out)
    last = out[-1]
    assert last.prompt_tokens == len(tok.encode("class Stack:\n    def push(self, item):"))
    assert last.prompt_tps > 0
    assert last.generation_tps > 0 and last.peak_memory > 0
    assert last.stats.generated == 24 and last.logprobs.shape == (target.args.vocab_size,)


@pytest.mark.usefixtures("cpu_fp32")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_match_oracle(pair, oracle, temperature):
    """Every emitted token's logprobs (accepted drafts, corrections, bonus tokens) equal the
    oracle's log-softmax at that position, from a full recompute: max abs difference <= 1e-4."""
    target, draft, tok = pair
    ids = tok.encode(PROMPT)
    out = list(stream_generate(target, draft, tok, ids, k=4, max_tokens=32,
                               temperature=temperature, seed=5))
    tokens = [r.token for r in out]
    logits = oracle.logits(ids + tokens)
    expected = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(
        -1, keepdims=True)) - logits.max(-1, keepdims=True)
    for i, r in enumerate(out):
        got = np.array(r.logprobs)
        assert np.abs(got - expected[len(ids) - 1 + i]).max() <= 1e-4, i
    assert {r.from_draft for r in out} == {True, False}


def _reference_with_processors(target, ids, n, extra=(), **processor_kw):
    """mlx-lm's own plain loop (generate_step) with `extra` then mlx-lm's processors: tokens,
    smallest top-2 gap of the processed logits along the path."""
    processors = list(extra) + make_logits_processors(**processor_kw)
    out, margin = [], np.inf
    for token, logprobs in generate_step(mx.array(ids), target, max_tokens=n,
                                         logits_processors=processors):
        top2 = np.sort(np.array(logprobs))[-2:]
        margin = min(margin, top2[1] - top2[0])
        out.append(int(token))
    return out, margin


PENALTIES = dict(repetition_penalty=1.6, repetition_context_size=12, presence_penalty=0.4,
                 frequency_penalty=0.3, logit_bias={20: 2.0, 100: -3.0})
BOOST = 4.0


def boost_successor(tokens, logits):
    """+BOOST on the id after the last token's: its effect depends on the exact last token, so a
    verify position given the wrong history (without the drafts before it) is caught."""
    successor = (tokens[-1] + 1) % logits.shape[-1]
    return logits + BOOST * (mx.arange(logits.shape[-1]) == successor)


@pytest.mark.parametrize("k", [1, 2, 4, 8, "lookup"])
def test_greedy_with_processors_equals_mlx_lm_plain_loop(pair, k):
    """Each verified position processes its own history: the result equals mlx-lm's plain
    generate_step with the same processors (an independent loop), for a draft model and k in
    1..8, and for prompt-lookup drafts. `boost_successor` makes every position's result depend
    on the token right before it."""
    target, draft, tok = pair
    for text in [PROMPT, "    for line in text.splitlines():\n        if"]:
        ids = tok.encode(text)
        ref, margin = _reference_with_processors(target, ids, 40, [boost_successor],
                                                 **PENALTIES)
        assert margin > 1e-3 and len(set(ref)) >= 12, (margin, ref)
        kw = dict(PENALTIES, logits_processors=[boost_successor])
        plain, _ = generate(target, None, tok, ids, max_tokens=40, **kw)
        assert plain != generate(target, None, tok, ids, max_tokens=40)[0]  # they act
        d, kk = ("prompt-lookup", 4) if k == "lookup" else (draft, k)
        out, stats = generate(target, d, tok, ids, k=kk, max_tokens=40, **kw)
        assert out == ref
        assert plain == ref
        if k != "lookup":
            assert stats.accepted > 0


@pytest.mark.usefixtures("cpu_fp32")
def test_repetition_penalty_sampling_follows_oracle(pair, oracle):
    """First two tokens at T=1, top-p 0.9, with a repetition penalty (k=2, so both the accept
    path and the residual path are taken) against an independent oracle: transformers fp32
    logits, the penalty applied in NumPy from its definition (sign-aware: negative logits
    multiplied, positive divided, for every token among the last `context` of the history), then
    the NumPy warp. The prompt holds the most likely next tokens, so the penalty matters; the
    second token's distribution depends on the first through `boost_successor`.
    Bound as in test_sampling_exactness: chi-square below the Wilson-Hilferty 1 - 3.2e-5
    quantile; the same samples against the unpenalised distribution must exceed it."""
    target, draft, tok = pair
    base = tok.encode("def parse_args(self):")
    likely = np.argsort(oracle.logits(base)[-1])[-3:]  # put the likely next tokens in the history
    ids = [int(t) for t in likely] + base
    penalty, context, n = 2.0, 20, 2500

    def penalised(history):
        z = oracle.logits(history)[-1].copy()
        z[(history[-1] + 1) % z.size] += BOOST  # boost_successor, then mlx-lm's penalty
        seen = sorted(set(history[-context:]))
        z[seen] = np.where(z[seen] < 0, z[seen] * penalty, z[seen] / penalty)
        return warp_np(z, temperature=1.0, top_p=0.9)

    def joint(p_of):
        p1, out = p_of(ids), {}
        for a in np.flatnonzero(p1 > 1e-12):
            p2 = p_of(ids + [int(a)])
            for b in np.flatnonzero(p2 > 1e-12):
                out[(int(a), int(b))] = p1[a] * p2[b]
        return out

    exact = joint(penalised)
    plain = joint(lambda h: warp_np(oracle.logits(h)[-1], temperature=1.0, top_p=0.9))
    assert 10 < len(exact) < 2000  # a real distribution, small enough to be sampled well
    processors = make_options(repetition_penalty=penalty, logits_processors=[boost_successor],
                              repetition_context_size=context).processors()
    check_first_two_tokens(lambda: BatchDecoder(target, draft), ids, "model", n, exact, plain,
                           sampling=lambda seed: SamplingParams(1.0, top_p=0.9, seed=seed),
                           logits_processors=processors)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_a_token(pair, temperature):
    target, draft, tok = pair
    forced = tok.encode(" namespace")[0]
    out, stats = generate(target, draft, tok, PROMPT, k=4, max_tokens=20, seed=1,
                          temperature=temperature, logit_bias={forced: 100.0})
    assert out == [forced] * 20
    assert stats.accepted > 0  # the draft, biased the same way, proposes it too


def test_stop_string_unit():
    """Text that could still begin a stop string is held back, and released when it cannot."""
    stop = StopStrings(["STOP", "xyz"])
    assert stop.feed("abc S") == ("abc ", False)  # "S" may begin "STOP"
    assert stop.feed("TO") == ("", False)
    assert stop.feed("ck") == ("STOck", False)
    assert stop.feed("x") == ("", False)
    assert stop.feed("yz tail") == ("", True)  # cut before the stop string, nothing after
    assert StopStrings(["ab"]).feed("xxabyy") == ("xx", True)
    held = StopStrings(["end"])
    assert held.feed("the en") == ("the ", False) and held.flush() == "en"


@pytest.mark.parametrize("draft_name", ["target", "draft"])
def test_stop_string_across_tokens_and_rounds(load, draft_name):
    """A stop string made of the text of several generated tokens (with an identical draft, all
    accepted in one round): the text ends before it, finish_reason is "stop", the emitted tokens
    end with the one completing it, and the caches hold exactly prompt + the emitted tokens.
    On the demo pair (real text)."""
    from tinydraft_mlx.generation.loading import DEMO_DIR

    target, draft, tok = load(str(DEMO_DIR / "target"), str(DEMO_DIR / draft_name))
    ids = tok.encode("class Stack:\n    def push(self, item):")
    run = list(stream_generate(target, None, tok, ids, max_tokens=40))
    ref = [r.token for r in run]
    ends = np.cumsum([len(r.text) for r in run])  # text length after each token
    full = "".join(r.text for r in run)
    first = next(i for i in range(6, 20) if ends[i + 3] - ends[i] >= 6)
    start, stop_end = ends[first] + 1, ends[first + 3] - 1  # inside tokens first+1..first+3
    stop = full[start:stop_end]
    assert len(stop) >= 4 and full.find(stop) == start, (full, stop)
    pc = PromptCache(target, draft)
    out = list(stream_generate(target, draft, tok, ids, k=6, max_tokens=40, stop=[stop, "@@"],
                               prompt_cache=pc))
    text = "".join(r.text for r in out)
    assert text == full[:start] and stop not in text
    assert out[-1].finish_reason == "stop" and out[-1].stats.finish_reason == "stop"
    emitted = [r.token for r in out]
    assert emitted == ref[: first + 4]  # the last one completes the stop string
    assert pc.tokens == ids + emitted
    assert cache_length(pc.target_cache) == len(pc.tokens) - 1
    assert cache_length(pc.draft_cache) <= len(pc.tokens) - 1
    if draft_name == "target":  # the round went on past the stop; nothing of it was emitted
        assert out[-1].stats.accepted + out[-1].stats.rounds > len(emitted)


@pytest.fixture(scope="module")
def chat_pair(checkpoints, tmp_path_factory):
    """The fixture target with a chat template in its tokenizer config."""
    directory = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(checkpoints["target"], directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config))
    return load_models(str(directory), "none", dtype="float32")


def test_chat_messages_use_the_template(chat_pair, pair):
    target, _, tok = chat_pair
    _, draft, _ = pair
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "def parse_args("}]
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ndef parse_args(" \
           "<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    expected, _ = generate(target, None, tok, ids, max_tokens=16)
    out, stats = generate(target, draft, tok, messages, k=3, max_tokens=16)
    assert out == expected and stats.prompt_tokens == len(ids)


@pytest.mark.parametrize("prompt, spaced", [("if __name__ ==", True), ("    return", True),
                                            ("def main():\n", True), ("def parse_args(", False)])
def test_text_is_the_decoded_tokens_with_their_leading_space(demo, prompt, spaced):
    """The streamed text is tokenizer.decode(generated ids): mlx-lm's BPE streaming detokenizer
    drops the first token's leading space, which would glue a completion to its prompt (the
    demo pair's first generated token after the first three prompts starts with a space; after
    "def main():" it is an indent of three spaces, of which one was lost)."""
    target, draft, tok = demo
    out = list(stream_generate(target, draft, tok, prompt, k=3, max_tokens=24))
    ids = [r.token for r in out]
    assert "".join(r.text for r in out) == tok.decode(ids)
    assert tok.decode(ids[:1]).startswith(" ") == spaced


def test_k_defaults_to_auto_in_every_entry_point():
    """Where k is not given, every entry point drafts with k="auto": the API, the engine's loop
    and batch decoder, the CLI's and the server's flags, and a server request's defaults."""
    import inspect

    from tinydraft_mlx import server
    from tinydraft_mlx.engine.rounds import BatchDecoder
    from tinydraft_mlx.engine.speculative import decode
    from tinydraft_mlx.programs import cli
    from tinydraft_mlx.serving.service import Defaults

    for function in (stream_generate, decode, BatchDecoder.insert):
        assert inspect.signature(function).parameters["k"].default == "auto", function
    assert cli.setup_arg_parser().parse_args([]).k == "auto"
    assert server.setup_arg_parser().parse_args([]).k == "auto"
    assert Defaults().k == "auto"


def test_an_id_beyond_the_tokenizers_vocabulary_has_no_text(pair):
    """The fixture target's logits are 64 ids wider than its tokenizer's 384 entries (as
    Qwen2.5-7B's): a logit bias makes it emit id 400, which has no text: the reply's text is
    the decoded text of the other tokens (mlx-lm's detokenizer alone prints "!" for it), and
    its logprob entry has an empty token and no bytes."""
    from tinydraft_mlx.generation.tokens import token_bytes, vocabulary_size
    from tinydraft_mlx.serving.openai_schema import token_text

    target, draft, tok = pair
    assert vocabulary_size(tok) == 384
    out = list(stream_generate(target, draft, tok, "def parse_args(", max_tokens=6, k=2,
                               logit_bias={400: 30.0}))
    ids = [r.token for r in out]
    assert 400 in ids
    assert "".join(r.text for r in out) == tok.decode([t for t in ids if t < 384])
    assert "!" not in "".join(r.text for r in out)
    assert token_text(tok, 400) == "" and token_bytes(tok, 400) == []


@pytest.mark.parametrize("text", ["café — naïve ü", "東京 ok"])
def test_token_bytes_are_each_tokens_own(demo, pair, text):
    """A character split over several byte-level BPE tokens: each token's bytes are its own
    (a partial UTF-8 sequence, not the replacement character's [239, 191, 189]), so the tokens'
    bytes put together are the text's UTF-8, on both tokenizers."""
    from tinydraft_mlx.generation.tokens import token_bytes

    for tok in (demo[2], pair[2]):
        ids = tok.encode(text, add_special_tokens=False)
        assert any(tok.decode([t]) == "\ufffd" for t in ids)  # a token that is part of one
        assert sum((token_bytes(tok, t) for t in ids), []) == list(text.encode())

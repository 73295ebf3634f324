"""The OpenAI-compatible server, through the official `openai` client and raw HTTP, on the bundled
demo pair served from this process on 127.0.0.1 (the command itself: test_server_command.py).

Expected outputs come from the library (`stream_generate` with plain decoding on the same
models), computed while the server is idle. Every request loop is bounded: a few hundred tokens
per test at ~300 tokens/s on the demo pair.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from tinydraft_mlx import load_models, stream_generate
from tinydraft_mlx.server import Defaults, create_app
from tinydraft_mlx.serving import limits
from tinydraft_mlx.serving.worker import Worker

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
# an editing request in the demo's ChatML: the answer copies the snippet back, so prompt lookup's
# drafts are accepted (tests/test_demo.py's)
EDITING = (
    "<|im_start|>user\nRename `x` to `left` in this code:\n```python\ndef add(x, y):\n"
    '    """Return x plus y."""\n    return x + y\n```<|im_end|>\n<|im_start|>assistant\n'
)
PROMPTS = ["def parse_args(", "class Config:", "import os\n", "for i in range(",
           "def main():\n", "if __name__ ==", "with open(", "    return "]


class Served:
    """An app served by uvicorn on a free 127.0.0.1 port, in a thread of this process."""

    def __init__(self, app, **limits_kwargs) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = limits.config(app, log_level="warning", timeout_graceful_shutdown=5,
                               **limits_kwargs)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def health(self) -> dict:
        r = httpx.get(f"{self.url}/health", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                             timeout=60)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if not health["running"] and not health["waiting"]:
                return health
            assert time.monotonic() < deadline, f"still busy after {timeout} s: {health}"
            time.sleep(0.02)


def assert_concurrent_greedy(served: Served, refs, kinds: list[str], n: int,
                             max_tokens: int = 12) -> None:
    """`n` concurrent greedy completions (request i: refs[i]'s prompt, draft kinds[i], k = 3)
    each return the reference tokens (refs[i][1], cut to `max_tokens`)."""
    from concurrent.futures import ThreadPoolExecutor

    client = served.client()

    def ask(i: int) -> list[int]:
        ids, _ = refs[i % len(refs)]
        r = client.completions.create(
            model="m", prompt=ids, max_tokens=max_tokens, temperature=0.0,
            extra_body={"draft": kinds[i % len(kinds)], "num_draft_tokens": 3})
        return r.choices[0].model_extra["tinydraft"]["token_ids"]

    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(ask, range(n)))
    for i, tokens in enumerate(answers):
        assert tokens == refs[i % len(refs)][1][:max_tokens], i


@pytest.fixture(scope="module")
def models():
    """The demo pair with its own tokenizer (given a chat template here, so the shared demo
    fixture's tokenizer stays without one), on the run's default device and dtype."""
    target, draft, tokenizer = load_models()
    tokenizer.chat_template = TEMPLATE
    return target, draft, tokenizer


@pytest.fixture(scope="module", params=[1, 8], ids=["one-at-a-time", "batched"])
def served(models, request):
    """The server, generating one request at a time (--max-batch 1) and batched (8): every
    test of it runs on both."""
    target, draft, tokenizer = models
    worker = Worker(target, draft, tokenizer, cache_bytes=64 << 20, max_queue=32,
                    max_batch=request.param)
    s = Served(create_app(worker, "demo", Defaults(k=4, max_tokens=32),
                          max_body_bytes=1 << 20))
    yield s
    s.close()


@pytest.fixture(scope="module")
def small(models):
    """A second server: one waiting request at most, caches bounded to 64 positions."""
    target, draft, tokenizer = models
    worker = Worker(target, draft, tokenizer, max_kv_size=64, max_queue=1)
    s = Served(create_app(worker, "demo", Defaults(k=4, max_tokens=32)))
    yield s
    s.close()


def reference(models, prompt, max_tokens, **kwargs) -> tuple[str, list[int]]:
    """Plain decoding through the library: (text, token ids)."""
    target, _, tokenizer = models
    out = list(stream_generate(target, None, tokenizer, prompt, max_tokens=max_tokens, **kwargs))
    return "".join(r.text for r in out), [r.token for r in out]


def marks(choice) -> dict:
    return choice.model_extra["tinydraft"]


# -- endpoints -----------------------------------------------------------------------------------


def test_models_health_and_page(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == ["demo"]
    health = served.health()
    assert health["status"] == "ok" and health["model"] == "demo" and health["draft"] == "model"
    page = httpx.get(served.url + "/", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/v1/completions" in page.text and "from_draft" in page.text


@pytest.mark.parametrize("k,draft", [(4, "model"), ("auto", "model"), (2, "prompt-lookup"),
                                     (None, "none")])
def test_completion_greedy_equals_the_library(served, models, k, draft):
    served.wait_idle()
    # prompt lookup: a prompt whose answer copies it (it ends its turn after 40 tokens)
    prompt, n = (EDITING, 48) if draft == "prompt-lookup" else ("def parse_args(", 40)
    text, ids = reference(models, prompt, n)
    extra = {"draft": draft} | ({"num_draft_tokens": k} if k is not None else {})
    r = served.client().completions.create(model="demo", prompt=prompt,
                                           max_tokens=n, temperature=0, extra_body=extra)
    choice = r.choices[0]
    assert choice.text == text and marks(choice)["token_ids"] == ids
    assert choice.finish_reason == ("length" if len(ids) == n else "stop")
    spec = r.usage.model_extra["speculative"]
    assert r.usage.completion_tokens == len(ids) and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert spec["draft"] == draft and sum(marks(choice)["from_draft"]) == spec["accepted"]
    assert sum(spec["k_histogram"].values()) == spec["rounds"]
    # k="auto"'s catch-ups of the draft after plain rounds, and their time (where timed alone:
    # not in a batch, whose round is one graph): none at a fixed k
    assert spec["catch_ups"] >= 0 and spec["catch_up_seconds"] >= 0.0
    assert spec["catch_ups"] > 0 or spec["catch_up_seconds"] == 0.0
    assert k == "auto" or spec["catch_ups"] == 0
    if draft == "none":
        assert spec["drafted"] == 0 and not any(marks(choice)["from_draft"])
    else:
        assert spec["drafted"] >= spec["accepted"] > 0
        assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"])
        assert spec["mean_accepted_length"] == pytest.approx(spec["accepted"] / spec["rounds"])
        assert spec["decode_tokens_per_second"] > 0
    if draft == "model" and k == 4:  # never more than k; a round with one token left drafts none
        assert set(spec["k_histogram"]) <= {"0", "1", "2", "3", "4"}
        assert len(spec["per_position_acceptance"]) == 4


def test_token_id_prompt(served, models):
    target, _, tokenizer = models
    ids = tokenizer.encode("class Config:")
    text, _ = reference(models, ids, 24)
    r = served.client().completions.create(model="demo", prompt=ids, max_tokens=24)
    assert r.choices[0].text == text


def test_streamed_completion(served, models):
    """Streamed chunks, one per token; the first generated token starts with a space: the text
    keeps it (prompt + text is the decoded sequence)."""
    tokenizer = models[2]
    text, ids = reference(models, "if __name__ ==", 48)
    chunks = list(served.client().completions.create(
        model="demo", prompt="if __name__ ==", max_tokens=48, stream=True,
        stream_options={"include_usage": True}))
    pieces = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in pieces) == text == tokenizer.decode(ids)
    assert text.startswith(" ")
    assert [t for c in pieces for t in marks(c.choices[0])["token_ids"]] == ids
    assert pieces[-1].choices[0].finish_reason is not None
    assert all(c.choices[0].finish_reason is None for c in pieces[:-1])
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == len(ids)
    drafted = sum(f for c in pieces for f in marks(c.choices[0])["from_draft"])
    assert drafted == usage.model_extra["speculative"]["accepted"] > 0
    # without include_usage no chunk carries usage
    plain = list(served.client().completions.create(model="demo", prompt="import os\n",
                                                    max_tokens=8, stream=True))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_raw_stream_ends_with_done(served):
    with httpx.stream("POST", f"{served.url}/v1/completions", timeout=30,
                      json={"prompt": "with open(", "max_tokens": 6, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert len(lines) == 6 + 1


def test_chat_stream_and_second_turn_reuses_the_cache(served, models):
    client = served.client()
    first = [{"role": "user", "content": "def parse_args("}]
    text, _ = reference(models, first, 24)
    r = client.chat.completions.create(model="demo", messages=first, max_tokens=24)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    second = first + [{"role": "assistant", "content": text},
                      {"role": "user", "content": "class Config:"}]
    fresh, _ = reference(models, second, 24)
    chunks = list(client.chat.completions.create(
        model="demo", messages=second, max_tokens=24, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == fresh
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens > len(first[0]["content"]) // 2
    assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_chat_content_parts_and_max_completion_tokens(served, models):
    text, _ = reference(models, [{"role": "user", "content": "import os\n"}], 10)
    r = served.client().chat.completions.create(
        model="demo", max_completion_tokens=10,
        messages=[{"role": "user", "content": [{"type": "text", "text": "import "},
                                               {"type": "text", "text": "os\n"}]}])
    assert r.choices[0].message.content == text and r.usage.completion_tokens == 10


def test_logprobs_match_the_library(served, models):
    target, _, tokenizer = models
    out = list(stream_generate(target, None, tokenizer, "for i in range(", max_tokens=12))
    r = served.client().completions.create(model="demo", prompt="for i in range(",
                                           max_tokens=12, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 12 and len(lp.top_logprobs) == 12
    for response, value, top in zip(out, lp.token_logprobs, lp.top_logprobs):
        assert value == pytest.approx(response.logprobs[response.token].item(), abs=1e-4)
        assert len(top) == 3 and max(top.values()) >= value - 1e-6
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(out[0].text)
    chat = served.client().chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=4, logprobs=True,
        top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.logprob - 1e-6
               for c in content)


def test_seeded_sampling_is_the_library_sample(served, models):
    """The server passes the sampling options through: the same seed gives the library's sample
    (same draft, k and warp), and the same answer twice."""
    target, draft, tokenizer = models
    kwargs = dict(max_tokens=32, temperature=0.8, top_p=0.95, seed=11)
    out = list(stream_generate(target, draft, tokenizer, "def main():\n", k=4, **kwargs))
    text = "".join(r.text for r in out)
    client = served.client()
    a = client.completions.create(model="demo", prompt="def main():\n", **kwargs)
    b = client.completions.create(model="demo", prompt="def main():\n", **kwargs)
    assert a.choices[0].text == b.choices[0].text == text


def test_stop_logit_bias_and_penalties(served, models):
    target, _, tokenizer = models
    text, _ = reference(models, "def parse_args(", 40)
    stop = text[10:14]
    expected, _ = reference(models, "def parse_args(", 40, stop=stop)
    r = served.client().completions.create(model="demo", prompt="def parse_args(",
                                           max_tokens=40, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    bias = {tokenizer.encode(" x")[-1]: 100.0}
    expected, ids = reference(models, "class Config:", 6, logit_bias=bias,
                              repetition_penalty=1.3, presence_penalty=0.5)
    r = served.client().completions.create(
        model="demo", prompt="class Config:", max_tokens=6, presence_penalty=0.5,
        logit_bias={str(t): b for t, b in bias.items()}, extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].text == expected and set(ids) == set(bias)


# -- load ----------------------------------------------------------------------------------------


def test_eight_concurrent_streaming_clients(served, models):
    """8 clients x 4 requests each, streaming at once: every request completes, in full, with
    exactly its own greedy output."""
    served.wait_idle()
    n_tokens = 24
    expected = {p: reference(models, p, n_tokens)[0] for p in PROMPTS}
    before = served.health()["requests"].get("completed", 0)
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0,
                                timeout=120)

    async def one_client(i: int) -> list[tuple[str, str]]:
        results = []
        for j in range(4):
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            stream = await client.completions.create(model="demo", prompt=prompt,
                                                     max_tokens=n_tokens, stream=True,
                                                     extra_body={"num_draft_tokens": 1 + j})
            text = "".join([c.choices[0].text async for c in stream if c.choices])
            results.append((prompt, text))
        return results

    async def all_clients():
        try:
            return await asyncio.gather(*(one_client(i) for i in range(8)))
        finally:
            await client.close()

    results = [r for rs in asyncio.run(all_clients()) for r in rs]
    assert len(results) == 32
    assert all(text == expected[prompt] for prompt, text in results)
    health = served.wait_idle()
    assert health["requests"]["completed"] - before == 32


@pytest.mark.serial  # bounds a wall-clock time: run alone
def test_hang_up_mid_stream_stops_the_generation(served, models):
    """A client that hangs up after a few tokens: the generation (3000 tokens requested, ~10 s)
    stops within a round, and the next request, on the same prompt, hence on the cache the
    cancelled one left behind, is exact."""
    served.wait_idle()
    cancelled = served.health()["requests"].get("cancelled", 0)
    body = {"prompt": "def parse_args(", "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=30) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 8:
                break
    hung_up = time.monotonic()
    health = served.wait_idle(timeout=3.0)
    assert time.monotonic() - hung_up < 3.0
    assert health["requests"]["cancelled"] == cancelled + 1
    text, _ = reference(models, "def parse_args(", 40)
    r = served.client().completions.create(model="demo", prompt="def parse_args(",
                                           max_tokens=40)
    assert r.choices[0].text == text
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_full_queue_answers_503_with_retry_after(small, models):
    small.wait_idle()
    long = {"prompt": "def parse_args(", "max_tokens": 1000, "stream": True}
    results = {}
    with httpx.stream("POST", f"{small.url}/v1/completions", json=long, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)  # the long generation is running

        def waiting_request():
            results["r"] = httpx.post(f"{small.url}/v1/completions", timeout=60,
                                      json={"prompt": "class Config:", "max_tokens": 12})

        waiter = threading.Thread(target=waiting_request)
        waiter.start()
        deadline = time.monotonic() + 10
        while small.health()["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        busy = httpx.post(f"{small.url}/v1/completions", timeout=10,
                          json={"prompt": "x", "max_tokens": 2})
        assert busy.status_code == 503
        assert int(busy.headers["retry-after"]) >= 1
        assert busy.json()["error"]["code"] == "server_busy"
        assert small.health()["status"] == "ok"  # served while the generation runs
    waiter.join(60)
    expected, _ = reference(models, "class Config:", 12, max_kv_size=64)
    assert results["r"].status_code == 200
    assert results["r"].json()["choices"][0]["text"] == expected


def test_bounded_cache_generates_past_its_size(small, models):
    """--max-kv-size 64: a 100-token completion wraps the caches; output equals plain decoding
    with the same bound."""
    small.wait_idle()
    expected, _ = reference(models, "import os\n", 100, max_kv_size=64)
    r = small.client().completions.create(model="demo", prompt="import os\n", max_tokens=100)
    assert r.choices[0].text == expected


# -- bad input -----------------------------------------------------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
BAD = [
    # (endpoint, body, param, text the message must contain)
    (COMPLETIONS, {"prompt": "x", "temperature": -1}, "temperature", "-1"),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature", "'hot'"),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, "top_p", "1.5"),
    (COMPLETIONS, {"prompt": "x", "top_k": -1}, "top_k", "-1"),
    (COMPLETIONS, {"prompt": "x", "min_p": 1.0}, "min_p", "1.0"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens", "(got 0)"),
    (COMPLETIONS, {"prompt": "x", "n": 2}, "n", "(got 2)"),
    (COMPLETIONS, {}, "prompt", "required"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt", "2 strings"),
    (COMPLETIONS, {"prompt": [5, 10 ** 7]}, "prompt", str(10 ** 7)),
    (COMPLETIONS, {"prompt": "x", "num_draft_tokens": 0}, "num_draft_tokens", "(got 0)"),
    (COMPLETIONS, {"prompt": "x", "num_draft_tokens": "fast"}, "num_draft_tokens", "'fast'"),
    (COMPLETIONS, {"prompt": "x", "draft": "big"}, "draft", "'big'"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 50}, "logprobs", "(got 50)"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", "'abc'"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias", "99999999"),
    (COMPLETIONS, {"prompt": "x", "stop": [""]}, "stop", "''"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": -1}, "repetition_penalty", "-1"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": "x"}, "presence_penalty", "'x'"),
    (COMPLETIONS, {"prompt": "x", "echo": True}, "echo", "not supported"),
    (COMPLETIONS, {"prompt": "x", "best_of": 3}, "best_of", "(got 3)"),
    (COMPLETIONS, {"prompt": "x", "seed": "s"}, "seed", "'s'"),
    (CHAT, {}, "messages", "required"),
    (CHAT, {"messages": [{"role": "user"}], "max_completion_tokens": 0},
     "max_completion_tokens", "(got 0)"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].image_url", "needs image_url.url"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "https://example.com/a.png"}}]}]}, "messages[0].content[0].image_url.url",
     "fetches no URL"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,aGk="}}]}]}, "messages", "this model reads no images"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "messages[0].content", "input_audio"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role", "required"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function",
     "Field required"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools", "does not render tools"),  # this module's template has no place for them
    (CHAT, {"messages": USER, "tool_choice": "required"}, "tool_choice", "needs tools"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "(got 21)"),
    # values that overflowed float32 into NaN distributions (every token id 4095, status 200)
    (COMPLETIONS, {"prompt": "x", "temperature": 1e-39}, "temperature", "1e-39"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 1e39}}, "logit_bias", "1e+39"),
    # strict types: nothing converted
    (COMPLETIONS, {"prompt": "x", "max_tokens": True}, "max_tokens", "True"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "3"}, "max_tokens", "'3'"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2.0}, "max_tokens", "2.0"),
    (COMPLETIONS, {"prompt": "x", "temperature": "0.7"}, "temperature", "'0.7'"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream", "'yes'"),
    (COMPLETIONS, {"prompt": [True, False]}, "prompt", "True"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "5"),
    # checked whatever the draft
    (COMPLETIONS, {"prompt": "x", "draft": "none", "num_draft_tokens": 0}, "num_draft_tokens",
     "(got 0)"),
    # prompt + max_tokens past the demo target's 4096 positions
    (COMPLETIONS, {"prompt": "x", "max_tokens": 5000}, "max_tokens", "context length 4096"),
]


@pytest.mark.parametrize("endpoint,body,param,text", BAD,
                         ids=[f"{e.split('/')[-2]}-{p}-{i}" for i, (e, _, p, _) in
                              enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(served, endpoint, body, param, text):
    r = httpx.post(served.url + endpoint, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert text in error["message"], error


def test_other_bad_requests(served, small):
    r = httpx.post(served.url + COMPLETIONS, content=b'{"prompt": ', timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(served.url + COMPLETIONS, json={"model": "gpt-4", "prompt": "x"}, timeout=10)
    assert r.status_code == 404
    assert r.json()["error"] == {"message": r.json()["error"]["message"], "type":
                                 "invalid_request_error", "param": "model",
                                 "code": "model_not_found"}
    big = {"prompt": "x" * (2 << 20)}
    r = httpx.post(served.url + COMPLETIONS, json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(small.url + COMPLETIONS, json={"prompt": "x", "num_draft_tokens": 64},
                   timeout=10)  # 65 positions a round do not fit a 64-position cache
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_draft_tokens"
    assert r.json()["error"]["message"] == ("num_draft_tokens must be an integer in [1, 59] or "
                                            '"auto" with max_kv_size 64 (got 64)')
    r = httpx.post(small.url + COMPLETIONS, json={"prompt": list(range(1, 80))}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "79 tokens" in r.json()["error"]["message"]
    r = httpx.post(served.url + COMPLETIONS, json={"prompt": "x", "num_draft_tokens": 9,
                                                   "draft": "model"}, timeout=10)
    assert r.status_code == 200
    with pytest.raises(openai.BadRequestError) as err:
        served.client().completions.create(model="demo", prompt="x", temperature=-2)
    assert err.value.body["param"] == "temperature"
    assert served.health()["status"] == "ok"


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_generation_is_a_500_and_the_server_goes_on(served, models, monkeypatch,
                                                              stream):
    """An error inside the loop after some tokens were generated (here the detokenizer breaks
    at the 6th token) answers 500 with the error body (streaming: an error event after the
    first tokens, then [DONE]) which says nothing of the exception (it is the server's log's);
    the cache goes back consistent and the next request is exact."""
    target, _, tokenizer = models
    served.wait_idle()
    text, _ = reference(models, "def parse_args(", 20)
    added = {"n": 0}
    original = type(tokenizer).detokenizer

    class Breaking:
        def __get__(self, obj, owner=None):
            if obj is None:
                return self
            detok = original.__get__(obj, owner)
            add = detok.add_token

            def add_token(token):
                added["n"] += 1
                if added["n"] == 6:
                    raise RuntimeError("detokenizer exploded")
                add(token)

            detok.add_token = add_token
            return detok

    monkeypatch.setattr(type(tokenizer), "detokenizer", Breaking())
    body = {"prompt": "def parse_args(", "max_tokens": 20, "stream": stream}
    r = httpx.post(served.url + COMPLETIONS, json=body, timeout=30)
    monkeypatch.setattr(type(tokenizer), "detokenizer", original)
    assert added["n"] == 6  # it failed mid-stream, after 5 tokens
    if stream:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert len([c for c in chunks if "choices" in c]) == 5
        error = chunks[-1]["error"]
    else:
        assert r.status_code == 500
        error = r.json()["error"]
    assert error["type"] == "server_error" and "log" in error["message"]
    assert "exploded" not in json.dumps(error) and "RuntimeError" not in json.dumps(error)
    r = served.client().completions.create(model="demo", prompt="def parse_args(",
                                           max_tokens=20)
    assert r.choices[0].text == text


# -- the page, in a real browser -----------------------------------------------------------------


def test_page_streams_and_colours_draft_tokens(served, models):
    from tests.browser import Page, find_chromium

    if find_chromium() is None:
        if os.environ.get("TINYDRAFT_REQUIRE_BROWSER") == "1":  # CI installs it (.ci/run)
            pytest.fail("TINYDRAFT_REQUIRE_BROWSER=1 but chromium is not installed")
        pytest.skip("chromium is not installed (apt install chromium): the page is not loaded")
    pytest.importorskip("websockets", reason="the browser test drives chromium over websockets")
    text, _ = reference(models, "def parse_args(", 48)
    with Page(f"{served.url}/?autorun=1&max_tokens=48&k=4") as page:
        assert page.wait_done() == "done"
        shown = page.read()
    assert shown["error"] == ""
    spans = shown["spans"]
    assert spans[0] == ["p", "def parse_args("]
    assert "".join(t for _, t in spans[1:]) == text
    assert {c for c, _ in spans[1:]} == {"d", "t"}  # both kinds of token shown
    assert shown["tokens"] == "48" and shown["acceptance"].endswith(")")

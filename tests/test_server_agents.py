"""What agents use: tool calls through OpenAI's API, Anthropic's Messages API, and /metrics, on
the demo pair (its tokenizer's own ChatML template, which renders tools as Qwen2.5's does), served
batched from this process, through the official `openai` and `anthropic` clients.

A tool call is made to happen with a test-only logits processor that forces the target to write a
known text (added to the job by wrapping the worker's `submit`): the parsing, the replies and the
next turn are then exercised end to end. Answers after a tool result are plain greedy decoding of
the same conversation by the library (`stream_generate`, no draft), computed while the server is
idle.
"""

from __future__ import annotations

import json
from dataclasses import replace

import anthropic
import httpx
import mlx.core as mx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_server import Served
from tinydraft_mlx import load_models, stream_generate
from tinydraft_mlx.server import Defaults, create_app
from tinydraft_mlx.serving.service import Spec
from tinydraft_mlx.serving.worker import Worker

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Forcing:
    """A logits processor that makes the target write `ids` after the prompt, then EOS."""

    def __init__(self, prompt_len: int, ids: list[int], eos: int) -> None:
        self.prompt_len, self.ids = prompt_len, [*ids, eos]

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        at = tokens.shape[-1] - self.prompt_len
        if at >= len(self.ids):
            return logits
        one = mx.arange(logits.shape[-1]) == self.ids[at]
        forced = mx.where(one, 0.0, -1e9).astype(logits.dtype)
        return mx.broadcast_to(forced, logits.shape)


@pytest.fixture(scope="module")
def models():
    return load_models()  # the demo tokenizer keeps its own template (tools, tool calls)


@pytest.fixture(scope="module")
def served(models):
    target, draft, tokenizer = models
    worker = Worker(target, draft, tokenizer, cache_bytes=64 << 20, max_queue=16, max_batch=4)
    app = create_app(worker, "demo", Defaults(k=3, max_tokens=24))
    s = Served(app)
    s.worker, s.app = worker, app
    yield s
    s.close()


@pytest.fixture
def force(served, models, monkeypatch):
    """force(text): the next requests' replies are `text` (then EOS), whatever the model says;
    force(None): the model's own again."""
    tokenizer = models[2]
    submit = served.worker.submit

    def forcing(text: str | None) -> None:
        if text is None:  # the model's own replies again
            monkeypatch.setattr(served.worker, "submit", submit)
            return
        ids = list(tokenizer.encode(text, add_special_tokens=False))

        def wrapped(job):
            job.options = replace(job.options, logits_processors=(
                Forcing(len(job.prompt), ids, tokenizer.eos_token_id),))
            submit(job)

        monkeypatch.setattr(served.worker, "submit", wrapped)

    return forcing


def oa_client(served) -> openai.OpenAI:
    return served.client()


def an_client(served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=60)


def greedy(models, messages, max_tokens, tools=None) -> tuple[str, int]:
    """(text, prompt tokens) of plain greedy decoding of `messages` through the template."""
    target, _, tokenizer = models
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                         tokenize=False)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    out = list(stream_generate(target, None, tokenizer, ids, max_tokens=max_tokens))
    return "".join(r.text for r in out), len(ids)


# -- OpenAI tool calls ---------------------------------------------------------------------------


def test_a_tool_call_round_trip_through_the_openai_client(served, models, force):
    force(CALL)
    client = oa_client(served)
    first = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER, CLOCK],
                                           max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    served.wait_idle()

    # the next turn: the call and its result; the answer is the model's own (no forcing)
    force(None)
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    as_template = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    expected, prompt_len = greedy(models, as_template, 20, tools=[WEATHER, CLOCK])
    second = client.chat.completions.create(model="demo", messages=turn,
                                            tools=[WEATHER, CLOCK], max_tokens=20)
    assert second.choices[0].message.content == expected
    assert second.usage.prompt_tokens == prompt_len
    # the first turn's prompt and call were reused from the prompt cache
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_streamed_tool_calls_arrive_as_delta_tool_calls(served, force):
    force("Checking.\n" + CALL + "\n" + CALL.replace("Paris", "Lyon"))
    stream = oa_client(served).chat.completions.create(
        model="demo", messages=ASK, tools=[WEATHER], max_tokens=160, stream=True)
    text, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            entry["name"] += piece.function.name or ""
            entry["arguments"] += piece.function.arguments or ""
            assert piece.id
        finish = chunk.choices[0].finish_reason or finish
    assert text == "Checking.\n\n"
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # bad JSON
    '<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>',  # not offered
    '<tool_call>\n{"name": "get_weather", "argu',  # cut off by the end of the reply
], ids=["bad-json", "unknown-tool", "unfinished"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_malformed_tool_call_text_comes_back_as_text(served, force, text, stream):
    force(text)
    client = oa_client(served)
    if stream:
        chunks = list(client.chat.completions.create(model="demo", messages=ASK,
                                                     tools=[WEATHER], max_tokens=60,
                                                     stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert not any(c.choices[0].delta.tool_calls for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER],
                                                max_tokens=60).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        assert not choice.message.tool_calls
    assert content == text
    assert finish == "stop"


def test_tool_choice_required_and_named_start_the_reply_with_a_call(served, models, force):
    app_service = served.app.state.service
    tokenizer = models[2]
    spec = Spec(messages=ASK, tools=[WEATHER, CLOCK], tool_choice={"name": "get_time"})
    plan = app_service.plan(spec)
    prompt = tokenizer.decode(plan.prompt)
    assert prompt.endswith("<|im_start|>assistant\n<tool_call>")
    assert "get_time" in prompt and "get_weather" not in prompt  # only the named tool
    required = app_service.plan(Spec(messages=ASK, tools=[WEATHER, CLOCK],
                                     tool_choice="required"))
    text = tokenizer.decode(required.prompt)
    assert text.endswith("<tool_call>") and "get_time" in text and "get_weather" in text
    none = app_service.plan(Spec(messages=ASK, tools=[WEATHER], tool_choice="none"))
    assert "get_weather" not in tokenizer.decode(none.prompt)

    # through HTTP: the prompt ends with the start marker, the forced rest is the call
    force(CALL[len("<tool_call>"):])
    choice = oa_client(served).chat.completions.create(
        model="demo", messages=ASK, tools=[WEATHER], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("body,param,text", [
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type",
     '"function"'),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(served, body, param, text):
    r = httpx.post(f"{served.url}/v1/chat/completions",
                   json={"messages": ASK, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and text in error["message"], error


# -- Anthropic's Messages API --------------------------------------------------------------------


SYSTEM = "You write Python."
CODE = [{"role": "user", "content": "def parse_args("}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_messages_give_the_chat_completions_text(served, models, stream):
    chat = oa_client(served).chat.completions.create(
        model="demo", messages=[{"role": "system", "content": SYSTEM}, *CODE], max_tokens=24)
    expected = chat.choices[0].message.content
    assert expected == greedy(models, [{"role": "system", "content": SYSTEM}, *CODE], 24)[0]
    served.wait_idle()
    client = an_client(served)
    if stream:
        with client.messages.stream(model="demo", max_tokens=24, system=SYSTEM,
                                    messages=CODE) as events:
            kinds = [e.type for e in events]
            message = events.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert kinds[-2] == "message_delta" and "content_block_start" in kinds
        assert kinds.index("content_block_start") < kinds.index("content_block_delta") < \
            kinds.index("content_block_stop")
    else:
        message = client.messages.create(model="demo", max_tokens=24, system=SYSTEM,
                                         messages=CODE)
    assert message.role == "assistant" and message.type == "message"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == expected
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat.choices[0].finish_reason]
    assert message.usage.output_tokens == chat.usage.completion_tokens
    # the same conversation: the second time its prompt comes from the prompt cache
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == \
        chat.usage.prompt_tokens
    assert message.usage.cache_read_input_tokens > 0


def test_a_tool_use_round_trip_through_the_anthropic_client(served, models, force):
    force("Let me look.\n" + CALL)
    client = an_client(served)
    tools = [{"name": "get_weather", "description": "The weather in a city now",
              "input_schema": WEATHER["function"]["parameters"]}]
    first = client.messages.create(model="demo", max_tokens=60, messages=ASK, tools=tools)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"]
    assert first.content[0].text == "Let me look.\n"
    use = first.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id
    served.wait_idle()
    force(None)
    turn = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "sunny, 21 C"}]}]
    as_template = [*ASK, {"role": "assistant", "content": "Let me look.\n", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "get_weather",
                                                        "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"}]
    expected, prompt_len = greedy(models, as_template, 20, tools=[WEATHER])
    with client.messages.stream(model="demo", max_tokens=20, messages=turn,
                                tools=tools) as events:
        second = events.get_final_message()
    assert second.content[0].text == expected
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == prompt_len
    count = client.messages.count_tokens(model="demo", messages=turn, tools=tools)
    assert count.input_tokens == prompt_len


def test_streamed_tool_use_is_a_block_with_its_input_as_json(served, force):
    force(CALL[len("<tool_call>"):])  # "any": the prompt ends with the start marker
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    with an_client(served).messages.stream(model="demo", max_tokens=60, messages=ASK,
                                           tools=tools, tool_choice={"type": "any"}) as events:
        raw = list(events)
        message = events.get_final_message()
    starts = [e.content_block.type for e in raw if e.type == "content_block_start"]
    assert starts == ["tool_use"]
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta"
               for e in raw)
    assert message.stop_reason == "tool_use"
    assert message.content[0].input == {"city": "Paris"}


def test_stop_sequences_and_prefill(served, models):
    client = an_client(served)
    full = greedy(models, CODE, 24)[0]
    stop = full[8:11]
    assert stop.strip() and full.find(stop) == 8
    message = client.messages.create(model="demo", max_tokens=24, messages=CODE,
                                     stop_sequences=[stop, "never written"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == full[:8]
    # a final assistant message is the reply's start: the reply continues it
    target, _, tokenizer = models
    prompt = tokenizer.apply_chat_template(CODE, add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer.encode(prompt + "import", add_special_tokens=False))
    expected = "".join(r.text for r in stream_generate(target, None, tokenizer, ids,
                                                       max_tokens=12))
    prefilled = client.messages.create(model="demo", max_tokens=12, messages=[
        *CODE, {"role": "assistant", "content": "import"}])
    assert prefilled.content[0].text == expected


@pytest.mark.parametrize("body,status,kind,text", [
    ({"messages": CODE}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": CODE, "model": "claude-3"}, 404, "not_found_error",
     "not served here"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error", "fetches no URL"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "aGk="}}]}]}, 400, "invalid_request_error",
     "this model reads no images"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error", "'image'"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error", "role"),
    ({"max_tokens": 0, "messages": CODE}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": CODE, "tool_choice": {"type": "tool"},
      "tools": [{"name": "f", "input_schema": {}}]}, 400, "invalid_request_error", "name"),
])
def test_bad_messages_requests_get_anthropics_error_body(served, body, status, kind, text):
    body = {"model": "demo", **body}
    r = httpx.post(f"{served.url}/v1/messages", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind, error
    assert text in error["error"]["message"], error


def test_the_anthropic_client_raises_its_own_errors(served):
    client = an_client(served)
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-3", max_tokens=4, messages=CODE)
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="demo", max_tokens=4, messages=CODE,
                               stop_sequences=[""])


# -- metrics -------------------------------------------------------------------------------------


def scrape(served) -> dict[tuple[str, tuple], float]:
    r = httpx.get(f"{served.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_metrics_move_as_requests_run(served):
    served.wait_idle()
    before = scrape(served)
    client = oa_client(served)
    reply = client.chat.completions.create(model="demo", messages=CODE, max_tokens=16)
    tokens = reply.usage.completion_tokens
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=CODE, max_tokens=-1)
    an_client(served).messages.create(model="demo", max_tokens=8, messages=CODE)
    served.wait_idle()
    after = scrape(served)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("tinydraft_requests_total", endpoint="chat", outcome="completed") == 1
    assert moved("tinydraft_requests_total", endpoint="chat", outcome="rejected") == 1
    assert moved("tinydraft_requests_total", endpoint="messages", outcome="completed") == 1
    assert moved("tinydraft_generation_tokens_total") == tokens + 8
    assert moved("tinydraft_time_to_first_token_seconds_count") == 2
    assert moved("tinydraft_inter_token_latency_seconds_count") == tokens + 8 - 2
    assert moved("tinydraft_prompt_tokens_total") == reply.usage.prompt_tokens * 2
    assert moved("tinydraft_draft_tokens_total", draft="model") > 0
    assert moved("tinydraft_accepted_tokens_total", draft="model") >= 0
    assert 0 <= after["tinydraft_acceptance_rate", (("draft", "model"),)] <= 1
    assert moved("tinydraft_prompt_cache_hits_total") >= 1  # the second request's prefix
    assert after["tinydraft_queue_depth", ()] == 0
    assert after["tinydraft_batch_size", ()] == 0
    assert after["tinydraft_prompt_cache_bytes", ()] > 0


def test_refusals_are_counted_once_where_they_were_sent(served):
    """A body over the limit is one rejected request of its endpoint whether its Content-Length
    says so up front or it arrives chunked; a GET to a POST endpoint (405) is not a request of
    that endpoint; an empty body is a 400 that says the body is empty."""
    big = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'

    def chunks():
        for i in range(0, len(big), 1 << 20):
            yield big[i: i + (1 << 20)]

    served.wait_idle()
    before = scrape(served)
    up_front = httpx.post(served.url + "/v1/completions", content=big, timeout=30,
                          headers={"content-type": "application/json"})
    chunked = httpx.post(served.url + "/v1/completions", content=chunks(), timeout=30,
                         headers={"content-type": "application/json"})
    wrong_method = httpx.get(served.url + "/v1/completions", timeout=10)
    empty = httpx.post(served.url + "/v1/completions", content=b"", timeout=10,
                       headers={"content-type": "application/json"})
    after = scrape(served)
    assert [r.status_code for r in (up_front, chunked, wrong_method, empty)] == \
        [413, 413, 405, 400]
    assert "body is empty" in empty.json()["error"]["message"]
    key = ("tinydraft_requests_total", (("endpoint", "completions"), ("outcome", "rejected")))
    assert after.get(key, 0.0) - before.get(key, 0.0) == 3  # both 413s and the empty body
    other = [k for k in after if k[0] == "tinydraft_requests_total" and
             ("endpoint", "/v1/completions") in k[1]]
    assert not other, other

"""The server with batching on (`--max-batch 8`): concurrent requests share speculative rounds,
each exact, through the official `openai` client against the served app (the rest of the
server's behaviour is tested with batching on and off in test_server.py).

References come from the library alone (`stream_generate`), computed before the load starts:
greedy texts are plain greedy decoding's, seeded samples the library's with the same seed,
draft and k (a seeded sequence draws with its own key, whatever shares its batch).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.test_server import PROMPTS, TEMPLATE, Served
from tinydraft_mlx import Hybrid, load_models, stream_generate
from tinydraft_mlx.server import Defaults, create_app
from tinydraft_mlx.serving.worker import Worker


@pytest.fixture(scope="module")
def models():
    target, draft, tokenizer = load_models()
    tokenizer.chat_template = TEMPLATE
    return target, draft, tokenizer


@pytest.fixture(scope="module")
def batched(models):
    target, draft, tokenizer = models
    worker = Worker(target, draft, tokenizer, cache_bytes=64 << 20, max_queue=64, max_batch=8)
    s = Served(create_app(worker, "demo", Defaults(k=4, max_tokens=32)))
    yield s
    s.close()


def _library(models, prompt: str, draft: str, **kwargs) -> str:
    target, model, tokenizer = models
    d = {"model": model, "none": None, "hybrid": Hybrid(model)}.get(draft, draft)
    return "".join(r.text for r in stream_generate(target, d, tokenizer, prompt, **kwargs))


# (settings sent, the library's equivalent): greedy at several k and drafts, seeded samples,
# a stop string, different max_tokens
SETTINGS = [
    (dict(max_tokens=24, extra_body={"num_draft_tokens": 3}),
     dict(max_tokens=24, k=3, draft="model")),
    (dict(max_tokens=17, temperature=0.7, seed=5, extra_body={"num_draft_tokens": 2}),
     dict(max_tokens=17, temperature=0.7, seed=5, k=2, draft="model")),
    (dict(max_tokens=30, extra_body={"draft": "prompt-lookup", "num_draft_tokens": 4}),
     dict(max_tokens=30, k=4, draft="prompt-lookup")),
    (dict(max_tokens=12, extra_body={"draft": "none"}), dict(max_tokens=12, draft="none")),
    (dict(max_tokens=20, temperature=0.9, top_p=0.9, seed=77,
          extra_body={"draft": "none"}),
     dict(max_tokens=20, temperature=0.9, top_p=0.9, seed=77, draft="none")),
    (dict(max_tokens=28, stop=["\n"], extra_body={"num_draft_tokens": 5}),
     dict(max_tokens=28, stop=["\n"], k=5, draft="model")),
    (dict(max_tokens=26, extra_body={"draft": "hybrid", "num_draft_tokens": 3}),
     dict(max_tokens=26, k=3, draft="hybrid")),
    # seeded samples with a fixed draft: a hybrid's source per round follows measured speed, so
    # its seeded sample can differ from run to run (as k="auto"'s); greedy hybrid is above
    (dict(max_tokens=22, temperature=0.8, seed=9, extra_body={"num_draft_tokens": 4}),
     dict(max_tokens=22, temperature=0.8, seed=9, k=4, draft="model")),
]


def test_concurrent_mixed_requests_are_each_exact(batched, models):
    """8 streaming clients x 4 requests of mixed settings at once: every text is the library's
    for that prompt and those settings, alone; the batch really held several requests."""
    jobs = [(i, j, PROMPTS[(i + j) % len(PROMPTS)], SETTINGS[(i * 4 + j) % len(SETTINGS)])
            for i in range(8) for j in range(4)]
    expected = {}
    for i, j, prompt, (_, lib) in jobs:
        lib = dict(lib)
        expected[(i, j)] = _library(models, prompt, lib.pop("draft"), **lib)
    client = openai.AsyncOpenAI(base_url=f"{batched.url}/v1", api_key="unused", max_retries=0,
                                timeout=120)
    widest = {"batch": 0}

    async def watch():
        async with httpx.AsyncClient() as http:
            while True:
                health = (await http.get(f"{batched.url}/health")).json()
                widest["batch"] = max(widest["batch"], health["batch"])
                await asyncio.sleep(0.02)

    async def one_client(i: int) -> dict:
        out = {}
        for j in range(4):
            _, _, prompt, (sent, _) = jobs[i * 4 + j]
            stream = await client.completions.create(model="demo", prompt=prompt, stream=True,
                                                     **sent)
            out[(i, j)] = "".join([c.choices[0].text async for c in stream if c.choices])
        return out

    async def everything():
        watcher = asyncio.create_task(watch())
        try:
            results = await asyncio.gather(*(one_client(i) for i in range(8)))
        finally:
            watcher.cancel()
            await client.close()
        return {k: v for r in results for k, v in r.items()}

    got = asyncio.run(everything())
    assert got == expected
    assert widest["batch"] >= 4
    health = batched.wait_idle()
    assert health["max_batch"] == 8 and health["batch"] == 0


def test_a_disconnect_and_a_failure_mid_batch_leave_the_others_exact(batched, models,
                                                                      monkeypatch):
    """Among 6 streaming requests: one client hangs up after 4 chunks, one request's text layer
    fails at its 5th token (an error event after its first chunks). Both leave the batch within
    a round; the other 4 finish exact; the server goes on."""
    import tinydraft_mlx.serving.worker as worker_module

    batched.wait_idle()
    health = batched.health()
    before = dict(health["requests"])
    victim = "x = [1, 2, 3, 4, 5, 6]"  # its prompt's length (20 tokens) identifies it below
    victim_len = len(models[2].encode(victim))
    original = worker_module._piece

    def piece(response, logprobs):
        if response.prompt_tokens == victim_len and response.generation_tokens == 5:
            raise RuntimeError("one sequence exploded")
        return original(response, logprobs)

    monkeypatch.setattr(worker_module, "_piece", piece)
    others = ["def parse_args(", "class Config:", "import os\n", "for i in range("]
    assert all(len(models[2].encode(p)) != victim_len for p in others + ["def main():\n"])
    expected = {p: _library(models, p, "model", max_tokens=40, k=3) for p in others}

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            async def stream(prompt: str, hang_up_after: int | None = None) -> list[str]:
                body = {"prompt": prompt, "max_tokens": 40 if hang_up_after is None else 2000,
                        "stream": True, "num_draft_tokens": 3}
                lines = []
                async with http.stream("POST", f"{batched.url}/v1/completions",
                                       json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            if hang_up_after is not None and len(lines) >= hang_up_after:
                                break
                return lines

            return await asyncio.gather(stream("def main():\n", hang_up_after=4),
                                        stream(victim), *(stream(p) for p in others))

    results = asyncio.run(run())

    def text(lines):
        return "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1]
                       if x != "[DONE]" and "choices" in json.loads(x))

    failed = results[1]
    assert failed[-1] == "[DONE]" and '"generation_failed"' in failed[-2]
    assert "exploded" not in failed[-2]  # the exception is the server log's, not the client's
    assert len([x for x in failed[:-2] if "choices" in json.loads(x)]) == 4
    for prompt, lines in zip(others, results[2:]):
        assert text(lines) == expected[prompt]
    health = batched.wait_idle(timeout=5)
    counts = health["requests"]
    assert counts.get("cancelled", 0) == before.get("cancelled", 0) + 1
    assert counts.get("failed", 0) == before.get("failed", 0) + 1
    assert counts["completed"] == before.get("completed", 0) + 4
    monkeypatch.setattr(worker_module, "_piece", original)
    r = batched.client().completions.create(model="demo", prompt=victim, max_tokens=20,
                                            extra_body={"num_draft_tokens": 3})
    assert r.choices[0].text == _library(models, victim, "model", max_tokens=20, k=3)


@pytest.mark.serial  # bounds a wall-clock time: run alone
def test_a_long_prompt_joining_does_not_stall_the_running_streams(batched, models):
    """A 3.9k-token prompt joins while a stream runs: its prefill is chunked between rounds
    (`worker.JOIN_PREFILL_STEP` tokens), so the running stream's longest gap between chunks stays
    below 0.5 s and a fifth of the long request's time alone (~4 s here), and both requests are
    exact."""
    target, draft, tokenizer = models
    batched.wait_idle()
    long_prompt = "def f(x):\n    return x + 1\n" * 300  # within the demo's 4096 positions
    assert 3000 < len(tokenizer.encode(long_prompt)) < 4000
    start = time.perf_counter()
    expected_long = _library(models, long_prompt, "model", max_tokens=8, k=3)
    whole_prefill = time.perf_counter() - start  # prefill + 8 tokens, alone
    expected = _library(models, "def parse_args(", "model", max_tokens=200, k=3)

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            async def running() -> tuple[str, float]:
                body = {"prompt": "def parse_args(", "max_tokens": 200, "stream": True,
                        "num_draft_tokens": 3}
                pieces, gaps, last = [], [], None
                async with http.stream("POST", f"{batched.url}/v1/completions",
                                       json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            now = time.perf_counter()
                            if last is not None and len(pieces) > 20:
                                gaps.append(now - last)
                            last = now
                            pieces.append(line)
                text = "".join(json.loads(p[6:])["choices"][0]["text"] for p in pieces)
                return text, max(gaps)

            async def joiner() -> str:
                await asyncio.sleep(0.15)
                r = await http.post(f"{batched.url}/v1/completions",
                                    json={"prompt": long_prompt, "max_tokens": 8,
                                          "num_draft_tokens": 3})
                return r.json()["choices"][0]["text"]

            return await asyncio.gather(running(), joiner())

    (text, gap), long_text = asyncio.run(run())
    assert text == expected and long_text == expected_long
    assert gap < 0.5 and gap < whole_prefill / 5, (gap, whole_prefill)  # 512-token chunks: 0.75

"""Drafters are plug-ins: one protocol (engine/drafters.py's `Source`) and a registry of names.

A drafter written here, in the test file, that nothing under tinydraft_mlx/ knows: `LastTokens`
guesses each next token as the one that followed the latest earlier occurrence of the token
before it, and samples its proposal from a q of its own (70% on the guess, the rest spread over
its vocabulary, 64 ids narrower than the target's), with a generator of its own. Registered as
"last-tokens", it runs through `generate`, `batch_generate`, a prompt cache and the server.

The exactness tests iterate the registry (`registered_drafters()`, as collected: every built-in
drafter and this one), so a drafter is tested by being registered:
- greedy == the transformers fp32 oracle, one sequence each, and every drafter in one batch;
- sampled (T = 1, top-p 0.8), unseeded (the rejection rule with each drafter's q) and seeded
  plain decoding (the Gumbel-max draws): the first two tokens' joint over 2,000 rows (batches of
  100, each row from a copy of the prompt's prefilled caches) against the oracle's exact joint,
  Pearson's chi-square below the Wilson-Hilferty 1 - 3.2e-5 quantile (cells of expected count
  < 5 pooled; an outcome the warp rules out fails outright);
  the same samples scored against the joint without top-p must exceed it (the test can tell a
  wrong distribution apart);
- a seed fixes the text: seeded speculative == seeded plain decoding, with every drafter (so
  seeded drafting is exact wherever seeded plain decoding is).
The models are the tiny Qwen3 target with every kind of drafter (conftest.py's `eagle` and
`dflash`).
"""

from __future__ import annotations

import httpx
import mlx.core as mx
import numpy as np
import pytest

from tests.fixtures import VOCAB
from tests.reference import check_first_two_tokens, drain, two_step_joint
from tinydraft_mlx import BatchDecoder, PromptCache, SamplingParams, batch_generate, generate
from tinydraft_mlx.engine.drafters import (
    HostDrafter,
    HostProposal,
    drafter_names,
    register_drafter,
    registered_drafters,
    resolve_drafter,
    unregister_drafter,
)

pytestmark = pytest.mark.usefixtures("cpu_fp32")

NEW = 24
ROWS, BATCHES = 100, 20  # 2,000 samples of the first two tokens per case


class LastTokens(HostDrafter):
    """The plug-in (see the module docstring)."""

    name = policy_key = "last-tokens"
    GUESS = 0.7  # q's mass on the guess

    def __init__(self, width: int = VOCAB, seed: int | None = None) -> None:
        self.width, self.seq = width, []
        self.rng = np.random.default_rng(seed)

    def begin(self, seq: list[int]) -> None:
        self.seq = seq

    def _after(self, token: int) -> int:
        """The token after the latest earlier occurrence of `token` (itself if none)."""
        for i in range(len(self.seq) - 2, -1, -1):
            if self.seq[i] == token:
                return self.seq[i + 1]
        return token

    def host_proposal(self, k: int) -> list[int] | HostProposal | None:
        if not k:
            return []
        guesses, last = [], self.seq[-1]
        for _ in range(k):
            last = self._after(last)
            last = last if last < self.width else 0  # an id its vocabulary lacks
            guesses.append(last)
        q = np.full((k, self.width), (1 - self.GUESS) / self.width)
        q[np.arange(k), guesses] += self.GUESS
        tokens = [int(self.rng.choice(self.width, p=row)) for row in q]
        return HostProposal(tokens, mx.array(q, dtype=mx.float32))


def _make(model, target):
    return LastTokens()


register_drafter(LastTokens.name, _make)
NAMES = registered_drafters()  # what the tests below run over: the registry, this one included
unregister_drafter(LastTokens.name)  # registered only while this module's tests run


@pytest.fixture(scope="module", autouse=True)
def last_tokens():
    register_drafter(LastTokens.name, _make)
    yield
    unregister_drafter(LastTokens.name)


def _model_for(name: str, eagle, dflash) -> object:
    """The batch's draft model with which `name` is available (the draft model, else the
    EAGLE-3 head, else the DFlash drafter, else none)."""
    _, _, (target, head, _), draft, _, _ = eagle
    for model in (draft, head, dflash, None):
        if name in drafter_names(model, target):
            return model
    raise AssertionError(f"{name} is available with none of the fixture's models")


def _source(name: str, eagle, dflash):
    target = eagle[2][0]
    return resolve_drafter(name, _model_for(name, eagle, dflash), target)


def test_the_registry_holds_every_drafter():
    assert {"none", "prompt-lookup", "model", "hybrid", "mtp", "eagle3", "dflash",
            LastTokens.name} <= set(NAMES)


# -- greedy ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_the_oracle(eagle, dflash, name):
    _, _, (target, _, tok), _, refs, _ = eagle
    drafted = 0
    for ids, ref in refs:
        out, stats = generate(target, _source(name, eagle, dflash), tok, ids, k=3, max_tokens=NEW)
        assert out == ref, name
        drafted += stats.drafted
    assert drafted > 0 or name == "none"


def test_every_drafter_in_one_greedy_batch_equals_the_oracle(eagle, dflash):
    _, _, (target, _, tok), draft, refs, _ = eagle
    decoder = BatchDecoder(target, draft)
    want = {}
    for name in NAMES:
        for ids, ref in refs:
            uid = decoder.insert(ids, draft=_source(name, eagle, dflash), k=3, max_tokens=NEW)
            want[uid] = (name, ref)
    out = drain(decoder)
    for uid, (name, ref) in want.items():
        assert out[uid] == ref, name


# -- sampled --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def copying(eagle):
    """A prompt P ending with a trigram that occurred earlier followed by (a, b), a likely
    after P: prompt lookup and "last-tokens" propose a and b; the exact joint at T = 1, top-p
    0.8, and the one without top-p (what must be told apart)."""
    _, _, _, _, refs, oracle = eagle
    ids = refs[0][0]
    a, b = oracle.greedy(ids, 2)[0]
    for _ in range(4):
        a = int(np.argmax(oracle.logits(ids + [a, b] + ids[-3:])[-1]))
    prompt = ids + [a, b] + ids[-3:]
    exact = two_step_joint(oracle.logits, prompt, temperature=1.0, top_p=0.8)
    wrong = two_step_joint(oracle.logits, prompt, temperature=1.0)
    assert 10 < len(exact) < 2000
    return prompt, exact, wrong


CASES = [(name, False) for name in NAMES] + [("none", True)]  # seeded: plain decoding's draws;
# a seeded row's text with any drafter is plain seeded decoding's (test_a_seed_fixes_the_text)


@pytest.mark.parametrize("name,seeded", CASES,
                         ids=[f"{n}-{'seeded' if s else 'unseeded'}" for n, s in CASES])
def test_sampled_first_two_tokens_follow_the_oracle(eagle, dflash, copying, name, seeded):
    target = eagle[2][0]
    prompt, exact, wrong = copying
    model = _model_for(name, eagle, dflash)
    check_first_two_tokens(
        lambda: BatchDecoder(target, model), prompt, name, ROWS * BATCHES, exact, wrong,
        rows=ROWS, both_paths=name != "none",  # accepted and resampled both, where it drafts
        sampling=lambda seed: SamplingParams(1.0, top_p=0.8, seed=seed if seeded else None))


@pytest.mark.parametrize("name", NAMES)
def test_a_seed_fixes_the_text(eagle, dflash, name):
    _, _, (target, _, tok), _, refs, _ = eagle
    kw = dict(max_tokens=NEW, temperature=0.8, top_p=0.95, seed=7)
    for ids, _ in refs:
        plain, _ = generate(target, None, tok, ids, **kw)
        assert generate(target, _source(name, eagle, dflash), tok, ids, k=3, **kw)[0] == plain, name


# -- the plug-in everywhere a drafter goes --------------------------------------------------------
def test_the_plug_in_runs_through_the_api_batches_and_a_prompt_cache(eagle):
    _, _, (target, _, tok), _, refs, _ = eagle
    out, stats = generate(target, LastTokens.name, tok, refs[0][0], k=3, max_tokens=NEW)
    assert out == refs[0][1] and stats.drafted > 0
    batch = batch_generate(target, LastTokens.name, tok, [ids for ids, _ in refs], k=3,
                           max_tokens=NEW)
    assert [tokens for tokens, _ in batch] == [ref for _, ref in refs]
    cache = PromptCache(target, LastTokens.name)
    ids, ref = refs[1]
    first, _ = generate(target, LastTokens.name, tok, ids, k=3, max_tokens=NEW // 2,
                        prompt_cache=cache)
    second, stats = generate(target, LastTokens.name, tok, ids + first, k=3,
                             max_tokens=NEW - NEW // 2, prompt_cache=cache)
    assert first + second == ref and stats.cached_tokens == len(ids) + len(first) - 1


def test_the_plug_in_is_served_as_the_default_and_by_name(eagle):
    from tests.test_server import Served
    from tinydraft_mlx.server import Defaults, create_app
    from tinydraft_mlx.serving.worker import Worker

    _, _, (target, _, tok), draft, refs, _ = eagle
    worker = Worker(target, draft, tok, cache_bytes=16 << 20, max_batch=4)
    served = Served(create_app(worker, "tiny", Defaults(k=3, draft=LastTokens.name)))
    try:
        assert served.health()["draft"] == LastTokens.name
        for body in ({}, {"draft": LastTokens.name}, {"draft": "model"}):
            r = httpx.post(served.url + "/v1/completions", timeout=60, json={
                "prompt": refs[0][0], "max_tokens": NEW, "temperature": 0, **body})
            assert r.status_code == 200, r.text
            reply = r.json()
            assert reply["choices"][0]["tinydraft"]["token_ids"] == refs[0][1]
            assert reply["usage"]["speculative"]["draft"] == body.get("draft", LastTokens.name)
            assert reply["usage"]["speculative"]["drafted"] > 0
    finally:
        served.close()

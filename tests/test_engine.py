"""The decode loop's bookkeeping: cache round-trips, early close, EOS inside an accepted run,
max_tokens below k, and the statistics' invariants."""


import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.ahead import record_chains
from tests.scripted import ScriptedPolicy
from tinydraft_mlx import SamplingParams, generate, stream_generate
from tinydraft_mlx.engine.cache import cache_length, make_cache, rollback
from tinydraft_mlx.engine.forward import model_inputs
from tinydraft_mlx.engine.speculative import decode, prefill

PROMPT = "def parse_args(self, args=None, namespace=None):"


@pytest.fixture(scope="module")
def reference(pair):
    """Plain greedy continuation (itself checked against the oracle in test_lossless)."""
    target, _, tok = pair
    ids = tok.encode(PROMPT)
    return ids, generate(target, None, tok, ids, max_tokens=64)[0]


@pytest.fixture(scope="module")
def same_pair(load):
    """Target and an identical draft: every round is fully accepted."""
    return load("target", "target")


def _assert_cache_holds(model, cache, ids):
    """The cache's keys/values equal a fresh prefill of `ids` (fp32; only summation order differs
    between chunked and one-shot attention, hence the 1e-4 tolerance)."""
    assert cache_length(cache) == len(ids)
    fresh = make_cache(model)
    prefill(model, fresh, ids)
    for ours, ref in zip(cache, fresh):
        k_ours, v_ours = (x[..., : len(ids), :] for x in ours.state[:2])
        k_ref, v_ref = (x[..., : len(ids), :] for x in ref.state[:2])
        np.testing.assert_allclose(np.array(k_ours), np.array(k_ref), atol=1e-4)
        np.testing.assert_allclose(np.array(v_ours), np.array(v_ref), atol=1e-4)


def test_cache_rollback_is_offset_only(pair):
    target, _, tok = pair
    cache = make_cache(target)
    prefill(target, cache, tok.encode(PROMPT))
    keys_before = cache[0].keys
    rollback(cache, 5)
    assert cache_length(cache) == 5 and cache[0].keys is keys_before  # no copy
    rollback(cache, 50)  # growing is not rollback: a no-op
    assert cache_length(cache) == 5


@pytest.mark.parametrize("k", [1, 3, 5])
def test_caches_hold_accepted_prefix_after_generation(pair, reference, k):
    target, draft, tok = pair
    ids, ref = reference
    tc, dc = make_cache(target), make_cache(draft)
    out = [t.id for t in decode(target, draft, ids, k=k, max_tokens=40, target_cache=tc,
                                draft_cache=dc)]
    assert out == ref[:40]
    seq = ids + out
    _assert_cache_holds(target, tc, seq[:-1])
    assert cache_length(dc) <= len(seq) - 1
    _assert_cache_holds(draft, dc, seq[: cache_length(dc)])


@pytest.mark.parametrize("stop_after", [1, 3, 7, 18])
def test_early_close_leaves_caches_consistent_and_resumable(same_pair, reference, stop_after):
    """Close mid-round (the identical draft makes rounds of 5 accepted tokens), then resume from
    the same caches: the continuation equals the uninterrupted greedy output."""
    target, draft, _ = same_pair
    ids, ref = reference
    tc, dc = make_cache(target), make_cache(draft)
    steps = decode(target, draft, ids, k=4, max_tokens=40, target_cache=tc, draft_cache=dc)
    got = []
    for token in steps:
        got.append(token.id)
        if len(got) == stop_after:
            break
    steps.close()
    assert token.stats.finish_reason == "closed"
    seq = ids + got
    _assert_cache_holds(target, tc, seq[:-1])
    _assert_cache_holds(draft, dc, seq[: cache_length(dc)])
    rest = [t.id for t in decode(target, draft, seq, k=4, max_tokens=40 - stop_after,
                                 target_cache=tc, draft_cache=dc)]
    assert got + rest == ref[:40]


def test_eos_inside_an_accepted_run(same_pair, reference):
    target, draft, _ = same_pair
    ids, ref = reference
    j = next(i for i in range(2, 4) if ref[i] not in ref[:i])  # inside the first 5-token round
    steps = list(decode(target, draft, ids, k=4, max_tokens=40, eos_token_ids={ref[j]}))
    assert [t.id for t in steps] == ref[: j + 1]  # EOS emitted, nothing after it
    assert steps[-1].finish_reason == "eos" and steps[-2].finish_reason is None
    assert all(t.from_draft for t in steps)  # the run really was accepted past EOS
    assert steps[-1].stats.finish_reason == "eos" and steps[-1].stats.accepted == 4


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_max_tokens_below_k(pair, reference, max_tokens):
    target, draft, tok = pair
    ids, ref = reference
    out, stats = generate(target, draft, tok, ids, k=8, max_tokens=max_tokens)
    assert out == ref[:max_tokens]
    # no round drafted more than it could emit: at most max_tokens - 1 positions ever used
    assert len(stats.position_reached) <= max_tokens - 1 and stats.finish_reason == "length"


def test_fully_accepted_rounds_feed_the_draft_two_tokens(same_pair, reference):
    target, draft, tok = same_pair
    ids, ref = reference
    out, stats = generate(target, draft, tok, ids, k=4, max_tokens=40)
    assert out == ref[:40]
    assert stats.rounds == 8 and stats.accepted_length_counts == [0, 0, 0, 0, 8]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stats_invariants(pair, temperature):
    target, draft, tok = pair
    steps = list(stream_generate(target, draft, tok, PROMPT, k=4, max_tokens=50,
                                 temperature=temperature, seed=3))
    stats = steps[-1].stats
    assert stats.generated == len(steps) == 50
    assert stats.generated == stats.accepted + stats.rounds  # each round: n drafts + 1 token
    assert sum(t.from_draft for t in steps) == stats.accepted
    assert sum(stats.accepted_length_counts) == stats.rounds
    # every round drafts except possibly the last (which may only have room for one token)
    assert stats.position_reached[0] in (stats.rounds, stats.rounds - 1)
    for i, (acc, reached) in enumerate(zip(stats.position_accepted, stats.position_reached)):
        assert acc <= reached
        if i + 1 < len(stats.position_reached):
            assert stats.position_reached[i + 1] <= acc  # reaching i+1 needs i accepted
    assert 0.0 < stats.acceptance_rate < 1.0
    assert stats.mean_accepted_length == pytest.approx(stats.accepted / stats.rounds)
    assert stats.prefill_seconds > 0 and stats.tokens_per_second > 0
    assert stats.peak_memory > 0  # mx.get_peak_memory(), GB
    line = stats.summary()
    assert "\n" not in line and "acceptance" in line and "tok/s" in line


def test_plain_summary(pair):
    target, _, tok = pair
    _, stats = generate(target, None, tok, PROMPT, max_tokens=5)
    assert stats.summary().startswith("plain decoding: 5 tokens")


def test_draft_none_string_means_plain_decoding(pair, reference):
    """"none" is accepted wherever a draft is named (load_models, the CLI, and here)."""
    target, _, tok = pair
    ids, ref = reference
    out, stats = generate(target, "none", tok, ids, max_tokens=12)
    assert out == ref[:12] and stats.drafted == 0 and stats.k == 0
    assert [r.token for r in stream_generate(target, "None", tok, ids, max_tokens=3)] == ref[:3]


class _Recording(ScriptedPolicy):
    """A k="auto" policy playing plain rounds, then k = 2, recording what each round cost."""

    SCHEDULE = (0, 0, 0, 0, 0, 2, 2)

    def __init__(self):
        super().__init__()
        self.updates, self.catch_ups, self.filled, self.calls = [], [], [], 0

    def choose(self, limit, caught_up=False):  # the n-th call chooses the n-th round
        self.calls += 1
        return min(self.SCHEDULE[(self.calls - 1) % len(self.SCHEDULE)], limit)

    def update(self, k, accepted, seconds, catch_up=0.0, filled=False):
        self.updates.append((k, seconds))
        self.catch_ups.append(catch_up)
        self.filled.append(filled)


def test_auto_books_the_drafts_catch_up_as_the_switch_cost(pair, monkeypatch):
    """After plain rounds the draft catches up on what it missed, like a prefill: k="auto" must
    see that time (a slowed catch-up shows) as the price of switching, apart from the round's
    own cost (what sustained drafting costs)."""
    import time

    import tinydraft_mlx.engine.drafters as drafters
    import tinydraft_mlx.engine.speculative as spec

    target, draft, tok = pair
    policy = _Recording()
    monkeypatch.setattr(spec, "shared_policy", lambda *args, **kwargs: policy)
    real, in_rounds = drafters.prefill, []

    def slow_catch_up(model, cache, tokens, *args, **kwargs):
        if in_rounds:
            time.sleep(0.2)
        return real(model, cache, tokens, *args, **kwargs)

    monkeypatch.setattr(drafters, "prefill", slow_catch_up)  # the draft model's catch-up
    steps = stream_generate(target, draft, tok, PROMPT, k="auto", max_tokens=20)
    next(steps)
    in_rounds.append(True)
    stats = list(steps)[-1].stats
    ks = [k for k, _ in policy.updates]  # the first round (plain, the target's alone) too
    assert ks[:8] == [0, 0, 0, 0, 0, 0, 2, 2] and 2 in ks[8:], ks
    switches = [i for i, c in enumerate(policy.catch_ups) if c > 0]
    # the draft started empty: its first catch-up fed it the prompt too (no switch's price);
    # the next is a switch back from plain rounds
    assert switches[0] == 6 and len(switches) >= 2, policy.catch_ups
    assert [policy.filled[i] for i in switches] == [True] + [False] * (len(switches) - 1)
    for i in switches:
        assert policy.catch_ups[i] >= 0.2 and policy.updates[i][1] < 0.2, (policy.catch_ups,
                                                                             policy.updates)
    assert policy.catch_ups[7] == 0.0 and policy.updates[7][1] < 0.2
    assert not any(policy.catch_ups[:6])  # plain rounds catch nothing up
    # the generation's statistics count them and their time (part of the decode time)
    assert stats.catch_ups == len(switches)
    assert stats.catch_up_seconds == pytest.approx(sum(policy.catch_ups))
    assert 0.2 * len(switches) <= stats.catch_up_seconds < stats.decode_seconds
    assert f"{len(switches)} catch-ups in" in stats.summary()


def test_auto_books_a_looks_evidence_with_the_catch_up_not_the_round(pair, monkeypatch):
    """Where the loop looks before it leaps, the catch-up's evidence (the draft's head on its
    last rows and, sampled, the warps of both sides) is part of the look's price: booked as the
    round's own time it made a k = 1 round after a look 2.4x a plain round at T = 0.7 where one
    costs 1.6x, and kept a warm process plain. A slowed evidence shows in the catch-up only."""
    import time

    import tinydraft_mlx.engine.speculative as spec

    class Looking(_Recording):
        LOOKS = True

    target, draft, tok = pair
    policy = Looking()
    monkeypatch.setattr(spec, "shared_policy", lambda *args, **kwargs: policy)
    real = spec._catch_up_evidence

    def slow_evidence(g, rows):
        time.sleep(0.2)
        return real(g, rows)

    monkeypatch.setattr(spec, "_catch_up_evidence", slow_evidence)
    list(stream_generate(target, draft, tok, PROMPT, k="auto", max_tokens=20))
    assert [k for k, _ in policy.updates[:7]] == [0, 0, 0, 0, 0, 0, 2]
    assert policy.catch_ups[6] >= 0.2, policy.catch_ups
    assert policy.updates[6][1] < 0.2, policy.updates


@pytest.mark.parametrize("schedule", [[0], [0, 0, 0, 3], [3, 0, 0, 0, 0, 0, 1]])
def test_auto_plain_stretches_switch_cleanly(pair, reference, monkeypatch, schedule):
    """k="auto" runs the plain rounds it picks as pipelined stretches that end when it picks a
    k again: greedy output unchanged, every round booked once (the first, plain whatever the
    policy says, too), caches hold seq[:-1]."""
    import tinydraft_mlx.engine.speculative as spec

    target, draft, tok = pair
    ids, ref = reference
    policy = _Recording()
    policy.SCHEDULE = tuple(schedule)
    monkeypatch.setattr(spec, "shared_policy", lambda *args, **kwargs: policy)
    tc, dc = make_cache(target), make_cache(draft)
    tokens = list(decode(target, draft, ids, k="auto", max_tokens=40, target_cache=tc,
                         draft_cache=dc))
    out = [t.id for t in tokens]
    assert out == ref[:40] and tokens[-1].finish_reason == "length"
    plain = sum(1 for k, _ in policy.updates if k == 0)
    drafted = [k for k, _ in policy.updates if k > 0]
    assert tokens[-1].stats.rounds == len(policy.updates) == plain + len(drafted)
    assert (plain == 40) == (schedule == [0]) and all(k <= max(schedule) for k in drafted)
    _assert_cache_holds(target, tc, (ids + out)[:-1])


@pytest.mark.parametrize("k", [None, "auto"])
def test_the_first_token_does_not_wait_for_a_queued_step(pair, reference, monkeypatch, k):
    """Plain decoding (and k="auto", whose first round is plain) reads the first token before it
    queues the next step: on MLX's CPU backend a token read with a step queued behind it waits
    for that step too. From the second token on, plain steps are pipelined (one queued ahead)."""
    import tinydraft_mlx.engine.speculative as spec

    target, draft, _ = pair
    ids, ref = reference
    queued = []
    real = spec._queue
    monkeypatch.setattr(spec, "_queue", lambda *a: queued.append(1) or real(*a))
    seen, out = [], []
    for token in decode(target, None if k is None else draft, ids, k=k or 1, max_tokens=12):
        seen.append(len(queued))
        out.append(token.id)
    assert out == ref[:12]
    assert seen[0] == 1, seen
    if k is None:  # pipelined after it: a step queued ahead of each token read
        assert seen[1:] == list(range(3, 13)) + [12], seen


class _Plain(ScriptedPolicy):
    SCHEDULE = (0,)
    LOOKS = True


class _DraftsLater(ScriptedPolicy):
    """Plain for six rounds (the first, forced plain, does not ask), then k = 2 twice, plain
    again and k = 1: a first catch-up from an empty draft, then a switch back."""

    SCHEDULE = (0, 0, 0, 0, 0, 2, 2, 0, 0, 0, 1, 0, 0, 0)
    LOOKS = True

    def __init__(self) -> None:
        super().__init__()
        self.filled: list[bool] = []

    def update(self, k: int, accepted: int, seconds: float, catch_up: float = 0.0,
               filled: bool = False) -> None:
        if catch_up > 0:
            self.filled.append(filled)


def test_auto_starts_the_draft_empty_and_fills_it_when_first_needed(pair, reference,
                                                                   monkeypatch):
    """k="auto" with a draft model: its policy is there from the first token, but nothing of the
    draft runs before it is needed: the first round is plain (the time to the first token is
    the target's alone), a generation that stays plain never fills the draft cache (nor counts
    a draft prefill), and the first catch-up (here the first drafting round) feeds the draft the
    prompt and what was generated, in step with the target after it, booked as a fill, not a
    switch, and measuring the draft/target cost ratio; the output is plain greedy decoding's.
    A one-token generation never fills the draft; a fixed k drafts from the first round, its
    draft prefilled before."""
    import tinydraft_mlx.engine.speculative as spec

    target, draft, _ = pair
    ids, ref = reference
    monkeypatch.setattr(spec, "shared_policy", lambda *args, **kwargs: _Plain())
    tc, dc = make_cache(target), make_cache(draft)
    held, policies, prefill_seconds, out = [], [], [], []
    for token in decode(target, draft, ids, k="auto", max_tokens=6, target_cache=tc,
                        draft_cache=dc):
        held.append(cache_length(dc))
        policies.append(token.stats.policy)
        prefill_seconds.append(token.stats.prefill_seconds)
        out.append(token.id)
    assert out == ref[:6] and held == [0] * 6, held
    assert all(isinstance(p, _Plain) for p in policies)
    assert len(set(prefill_seconds)) == 1 and prefill_seconds[0] > 0  # the target's prefill

    policy = _DraftsLater()
    monkeypatch.setattr(spec, "shared_policy", lambda *args, **kwargs: policy)
    tc, dc = make_cache(target), make_cache(draft)
    held, out = [], []
    for token in decode(target, draft, ids, k="auto", max_tokens=30, target_cache=tc,
                        draft_cache=dc):
        held.append((token.stats.rounds, cache_length(dc)))
        out.append(token.id)
    assert out == ref[:30]
    assert all(n == 0 for rounds, n in held if rounds <= 6), held  # untouched while plain
    assert held[6][0] == 7 and held[6][1] >= len(ids) + 6 - 1, held  # filled by round 7
    assert policy.filled[0] is True and False in policy.filled[1:], policy.filled
    assert 0 < policy.draft_ratio <= 1  # measured from the fill
    _assert_cache_holds(draft, dc, (ids + out)[: cache_length(dc)])

    dc = make_cache(draft)
    one = list(decode(target, draft, ids, k="auto", max_tokens=1, draft_cache=dc))
    assert [t.id for t in one] == ref[:1] and cache_length(dc) == 0

    dc = make_cache(draft)
    first = next(iter(decode(target, draft, ids, k=2, max_tokens=6, draft_cache=dc)))
    assert first.id == ref[0] and cache_length(dc) >= len(ids) - 1


def test_auto_tells_its_policy_what_the_drafts_first_catch_up_will_feed(pair, reference,
                                                                         monkeypatch):
    """Where the draft starts a generation empty, its first catch-up feeds it the prompt too:
    the policy prices a look before it as that fill (`DraftLengthPolicy.empty`, the tokens beyond
    the plain rounds), less what a prompt cache's draft cache already holds."""
    from tinydraft_mlx.engine import policy as policy_module
    from tinydraft_mlx.engine.forward import prefill

    target, draft, _ = pair
    ids, _ = reference
    monkeypatch.setattr(policy_module, "_SHARED", {})
    seen = []
    for held in (0, 5):
        dc = make_cache(draft)
        if held:
            prefill(draft, dc, ids[:held])
        first = next(iter(decode(target, draft, ids, k="auto", max_tokens=4, draft_cache=dc)))
        seen.append(first.stats.policy.empty)
    assert seen == [len(ids) - 1, len(ids) - 1 - 5], seen


def test_a_lookup_round_that_finds_nothing_is_a_plain_step(pair, reference, monkeypatch):
    """Prompt lookup with no earlier occurrence of the suffix proposes nothing: that round is a
    plain step, booked as a plain round whose time (an unpipelined step) is not taken as the cost
    of pipelined plain decoding; the output is plain greedy decoding's."""
    import tinydraft_mlx.engine.speculative as spec
    from tinydraft_mlx import PromptLookup

    target, _, _ = pair
    ids, ref = reference
    policy = _Recording()
    policy.SCHEDULE = (3,)  # always ask for 3 drafts
    monkeypatch.setattr(spec, "shared_policy", lambda *args, **kwargs: policy)
    tokens = list(decode(target, PromptLookup(), ids, k="auto", max_tokens=40))
    assert [t.id for t in tokens] == ref[:40]
    plain = [seconds for k, seconds in policy.updates if k == 0]
    # all but the last are misses (the last round, with no room for drafts, is a plain step
    # queued while the one before it ran: pipelined, so its time counts)
    assert len(plain) > 10 and all(seconds == 0.0 for seconds in plain[:-1])
    assert tokens[-1].stats.k_histogram[0] == len(plain)


def test_the_api_function_is_not_shadowed_by_a_module():
    """`tinydraft_mlx.generate` is the API function after importing every module of the package
    (the CLI used to live in `generate.py`: importing the server rebound the name to it)."""
    import importlib
    import pkgutil

    import tinydraft_mlx
    from tinydraft_mlx.api import generate as api_generate

    for info in pkgutil.iter_modules(tinydraft_mlx.__path__):
        if info.name != "generate":  # the `python -m tinydraft_mlx.generate` shim, run only
            importlib.import_module(f"tinydraft_mlx.{info.name}")
    assert tinydraft_mlx.generate is api_generate


BAD_CALLS = [
    (dict(k=0), "k must be an integer in [1, 64]"),
    (dict(k=65), 'k must be an integer in [1, 64] or "auto"'),
    (dict(k="automatic"), 'k must be an integer in [1, 64] or "auto" (got \'automatic\')'),
    (dict(draft="lookup"), 'draft must be a model, "prompt-lookup", a Hybrid, "none" or None'),
    (dict(k=2.0), "k must be an integer"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(temperature=-1.0), "temperature must be 0 (greedy) or in [1e-06, 1e+06] (got -1.0)"),
    (dict(temperature=1e-39), "temperature must be 0 (greedy) or in [1e-06, 1e+06] (got 1e-39)"),
    (dict(temperature=1e300), "temperature must be 0 (greedy) or in [1e-06, 1e+06]"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_k=-2), "top_k must be an integer >= 0"),
    (dict(min_p=1.0), "min_p must be in [0, 1)"),
    (dict(seed=-5), "seed must be an integer"),
    (dict(prompt=""), "prompt must be at least one token (got '')"),
    (dict(prompt=[]), "prompt must be at least one token (got [])"),
    (dict(prompt=[1, -4]), "prompt token ids must be non-negative"),
    (dict(prompt=[1, 10_000]), "below the vocabulary size 448"),
    (dict(prompt=3.5), "prompt must be a string, a list of token ids or a list of chat messages"),
    (dict(prompt=[{"role": "user"}]), 'messages must be dicts with string "role" and "content"'),
    (dict(prompt=[{"role": "user", "content": "hi"}]), "this tokenizer has none"),
    (dict(stop=""), "stop must be a non-empty string or a list of non-empty strings"),
    (dict(stop=["a", 3]), "stop must be a non-empty string or a list of non-empty strings"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be a number in [1e-06, 1e+06]"),
    (dict(repetition_penalty=0), "repetition_penalty must be a number in [1e-06, 1e+06] (got 0)"),
    (dict(presence_penalty=float("nan")), "presence_penalty must be a number in [-1e+06, 1e+06]"),
    (dict(frequency_penalty=1e300), "frequency_penalty must be a number in [-1e+06, 1e+06]"),
    (dict(frequency_context_size=0), "frequency_context_size must be an integer >= 1"),
    (dict(logit_bias={448: 1.0}), "logit_bias token id must be an integer in [0, 447]"),
    (dict(logit_bias={3: "big"}), "logit_bias value must be a number in [-1e+09, 1e+09]"),
    (dict(logit_bias={3: 1e39}),
     "logit_bias value must be a number in [-1e+09, 1e+09] (got 1e+39)"),
    (dict(logit_bias=[3, 1.0]), "logit_bias must be a dict of token id -> bias"),
    (dict(logits_processors=[3]), "logits_processors must be a list of callables"),
    (dict(prompt_progress_callback=1), "prompt_progress_callback must be a callable"),
    (dict(prompt_cache="cache.safetensors"), "prompt_cache must be a PromptCache"),
]


def test_the_extremes_of_the_allowed_ranges_give_real_tokens(pair):
    """At the edges of the ranges (the smallest temperature, the largest logit bias) the
    distributions stay finite: the smallest temperature samples the greedy path (the fixture's
    margins are far above 1e-6 x the logits' spread), the largest bias forces its token. Beyond
    them float32 overflowed and every token came out as one id (NaN distributions)."""
    target, draft, tok = pair
    greedy, _ = generate(target, draft, tok, PROMPT, k=3, max_tokens=24)
    cold, _ = generate(target, draft, tok, PROMPT, k=3, max_tokens=24, temperature=1e-6, seed=1)
    assert cold == greedy and len(set(greedy)) > 5
    forced, _ = generate(target, draft, tok, PROMPT, k=3, max_tokens=8, temperature=1.0, seed=2,
                         logit_bias={17: 1e9})
    assert forced == [17] * 8


@pytest.mark.parametrize("kwargs, message", BAD_CALLS)
def test_bad_input_raises_before_any_work(pair, kwargs, message):
    target, draft, tok = pair
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", PROMPT)
    draft = kwargs.pop("draft", draft)
    with pytest.raises(ValueError) as err:
        stream_generate(target, draft, tok, prompt, **kwargs)  # raises at the call, not on next()
    assert message in str(err.value)


def test_decode_rejects_a_cache_longer_than_the_prompt(pair):
    target, draft, tok = pair
    ids = tok.encode(PROMPT)
    cache = make_cache(target)
    prefill(target, cache, ids + ids)
    with pytest.raises(ValueError, match="target_cache"):
        next(decode(target, draft, ids, target_cache=cache, sampling=SamplingParams()))


def test_draft_width_differs_from_target(pair):
    """The fixture exercises mismatched logit widths (as Qwen2.5-0.5B vs 7B do)."""
    target, draft, tok = pair
    x = mx.array([tok.encode("x = 1")])
    assert target(x).shape[-1] > draft(x).shape[-1]


def test_ids_beyond_the_drafts_width(pair):
    """Ids the target knows but the draft's embedding lacks (Qwen2.5-7B's padded rows vs 0.5B)
    must not reach the draft's embedding as out-of-range reads; output still equals plain."""
    target, draft, tok = pair
    ids = tok.encode(PROMPT) + [440, 401, 12]
    dc = make_cache(draft)
    plain = generate(target, None, tok, ids, max_tokens=24)[0]
    spec = [t.id for t in decode(target, draft, ids, k=3, max_tokens=24, draft_cache=dc)]
    assert spec == plain
    keys = np.array(dc[0].keys[..., : cache_length(dc), :])
    assert np.isfinite(keys).all()


@pytest.mark.parametrize("end", ["length", "eos", "close"])
def test_pipelined_plain_decoding_rolls_back_the_queued_step(pair, reference, end):
    """Plain decoding queues step t+1 before reading token t (as mlx-lm's generate_step), so
    when generation ends one step too many has run: the cache must still hold exactly the
    emitted sequence but its last token, and resuming from it must continue exactly."""
    target, _, _ = pair
    ids, ref = reference
    j = next(i for i in range(5, 20) if ref[i] not in ref[:i])
    cache = make_cache(target)
    steps = decode(target, None, ids, max_tokens=12 if end == "length" else 40,
                   eos_token_ids={ref[j]} if end == "eos" else (), target_cache=cache)
    got = []
    for token in steps:
        got.append(token.id)
        if end == "close" and len(got) == 7:
            break
    steps.close()
    assert got == ref[: {"length": 12, "eos": j + 1, "close": 7}[end]]
    assert token.stats.finish_reason == {"length": "length", "eos": "eos", "close": "closed"}[end]
    seq = ids + got
    _assert_cache_holds(target, cache, seq[:-1])
    rest = [t.id for t in decode(target, None, seq, max_tokens=40 - len(got),
                                 target_cache=cache)]
    assert got + rest == ref[:40]


def test_generation_runs_on_mlx_lms_own_generation_stream(pair):
    """One generation stream per process, mlx-lm's: a second one (ours beside mlx-lm's, in a
    process that also runs `generate_step`) meant two threads calling the BLAS on the CPU."""
    from mlx_lm.generate import generation_stream as mlx_lm_stream

    from tinydraft_mlx.backend import generation_stream

    assert generation_stream() is mlx_lm_stream
    assert generation_stream().device == mx.default_device()


def _logits_after_each(model, ids):
    """The model's logits after each token of `ids` (L, V), from one forward on a fresh cache
    (eager: independent of the chunked prefill and of the compiled step)."""
    ids = model_inputs(model, ids)  # ids beyond the draft's embedding become its last row
    return np.array(model(mx.array(ids, dtype=mx.int32)[None], cache=make_cache(model))[0])


def _acceptance_at_t1(p_logits, q_logits):
    """sum min(p, q) per row at temperature 1 (numpy softmax; a narrower row has no mass at the
    other's extra ids)."""
    def softmax(x):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    p, q = softmax(p_logits.astype(np.float64)), softmax(q_logits.astype(np.float64))
    width = max(p.shape[-1], q.shape[-1])
    p, q = (np.pad(x, [(0, 0), (0, width - x.shape[-1])]) for x in (p, q))
    return np.minimum(p, q).sum(axis=-1)


def _argmax_after_each(model, ids, margins=False):
    """The model's greedy prediction after each token of `ids` (`_logits_after_each`); with
    `margins`, also whether each is clear (top-1 logit above the top-2 by more than 1e-3:
    elsewhere summation order may flip it)."""
    logits = _logits_after_each(model, ids)
    top = np.sort(logits, axis=-1)
    clear = (top[:, -1] - top[:, -2] > 1e-3).tolist()
    out = logits.argmax(axis=-1).tolist()
    return (out, clear) if margins else out


def _agree_where_clear(got, expected, clear):
    """`got` equals `expected` at every clear position (and most positions are clear)."""
    assert len(got) == len(expected) == len(clear)
    assert sum(clear) >= 0.75 * len(clear), clear
    bad = [i for i, (g, e, c) in enumerate(zip(got, expected, clear)) if c and g != e]
    assert not bad, (bad, got, expected, clear)


def test_prefill_predicts_after_its_last_tokens_across_chunks(pair):
    target, _, tok = pair
    ids = tok.encode(PROMPT)
    expected = _argmax_after_each(target, ids)
    for step, predict in [(512, 5), (4, 6), (4, len(ids)), (4, 0)]:
        cache = make_cache(target)
        got = prefill(target, cache, ids, step=step, predict=predict)
        if predict:  # the logits after each of the last `predict` tokens
            assert np.array(mx.argmax(got, axis=-1)).tolist() == expected[-predict:]
        else:
            assert got is None
        assert cache_length(cache) == len(ids)


def test_prefill_sends_only_the_predicted_rows_through_the_head(pair, demo, monkeypatch):
    """k="auto" predicts after the last tokens of every prompt and every catch-up: where a
    model's head can be taken apart (an mlx-lm Qwen2 with its own LM head or tied embeddings,
    a pruned draft) the tokens run in one forward per chunk of `step` and only the predicted
    rows go through the head, whose logits are the whole forward's there; a model whose
    head is unknown gets a chunk that ends where the rows begin (two forwards), as before."""
    from tinydraft_mlx.engine import forward as forward_module
    from tinydraft_mlx.engine.pruning import DEMO_COUNTS, prune_draft

    target, _, tok = pair
    demo_target, demo_draft, demo_tok = demo

    class Unknown(nn.Module):  # a head this module does not know: the forward as a whole
        def __init__(self, inner):
            super().__init__()
            self.inner, self.args = inner, None

        def __call__(self, inputs, cache=None):
            return self.inner(inputs, cache=cache)

        @property
        def layers(self):
            return self.inner.layers

    models = {"untied": (target, tok), "tied": (demo_target, demo_tok),
              "pruned": (prune_draft(demo_draft, demo_tok, 300, DEMO_COUNTS), demo_tok),
              "unknown": (Unknown(target), tok)}
    for name, (model, tokenizer) in models.items():
        body = (model.inner if name == "unknown" else model).model
        calls, forward = [], type(body).__call__

        def counted(self, *args, _forward=forward, _calls=calls, **kwargs):
            _calls.append(1)
            return _forward(self, *args, **kwargs)

        monkeypatch.setattr(type(body), "__call__", counted)
        ids = tokenizer.encode(PROMPT)
        assert len(ids) > 8
        whole = model(mx.array(ids)[None], cache=make_cache(model))[0]
        for step, predict in [(512, 6), (4, 6), (512, len(ids))]:
            calls.clear()
            cache = make_cache(model)
            got = forward_module.prefill(model, cache, ids, step=step, predict=predict)
            assert got.shape == (predict, whole.shape[-1]), name
            assert np.allclose(np.array(got), np.array(whole[-predict:]), atol=1e-4), name
            assert cache_length(cache) == len(ids)
            if step == 512:  # one chunk, split where the head is unknown and rows are left out
                split = name == "unknown" and predict < len(ids)
                assert len(calls) == (2 if split else 1), (name, predict, len(calls))
        monkeypatch.undo()


class _Looking(ScriptedPolicy):
    """Greedy k="auto" as the real policy does it: it looks before it leaps."""

    SCHEDULE = (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2)
    LOOKS = True


def test_auto_learns_from_the_catch_up_what_a_greedy_draft_would_do(pair, reference,
                                                                    monkeypatch):
    """Greedy k="auto" books after plain rounds whether the draft's argmax after each token it
    catches up on was the token that followed, over the generated text only (its first catch-up
    also feeds the prompt to a draft that started empty): it must be what the draft predicts
    from the whole sequence (computed here independently); the output stays the plain greedy
    one; the choice after a catch-up is told that the draft has caught up. Sampled, it books
    sum min(p, q) at the same positions (numpy softmax of independent forwards, T = 1), over
    the plain rounds' tokens."""
    import tinydraft_mlx.engine.speculative as spec
    from tinydraft_mlx.engine.policy import CATCH_UP_EVIDENCE

    target, draft, tok = pair
    ids, ref = reference
    policy = _Looking()
    monkeypatch.setattr(spec, "shared_policy", lambda *args, **kwargs: policy)
    out = [t.id for t in decode(target, draft, ids, k="auto", max_tokens=24)]
    assert out == ref[:24]
    # the first round is plain (it does not ask the policy); 10 plain rounds more, the next
    # chooses 2: the draft catches up, and the policy is asked again knowing that the draft is
    # now in step (a look)
    assert policy.caught_up[:12] == [False] * 11 + [True]
    seq = ids + out
    # the 11 plain rounds emitted seq[len(ids):len(ids) + 11]; the catch-up feeds the draft all
    # of them: its rows after seq[j] predict seq[j + 1], booked for the generated tokens only
    # (after seq[len(ids) - 1], the prompt's last, on); the row after the last token is the
    # first draft step's (test_a_catch_up_runs_the_first_draft_steps_forward)
    caught = policy.observed[0]
    end = len(ids) + 10  # the evidence's last row is after seq[end - 1]
    # (ids beyond the fixture draft's embedding occur: reading them unclamped gave garbage)
    after, clear = _argmax_after_each(draft, seq[:end], margins=True)
    assert len(caught) == min(CATCH_UP_EVIDENCE, 11)
    m = len(caught)
    _agree_where_clear(caught, [after[j] == seq[j + 1] for j in range(end - m, end)],
                       clear[end - m : end])
    policy.observed.clear()
    policy.rounds = 0
    sampled = list(decode(target, draft, ids, k="auto", max_tokens=16,
                          sampling=SamplingParams(1.0, seed=0)))
    assert sampled[-1].stats.k_histogram[2] >= 1  # it did catch up and draft
    seq = ids + [t.id for t in sampled]
    t_logits, d_logits = (_logits_after_each(m, seq) for m in (target, draft))
    (caught,) = policy.observed
    # rows predicting the 11 plain tokens, seq[len(ids):len(ids) + 11]: after seq[j - 1]
    rows = slice(len(ids) - 1, len(ids) + 10)
    expected = _acceptance_at_t1(t_logits[rows], d_logits[rows])
    assert len(caught) == 11 and 0.05 < expected.mean() < 0.95  # neither certain nor hopeless
    np.testing.assert_allclose(caught, expected, atol=1e-3)


class _Drafting(ScriptedPolicy):
    """Greedy k="auto" drafting 1, 2 and 3 tokens in turn with a plain round now and then
    (which must drop the evidence of the round before it); records each round's (drafted,
    accepted)."""

    SCHEDULE = (1, 2, 3, 1, 0, 2, 1)
    LOOKS = True

    def __init__(self) -> None:
        super().__init__()
        self.booked: list[tuple[int, int]] = []

    def update(self, k: int, accepted: int, seconds: float, catch_up: float = 0.0,
               filled: bool = False) -> None:
        self.booked.append((k, accepted))


def test_a_round_accepted_whole_tells_whether_one_more_draft_would_have_been(demo,
                                                                              monkeypatch):
    """After a round whose k drafts were all accepted, the next drafting round's first draft step
    also gives the draft's argmax after d_k; greedy k="auto" books whether it was the target's
    token there (position k + 1). Each booking must equal what the draft predicts from the whole
    sequence (an independent forward), at the rounds' boundaries; a plain round in between books
    nothing; sampled generations book nothing."""
    import tinydraft_mlx.engine.speculative as spec

    target, draft, tok = demo  # a real pair: rounds accepted whole and not
    policy = _Drafting()
    monkeypatch.setattr(spec, "shared_policy", lambda *args, **kwargs: policy)
    ids = tok.encode(PROMPT)
    out = [t.id for t in decode(target, draft, ids, k="auto", max_tokens=80)]
    seq = ids + out
    # every round is booked (the first, plain whatever the policy says, too)
    assert sum(n + 1 for _, n in policy.booked) == len(out)
    after, clear = _argmax_after_each(draft, seq, margins=True)
    expected, where, end = [], [], len(ids)
    for (k, n), (k_next, _) in zip(policy.booked, policy.booked[1:]):
        end += n + 1  # seq[end - 1] is the round's last token (the target's)
        if k and n == k and k_next:  # accepted whole, then a drafting round: d_k is seq[end - 2]
            expected.append((k, after[end - 2] == seq[end - 1]))
            where.append(clear[end - 2])
    assert len(expected) >= 6 and {k for k, _ in expected} >= {1, 2}, policy.booked
    assert {a for _, a in expected} == {True, False}  # both outcomes occur
    assert [k for k, _ in policy.beyond] == [k for k, _ in expected]
    _agree_where_clear([a for _, a in policy.beyond], [a for _, a in expected], where)
    policy.beyond.clear()
    policy.rounds = 0
    list(decode(target, draft, ids, k="auto", max_tokens=30, sampling=SamplingParams(1.0, seed=0)))
    assert policy.beyond == []


@pytest.mark.parametrize("k", [1, 2])
def test_draft_steps_run_ahead_propose_what_the_draft_predicts(demo, monkeypatch, k):
    """With every drafting round queuing the next round's first draft step behind its verify
    (forced), each greedy proposal is still the draft's prediction from the whole sequence (an
    independent forward), in rounds that used the step run ahead (after a round accepted whole)
    and in rounds after a rejection (the step dropped, its two positions rolled back); the draft
    cache ends holding a prefix of seq[:-1]. The demo pair: rounds of both kinds."""
    import tinydraft_mlx.engine.drafters as drafters
    import tinydraft_mlx.engine.speculative as spec

    monkeypatch.setattr(spec, "AHEAD_MIN", 0.0)
    target, draft, tok = demo
    proposals = []
    propose = drafters.ModelDraft.propose

    def recorded(self, k, *args):
        ahead = self._ahead is not None
        drafts, q = propose(self, k, *args)
        proposals.append((len(self.seq), np.array(drafts).tolist(), ahead))
        return drafts, q

    monkeypatch.setattr(drafters.ModelDraft, "propose", recorded)
    ids = tok.encode(PROMPT)
    tc, dc = make_cache(target), make_cache(draft)
    out = [t.id for t in decode(target, draft, ids, k=k, max_tokens=80, target_cache=tc,
                                draft_cache=dc)]
    seq = ids + out
    assert {ahead for *_, ahead in proposals} == {True, False}
    got, expected, clear = [], [], []
    for length, drafts, _ in proposals:
        after, margins = _argmax_after_each(draft, seq[:length] + drafts[:-1], margins=True)
        got += drafts
        expected += after[length - 1 :]
        clear += margins[length - 1 :]
    _agree_where_clear(got, expected, clear)
    assert cache_length(dc) <= len(seq) - 1
    _assert_cache_holds(draft, dc, seq[: cache_length(dc)])


class _DeclinesOne(_Drafting):
    """`_Drafting`, asked whether to read one more position after a round accepted whole: yes
    after k = 2 and 3, no after k = 1 (`wants_beyond`); records what it was asked."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def wants_beyond(self, position: int) -> bool:
        self.asked.append(position)
        return position != 1


def test_one_more_position_is_read_only_where_the_policy_asks(demo, monkeypatch):
    """The evidence on position k + 1 after a round accepted whole is read (and booked) only
    where the policy asks for it (`wants_beyond(k)`): reading it costs the verify ~160 us on the
    demo pair, ~4% of a generation drafting k = 1, so the real policy asks while that position's
    evidence is thin. Declined after k = 1, none is booked there; asked after k = 2 and 3, they
    are."""
    import tinydraft_mlx.engine.speculative as spec

    target, draft, tok = demo
    policy = _DeclinesOne()
    monkeypatch.setattr(spec, "shared_policy", lambda *args, **kwargs: policy)
    list(decode(target, draft, tok.encode(PROMPT), k="auto", max_tokens=80))
    assert 1 in policy.asked and {2, 3} & set(policy.asked), policy.asked
    assert policy.beyond and all(k in (2, 3) for k, _ in policy.beyond), policy.beyond


def test_a_catch_up_runs_the_first_draft_steps_forward(demo, monkeypatch):
    """After plain rounds the draft catches up on all it missed, the last token included, and
    the first draft step of the round after it takes its logits from that forward's last row
    (as from a step run ahead) instead of running one of its own: that round was a run's
    slowest (demo pair, CPU: 4.1-4.6 ms for a run's 3.1-3.3 at k = 1), and a new pair was
    judged on it. Each such proposal (k = 2: one forward left) is still the draft's greedy
    prediction from the whole sequence (an independent forward), and the tokens are plain
    greedy decoding's."""
    import tinydraft_mlx.engine.drafters as drafters
    import tinydraft_mlx.engine.speculative as spec

    target, draft, tok = demo
    monkeypatch.setattr(spec, "shared_policy", lambda *args, **kwargs: _Looking())
    catch_up, propose, forward = (drafters.ModelDraft.catch_up, drafters.ModelDraft.propose,
                                  drafters.forward)
    caught, forwards, after_catch_up = [], [], []

    def recorded_catch_up(self, predict=0):
        seconds, rows = catch_up(self, predict)
        caught.append(seconds > 0)
        return seconds, rows

    def recorded_propose(self, k, *args):
        held, forwards[:] = cache_length(self.cache), []
        drafts, q = propose(self, k, *args)
        if caught and caught[-1]:
            after_catch_up.append((len(self.seq), held, len(forwards), k,
                                   np.array(drafts).tolist()))
        caught.clear()
        return drafts, q

    def counted(model, *args, **kwargs):
        forwards.append(model)
        return forward(model, *args, **kwargs)

    monkeypatch.setattr(drafters.ModelDraft, "catch_up", recorded_catch_up)
    monkeypatch.setattr(drafters.ModelDraft, "propose", recorded_propose)
    monkeypatch.setattr(drafters, "forward", counted)
    ids = tok.encode(PROMPT)
    out = [t.id for t in decode(target, draft, ids, k="auto", max_tokens=60)]
    assert out == [t.id for t in decode(target, None, ids, k=1, max_tokens=60)]
    seq = ids + out
    assert len(after_catch_up) >= 3, after_catch_up  # the fill and switches back (every 12)
    got, expected, clear = [], [], []
    for length, held, steps, k, drafts in after_catch_up:
        assert held == length and steps == k - 1 == 1, after_catch_up  # all fed; one forward
        after, margins = _argmax_after_each(draft, seq[:length] + drafts[:-1], margins=True)
        got += drafts
        expected += after[length - 1 :]
        clear += margins[length - 1 :]
    _agree_where_clear(got, expected, clear)


class _Expects(ScriptedPolicy):
    """k="auto" drafting k = 1 every round, expecting each round to be accepted whole with the
    chance `CHANCE` (`whole_chance`)."""

    CHANCE = 1.0

    def whole_chance(self, k: int) -> float:
        return self.CHANCE


@pytest.mark.parametrize("chance", [0.0, 0.9])
def test_auto_runs_a_step_ahead_where_its_policy_expects_the_round_accepted_whole(
        demo, monkeypatch, chance):
    """With k="auto" a drafting round queues the next round's first draft step behind its
    verify where its policy's chance of the round being accepted whole reaches AHEAD_MIN (0.5),
    whatever share of this generation's rounds were (that share starts at AHEAD_MIN, so a
    generation's first rejected round turned it off for the next round, one of the three a new
    pair's cost is first judged on); the tokens are plain greedy decoding's either way."""
    import tinydraft_mlx.engine.drafters as drafters
    import tinydraft_mlx.engine.speculative as spec

    target, draft, tok = demo
    policy = type("Policy", (_Expects,), {"CHANCE": chance})()
    monkeypatch.setattr(spec, "shared_policy", lambda *args, **kwargs: policy)
    ahead, queued = drafters.ModelDraft.ahead, []

    def counted(self, last, token):
        queued.append(len(self.seq))
        return ahead(self, last, token)

    monkeypatch.setattr(drafters.ModelDraft, "ahead", counted)
    ids = tok.encode(PROMPT)
    tokens = list(decode(target, draft, ids, k="auto", max_tokens=40))
    assert [t.id for t in tokens] == [t.id for t in decode(target, None, ids, k=1,
                                                            max_tokens=40)]
    stats = tokens[-1].stats
    drafting = stats.rounds - stats.k_histogram.get(0, 0)
    assert 0 < stats.accepted < stats.drafted  # rounds accepted whole and not
    assert len(queued) == (drafting if chance else 0), (len(queued), drafting)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_step_run_ahead_changes_no_token(demo, monkeypatch, temperature):
    """The forward run ahead is the one the next round's first draft step would run (same
    tokens, cache and compiled shape) and its token is drawn there with the round's own key: a
    seeded generation gives the same tokens with every step run ahead as with none (k = 1, 3;
    greedy and sampled), and the steps run ahead were used."""
    import tinydraft_mlx.engine.speculative as spec

    target, draft, tok = demo
    ids = tok.encode(PROMPT)
    chains = record_chains(monkeypatch)
    for k in (1, 3):
        runs = []
        for least in (0.0, 2.0):  # every round queues one; none does
            monkeypatch.setattr(spec, "AHEAD_MIN", least)
            chains.clear()
            runs.append(generate(target, draft, tok, ids, k=k, max_tokens=60, seed=7,
                                 temperature=temperature, top_p=0.9)[0])
            assert any(ahead for ahead, _ in chains) == (least == 0.0)
        assert runs[0] == runs[1] and len(set(runs[0])) > 10

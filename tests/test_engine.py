"""The decode loop's bookkeeping: cache round-trips, early close, EOS inside an accepted run,
max_tokens below k, and the statistics' invariants."""


import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.scripted import scripted
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




@pytest.mark.parametrize("schedule", [(0,), (0, 0, 0, 3), (3, 0, 0, 0, 0, 0, 1)])
def test_auto_plain_stretches_switch_cleanly(pair, reference, monkeypatch, schedule):
    """k="auto" runs the plain rounds it picks as pipelined stretches that end when it picks a
    k again: greedy output unchanged, every round booked once, caches hold seq[:-1]."""
    target, draft, tok = pair
    ids, ref = reference
    calls = scripted(monkeypatch, schedule)
    tc, dc = make_cache(target), make_cache(draft)
    tokens = list(decode(target, draft, ids, k="auto", max_tokens=40, target_cache=tc,
                         draft_cache=dc))
    out = [t.id for t in tokens]
    assert out == ref[:40] and tokens[-1].finish_reason == "length"
    stats = tokens[-1].stats
    drafted = [k for k in stats.k_histogram if k > 0]
    assert stats.rounds == sum(stats.k_histogram.values()) and len(calls) >= stats.rounds - 1
    assert (stats.k_histogram.get(0, 0) == 40) == (schedule == (0,))
    assert all(k <= max(schedule) for k in drafted)
    _assert_cache_holds(target, tc, (ids + out)[:-1])


@pytest.mark.parametrize("k", [None, "auto"])
def test_the_first_token_does_not_wait_for_a_queued_step(pair, reference, monkeypatch, k):
    """Plain decoding (and k="auto" choosing plain rounds) reads the first token before it
    queues the next step: on MLX's CPU backend a token read with a step queued behind it waits
    for that step too. From the second token on, plain steps are pipelined (one queued ahead
    of each token read)."""
    import tinydraft_mlx.engine.rounds as rounds

    target, draft, _ = pair
    ids, ref = reference
    if k == "auto":
        scripted(monkeypatch, (0,))
    forwards = []
    real = rounds.BatchDecoder._verify
    monkeypatch.setattr(rounds.BatchDecoder, "_verify",
                        lambda self, *a: forwards.append(1) or real(self, *a))
    seen, out = [], []
    for token in decode(target, None if k is None else draft, ids, k=k or 1, max_tokens=12):
        seen.append(len(forwards))
        out.append(token.id)
    assert out == ref[:12]
    assert seen[0] == 1, seen  # the first token read alone
    assert seen[1:] == list(range(3, 13)) + [12], seen  # then one step queued ahead


def test_a_lookup_round_that_finds_nothing_is_a_plain_step(pair, reference, monkeypatch):
    """Prompt lookup with no earlier occurrence of the suffix proposes nothing: that round is a
    plain step, booked as a plain round; the output is plain greedy decoding's."""
    from tinydraft_mlx import PromptLookup

    target, _, _ = pair
    ids, ref = reference
    scripted(monkeypatch, (3,))  # always ask for 3 drafts
    tokens = list(decode(target, PromptLookup(), ids, k="auto", max_tokens=40))
    assert [t.id for t in tokens] == ref[:40]
    stats = tokens[-1].stats
    assert stats.k_histogram.get(0, 0) > 10 and stats.rounds == sum(stats.k_histogram.values())

def test_the_api_function_is_not_shadowed_by_a_module():
    """`tinydraft_mlx.generate` is the API function after importing every module of the package
    (the CLI used to live in `generate.py`: importing the server rebound the name to it)."""
    import importlib
    import pkgutil

    import tinydraft_mlx
    from tinydraft_mlx.generation.api import generate as api_generate

    for info in pkgutil.iter_modules(tinydraft_mlx.__path__):
        if info.name != "generate":  # the `python -m tinydraft_mlx.generate` shim, run only
            importlib.import_module(f"tinydraft_mlx.{info.name}")
    assert tinydraft_mlx.generate is api_generate


BAD_CALLS = [
    (dict(k=0), "k must be an integer in [1, 64]"),
    (dict(k=65), 'k must be an integer in [1, 64] or "auto"'),
    (dict(k="automatic"), 'k must be an integer in [1, 64] or "auto" (got \'automatic\')'),
    (dict(draft="lookup"), 'draft must be a model, a registered name (none, prompt-lookup, '),
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

    from tinydraft_mlx.engine.backend import generation_stream

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

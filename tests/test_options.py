"""Options checked once: `make_options` builds the frozen object every boundary passes down."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tinydraft_mlx import Options, ParameterError, generate, load_models, make_options


@pytest.mark.parametrize("field,value,allowed", [
    ("k", 0, 'an integer in [1, 64] or "auto"'),
    ("max_tokens", 0, "an integer >= 1"),
    ("temperature", -1.0, "0 (greedy) or in"),
    ("top_p", 0.0, "in (0, 1]"),
    ("top_k", -1, "an integer >= 0"),
    ("min_p", 1.0, "in [0, 1)"),
    ("seed", -1, "an integer in [0,"),
    ("stop", "", "a non-empty string"),
    ("repetition_penalty", 0.0, "a number in [1e-06, 1e+06]"),
    ("presence_penalty", math.inf, "a number in [-1e+06, 1e+06]"),
    ("frequency_penalty", math.nan, "a number in [-1e+06, 1e+06]"),
    ("repetition_context_size", 0, "an integer >= 1"),
    ("logit_bias", {3: 1e39}, "a number in [-1e+09, 1e+09]"),
    ("logit_bias", {-1: 1.0}, "an integer in [0, 99]"),
    ("logits_processors", [1], "a list of callables"),
    ("max_kv_size", 2, "an integer >= 5"),
    ("chat_template", 3, "a non-empty Jinja template string"),
    ("logprobs", 21, "an integer in [0, 20]"),
])
def test_each_bad_field_is_refused_naming_it(field, value, allowed):
    with pytest.raises(ParameterError) as info:
        make_options(vocab_size=100, **{field: value})
    assert info.value.name.startswith(field) and allowed in str(info.value), str(info.value)
    assert repr(value if field != "logit_bias" else next(iter(value.items()))[
        1 if "number" in allowed else 0]) in str(info.value)


def test_options_are_frozen_and_unknown_fields_refused():
    options = make_options(temperature=0.7, top_k=20, stop="\n\n", logit_bias={3: -2})
    assert options.stop == ("\n\n",) and options.logit_bias == ((3, -2.0),)
    assert (options.sampling.temperature, options.sampling.top_k) == (0.7, 20)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.temperature = 1.0
    with pytest.raises(TypeError, match="temprature"):
        make_options(temprature=0.7)
    assert make_options() == Options()


def test_an_options_object_gives_what_its_keyword_arguments_give():
    target, draft, tok = load_models()
    kwargs = dict(k=2, max_tokens=12, temperature=0.8, top_k=20, seed=3, repetition_penalty=1.3)
    ids, _ = generate(target, draft, tok, "def main():", **kwargs)
    again, _ = generate(target, draft, tok, "def main():", options=make_options(**kwargs))
    assert again == ids
    with pytest.raises(ParameterError, match="options"):
        generate(target, draft, tok, "x", options=make_options(**kwargs), temperature=0.5)
    with pytest.raises(ParameterError, match="logit_bias token id"):  # this target's vocabulary
        generate(target, draft, tok, "x", options=make_options(logit_bias={10**6: 1.0}))

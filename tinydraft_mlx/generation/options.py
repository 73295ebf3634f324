"""The options of a generation, checked once.

`make_options` is the one function that checks them: the API's keyword arguments
(`stream_generate`, `generate`, `batch_generate`), the command line's flags and a server
request's fields all become an `Options` through it, at the boundary, and the frozen object goes
down unchanged to the engine. What depends on the models (the prompt, the drafter, a prompt
cache, a KV bound against a round's length) is checked where the models are known
(`api.prepare`). Every error is a `ParameterError` naming the parameter, the allowed range and the
value received.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from mlx_lm.sample_utils import make_logits_processors

from ..engine.bitwise import MAX_K as BITWISE_MAX_K
from ..engine.cache import KEEP
from ..engine.policy import AUTO, AUTO_MAX_K, DEFAULT_K
from ..engine.sampling import ParameterError, Processor, SamplingParams, check_float, check_int
from ..engine.tree_verify import check_budget
from ..engine.trees import MAX_TREE
from .text import check_stop

MAX_DRAFT_TOKENS = 64
MAX_TOP_LOGPROBS = 20
# Bounds that keep processed logits finite in float32 at any allowed temperature (a logit_bias of
# 1e39 is a finite Python float but inf in float32: NaN distributions)
MAX_LOGIT_BIAS = 1e9
MAX_PENALTY = 1e6
MIN_REPETITION_PENALTY = 1e-6


@dataclass(frozen=True)
class Options:
    """One generation's checked options (build it with `make_options`). Sampling order: logits
    processors -> temperature -> top-k -> top-p -> min-p. Penalties and logit_bias follow
    mlx-lm's `make_logits_processors` (None turns a penalty off, and so does 0 for the presence
    and frequency penalties; a repetition_penalty of 1 is neutral). logprobs: how many top
    log-probabilities a server reply lists per token (None: none). bitwise: every target
    forward carries the same number of positions, so greedy output is plain greedy decoding's
    bit for bit on any device (engine/bitwise.py; k at most BITWISE_MAX_K). tree: verify
    candidate trees of at most this many nodes a round instead of chains (engine/trees.py; k
    is then their depth limit); None: chains."""

    k: int | str = DEFAULT_K
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    presence_context_size: int = 20
    frequency_penalty: float | None = None
    frequency_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()
    logits_processors: tuple[Processor, ...] = ()
    max_kv_size: int | None = None
    chat_template: str | None = None
    logprobs: int | None = None
    bitwise: bool = False
    tree: int | None = None

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p, self.seed)

    def processors(self) -> list[Processor]:
        """The user's processors, then mlx-lm's for the penalties and the logit bias."""
        return list(self.logits_processors) + make_logits_processors(
            logit_bias=dict(self.logit_bias) or None,
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty,
            presence_context_size=self.presence_context_size,
            frequency_penalty=self.frequency_penalty,
            frequency_context_size=self.frequency_context_size)


FIELDS = tuple(f.name for f in fields(Options))


def check_k(k: object, max_kv_size: int | None = None, bitwise: bool = False) -> None:
    """ParameterError unless k is an int in [1, MAX_DRAFT_TOKENS] or "auto" (which drafts up to
    AUTO_MAX_K); with caches bounded to `max_kv_size` positions, a round's k + 1 positions must
    fit beside the sink positions too; in the bit-for-bit mode (`bitwise`) k is at most
    BITWISE_MAX_K."""
    top, limits = MAX_DRAFT_TOKENS, []
    if max_kv_size is not None and max_kv_size - KEEP - 1 < top:
        top, limits = max_kv_size - KEEP - 1, [f"max_kv_size {max_kv_size}"]
    if bitwise and BITWISE_MAX_K < top:
        top, limits = BITWISE_MAX_K, limits + ["bitwise"]
    allowed = f"an integer in [1, {top}]" + (' or "auto"' if top >= AUTO_MAX_K else "") + (
        f" with {' and '.join(limits)}" if limits else "")
    if k == AUTO and top >= AUTO_MAX_K:
        return
    try:
        check_int("k", k, 1, top)
    except ParameterError:
        raise ParameterError("k", allowed, k) from None


def make_options(*, vocab_size: int | None = None, **given: Any) -> Options:
    """Check `given` (any of `Options`' fields; None for a field that has a default other than
    None means the default) and return the frozen `Options`. `vocab_size`: logit_bias token ids
    must be below it. ParameterError for the first bad field; TypeError for an unknown one."""
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise TypeError(f"unexpected options {unknown}; the options are {list(FIELDS)}")
    defaults = Options()
    values = {name: getattr(defaults, name) if given.get(name) is None else given[name]
              for name in FIELDS}
    check_k(values["k"], bitwise=values["bitwise"] is True)
    check_int("max_tokens", values["max_tokens"], 1)
    SamplingParams(values["temperature"], values["top_p"], values["top_k"], values["min_p"],
                   values["seed"])
    values["stop"] = check_stop(values["stop"])
    _check_range("repetition_penalty", values["repetition_penalty"], MIN_REPETITION_PENALTY,
                 MAX_PENALTY)
    _check_range("presence_penalty", values["presence_penalty"], -MAX_PENALTY, MAX_PENALTY)
    _check_range("frequency_penalty", values["frequency_penalty"], -MAX_PENALTY, MAX_PENALTY)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        check_int(name, values[name], 1)
    values["logit_bias"] = _logit_bias(given.get("logit_bias") or {}, vocab_size)
    processors = values["logits_processors"]
    if isinstance(processors, (str, bytes)) or not isinstance(processors, Sequence) or not all(
            callable(p) for p in processors):
        raise ParameterError("logits_processors", "a list of callables f(tokens, logits)",
                             processors)
    values["logits_processors"] = tuple(processors)
    if values["max_kv_size"] is not None:
        # the kept sink positions and one more at least (a round's length: `api.prepare`)
        check_int("max_kv_size", values["max_kv_size"], KEEP + 1)
    template = values["chat_template"]
    if template is not None and (not isinstance(template, str) or not template.strip()):
        raise ParameterError("chat_template", "a non-empty Jinja template string", template)
    if values["logprobs"] is not None:
        check_int("logprobs", values["logprobs"], 0, MAX_TOP_LOGPROBS)
    if not isinstance(values["bitwise"], bool):
        raise ParameterError("bitwise", "True or False", values["bitwise"])
    check_budget(values["tree"], MAX_TREE)
    return Options(**values)


def check_vocab(options: Options, vocab_size: int) -> None:
    """ParameterError unless every logit_bias token id is below `vocab_size` (a model's)."""
    for token, _ in options.logit_bias:
        check_int("logit_bias token id", token, 0, vocab_size - 1)


def _check_range(name: str, value: object, low: float, high: float) -> None:
    """ParameterError unless `value` is None or a finite number in [low, high]."""
    if value is not None:
        check_float(name, value, lambda v: low <= v <= high, f"a number in [{low:g}, {high:g}]")


def _logit_bias(bias: object, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    if not isinstance(bias, Mapping):
        raise ParameterError("logit_bias", "a dict of token id -> bias", bias)
    top = vocab_size - 1 if vocab_size is not None else None
    out = []
    for token, value in bias.items():
        check_int("logit_bias token id", token, 0, top)
        _check_range("logit_bias value", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        out.append((token, float(value)))
    return tuple(sorted(out))


# option name -> the command-line flag that sets it (the CLI's and the server's), so that an
# error names what the user typed
FLAGS = {
    "temperature": "--temp",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "seed": "--seed",
    "k": "--num-draft-tokens",
    "max_tokens": "--max-tokens",
    "prompt": "--prompt",
    "max_kv_size": "--max-kv-size",
    "stop": "--stop",
    "draft_vocab": "--draft-vocab",
    "draft_vocab_counts": "--draft-vocab-counts",
    "bitwise": "--bitwise",
    "tree": "--tree",
}


def flag_message(err: ParameterError) -> str:
    """The API's range error, naming the flag the user typed (also the server's flags)."""
    return f"{FLAGS.get(err.name, err.name)} must be {err.allowed} (got {err.value!r})"

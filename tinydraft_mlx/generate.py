"""Command line: `python -m tinydraft_mlx.generate` (console script `tinydraft-mlx`).

Streams the generated text as rounds are accepted and prints `stats.summary()` on stderr.
Bad arguments exit with status 2 and one line naming the flag, the allowed range and the value.
"""

from __future__ import annotations

import argparse
import sys
import types
from typing import NoReturn

from . import speculative
from .backend import active_blas, device_name
from .loading import NO_DRAFT, ModelLoadError, default_draft, load_models
from .sampling import ParameterError, SamplingParams, check_int
from .speculative import MAX_DRAFT_TOKENS, check_k, encode_prompt, stream_generate

# API parameter name -> the flag that sets it, so errors name what the user typed
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
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def setup_arg_parser() -> argparse.ArgumentParser:
    """The CLI's flags, named as in mlx-lm where the concept is the same."""
    p = _Parser(prog="tinydraft-mlx", description="Exact speculative decoding on MLX.")
    p.add_argument("--target", "--model", default=None,
                   help="target model: hub id or directory (default: the bundled demo target)")
    p.add_argument("--draft", "--draft-model", default=None,
                   help="draft model, 'prompt-lookup' (copy n-gram continuations from the prompt "
                        "and output, no model), or 'none' for plain decoding (default: the demo "
                        "draft, or Qwen2.5-0.5B of the same publisher for a Qwen2.5 target)")
    p.add_argument("-k", "--num-draft-tokens", default="4", dest="k",
                   help=f"draft tokens per round, 1..{MAX_DRAFT_TOKENS}, or 'auto' to choose "
                        "0..8 every round from measured acceptance and costs (default 4)")
    p.add_argument("--prompt", "-p", default=None, help="prompt text (default: read stdin)")
    p.add_argument("--max-tokens", "-m", default="256", help="tokens to generate (256)")
    p.add_argument("--temp", default="0.0", help="temperature, 0 = greedy (0)")
    p.add_argument("--top-p", default="1.0", help="nucleus mass in (0, 1] (1 = off)")
    p.add_argument("--top-k", default="0", help="keep the k most likely tokens (0 = off)")
    p.add_argument("--min-p", default="0.0", help="min-p in [0, 1) (0 = off)")
    p.add_argument("--seed", default=None, help="random seed for sampling")
    p.add_argument("--max-kv-size", default=None,
                   help="bound each KV cache to this many positions (default: unbounded)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="weight dtype (default: float32 on the CPU, the checkpoint's own "
                        "dtype on a GPU, e.g. bfloat16 for Qwen2.5)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--verbose", action="store_true", help="print the models and settings used")
    return p


def _flag_message(err: ParameterError) -> str:
    """The API's range error, naming the flag the user typed."""
    return f"{FLAGS.get(err.name, err.name)} must be {err.allowed} (got {err.value!r})"


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _number(text: str | None, kind: type) -> object:
    """`text` as an int/float, or unchanged when it is not one (validation then names the flag)."""
    try:
        return None if text is None else kind(text)
    except ValueError:
        return text


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SamplingParams:
    """Convert and validate every value before loading a model: a wrong flag costs nothing.
    Numbers arrive as strings so that a non-number gets the same one-line message as a bad range."""
    for name, kind in [("k", int), ("max_tokens", int), ("temp", float), ("top_p", float),
                       ("top_k", int), ("min_p", float), ("seed", int), ("max_kv_size", int)]:
        setattr(args, name, _number(getattr(args, name), kind))
    try:
        sampling = SamplingParams(args.temp, args.top_p, args.top_k, args.min_p, args.seed)
        check_k(args.k)
        check_int("max_tokens", args.max_tokens, 1)
    except ParameterError as err:
        _fail(parser, _flag_message(err))
    return sampling


def _prompt_ids(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("--chat: this tokenizer has no chat template")
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return encode_prompt(tokenizer, text)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    sampling = _check_args(parser, args)
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    if not text:
        _fail(parser, "--prompt must be non-empty (got an empty prompt)")
    try:
        target, draft, tokenizer = load_models(args.target, args.draft, dtype=args.dtype)
        ids = _prompt_ids(tokenizer, text, args.chat)
        steps = stream_generate(
            target, draft, tokenizer, ids, k=args.k, max_tokens=args.max_tokens,
            temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            seed=args.seed, max_kv_size=args.max_kv_size,
        )
    except ParameterError as err:
        _fail(parser, _flag_message(err))
    except (ModelLoadError, ValueError) as err:
        _fail(parser, str(err))
    if args.verbose:
        draft_name = args.draft or default_draft(args.target) or NO_DRAFT
        print(f"target: {args.target or 'bundled demo target'}; draft: {draft_name}; "
              f"k={args.k}; {sampling}; {device_name()} backend, BLAS: {active_blas()}",
              file=sys.stderr)
    return _stream_text(steps, tokenizer)


def _stream_text(steps, tokenizer) -> int:
    """Print text as tokens are accepted, then the stats line on stderr. Ctrl-C stops cleanly
    (the generator is closed, so its caches are rolled back) with status 130."""
    detok, eos = tokenizer.detokenizer, speculative.eos_ids(tokenizer)
    detok.reset()
    stats, code = None, 0
    try:
        for token in steps:
            stats = token.stats
            if token.id not in eos:
                detok.add_token(token.id)
                print(detok.last_segment, end="", flush=True)
    except KeyboardInterrupt:
        steps.close()
        code = 130
    detok.finalize()
    print(detok.last_segment, flush=True)
    if stats is not None:
        print(stats.summary(), file=sys.stderr)
    return code


class _CallableModule(types.ModuleType):
    """Importing this module rebinds `tinydraft_mlx.generate` from the API function to the module;
    making the module callable keeps `tinydraft_mlx.generate(...)` working either way."""

    def __call__(self, *args, **kwargs):
        return speculative.generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())

"""Command line: `python -m tinydraft_mlx.generate` (console script `tinydraft-mlx`), here in
`cli.py` so that no module of the package is named like the API function `generate` (importing
such a module rebinds the package attribute `tinydraft_mlx.generate` to it).

Streams the generated text as rounds are accepted and prints `stats.summary()` on stderr.
Bad arguments exit with status 2 and one line naming the flag, the allowed range and the value.
`--prompt-cache-file` keeps the prompt's KV caches in a file across runs; a prompt longer than
one prefill chunk shows a progress bar on stderr.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from ..engine.backend import active_blas, compiled_kernels, device_name
from ..engine.distributed import DesyncError, GroupError, ranks_of
from ..engine.forward import PREFILL_STEP
from ..engine.policy import AUTO, DEFAULT_K, explain, sampling_regime
from ..engine.pruning import VocabError
from ..engine.sampling import ParameterError
from ..engine.trees import MAX_TREE
from ..generation.api import stream_generate
from ..generation.loading import (
    NO_DRAFT,
    ModelLoadError,
    default_draft,
    load_models,
    no_draft_notice,
)
from ..generation.options import MAX_DRAFT_TOKENS, Options, flag_message, make_options
from ..generation.prompt_cache import PromptCache, PromptCacheError
from ..generation.text import chat_ids, read_template
from ..vision import VisionError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def setup_arg_parser() -> argparse.ArgumentParser:
    """The CLI's flags, named as in mlx-lm where the concept is the same."""
    p = _Parser(prog="tinydraft-mlx", description="Exact speculative decoding on MLX.")
    p.add_argument("--target", "--model", default=None,
                   help="target model: hub id or directory (default: the bundled demo target)")
    p.add_argument("--draft", "--draft-model", default=None,
                   help="draft model, 'mtp' (the target's own MTP layer, from its original "
                        "checkpoint's mtp.* tensors), 'prompt-lookup' (copy n-gram continuations "
                        "from the prompt and output, no model), or 'none' for plain decoding "
                        "(default: the demo draft, or Qwen2.5-0.5B of the same publisher for a "
                        "Qwen2.5 target)")
    p.add_argument("-k", "--num-draft-tokens", default=str(DEFAULT_K), dest="k",
                   help=f"draft tokens per round, 1..{MAX_DRAFT_TOKENS}, or 'auto' (default) to "
                        "choose 0..8 every round from measured acceptance and costs (0: plain "
                        "decoding where drafting does not pay); with --seed, a fixed k also fixes "
                        "the sample, 'auto' only its distribution")
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
    p.add_argument("--draft-vocab", default=None, metavar="N",
                   help="keep only the draft's N most frequent tokens in its LM head (cheaper "
                        "draft steps; output unchanged), by --draft-vocab-counts")
    p.add_argument("--draft-vocab-counts", default=None, metavar="FILE",
                   help="token counts for --draft-vocab (python -m tinydraft_mlx.vocab; default: "
                        "the demo pair's)")
    p.add_argument("--tree", default=None, metavar="N",
                   help=f"verify a tree of at most N candidate tokens (1..{MAX_TREE}) a round "
                        "instead of a chain of k; k is then its depth")
    p.add_argument("--bitwise", action="store_true",
                   help="every target forward carries the same number of positions: greedy "
                        "output is plain greedy decoding's bit for bit on any device (k <= 8)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="a Jinja chat template (text, or a file) to apply instead (implies "
                        "--chat)")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image for a vision-language target (repeatable): the prompt becomes "
                        "one user message, the images first, through the chat template "
                        "(needs mlx-vlm: pip install 'tinydraft-mlx[vision]')")
    p.add_argument("--stop", action="append", default=None,
                   help="stop at this string (not printed); repeat for several")
    p.add_argument("--prompt-cache-file", default=None, metavar="PATH",
                   help="reuse the prompt's KV caches from PATH when it exists (made with the "
                        "same models), and save them there after the run")
    p.add_argument("--distributed", action="store_true",
                   help="run as one rank of mlx.launch: the target tensor-parallel over the "
                        "ranks, the draft on each; only rank 0 prints")
    p.add_argument("--verbose", action="store_true", help="print the models and settings used")
    return p


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _number(text: str | None, kind: type) -> object:
    """`text` as an int/float, or unchanged when it is not one (validation then names the flag)."""
    try:
        return None if text is None else kind(text)
    except ValueError:
        return text


class UsageError(Exception):
    """A flag the command line cannot use (told as a usage error, status 2)."""


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Options:
    """Convert and validate every value before loading a model: a wrong flag costs nothing.
    Numbers arrive as strings so that a non-number gets the same one-line message as a bad range."""
    for name, kind in [("k", int), ("max_tokens", int), ("temp", float), ("top_p", float),
                       ("top_k", int), ("min_p", float), ("seed", int), ("max_kv_size", int),
                       ("draft_vocab", int), ("tree", int)]:
        setattr(args, name, _number(getattr(args, name), kind))
    if args.distributed and args.prompt_cache_file is not None:
        _fail(parser, "--prompt-cache-file cannot be used with --distributed (each rank holds "
                      "only its shard of the target's cache)")
    if args.prompt_cache_file is not None:
        parent = Path(args.prompt_cache_file).parent
        if not parent.is_dir():  # found before the generation, not after it
            _fail(parser, f"--prompt-cache-file {args.prompt_cache_file}: directory "
                          f"{str(parent)!r} does not exist")
    try:
        return make_options(k=args.k, max_tokens=args.max_tokens, temperature=args.temp,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed, stop=args.stop, max_kv_size=args.max_kv_size,
                            bitwise=args.bitwise, tree=args.tree)
    except ParameterError as err:
        _fail(parser, flag_message(err))


def _prompt(tokenizer, text: str, chat: bool, template: str | None = None,
            images: int = 0) -> str | list[Any]:
    """The prompt as typed, or (--chat, --chat-template) as one user message through the chat
    template (--chat-template's, else the tokenizer's); with `images`, that message with one
    image part per image before the text (the engine renders it)."""
    if images:
        return [{"role": "user", "content": [{"type": "image"}] * images
                 + [{"type": "text", "text": text}]}]
    if not chat and template is None:
        return text
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise UsageError("--chat: this tokenizer has no chat template (give one with "
                         "--chat-template)")
    return chat_ids(tokenizer, [{"role": "user", "content": text}],
                    None if template is None else read_template(template))


def _load_prompt_cache(path: str | None, target, draft, max_kv_size) -> PromptCache | None:
    """The cache in `path` if it exists, else a new one; None without --prompt-cache-file."""
    if path is None:
        return None
    if Path(path).exists():
        pc = PromptCache.load(path, target, draft)
        if max_kv_size not in (None, pc.max_kv_size):
            raise UsageError(f"--max-kv-size {max_kv_size} differs from the prompt cache file's "
                             f"{pc.max_kv_size}")
        return pc
    return PromptCache(target, draft, max_kv_size=max_kv_size)


class _ProgressBar:
    """A tqdm bar on stderr for prompts longer than one prefill chunk (on a CPU a 2k-token
    prompt takes minutes); nothing for short ones."""

    def __init__(self) -> None:
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None and total > PREFILL_STEP:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="prompt", unit="tok", file=sys.stderr,
                            leave=False)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            if done >= total:
                self.bar.close()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    options = _check_args(parser, args)
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    if not text:
        _fail(parser, "--prompt must be non-empty (got an empty prompt)")
    try:
        target, draft, tokenizer = load_models(args.target, args.draft, dtype=args.dtype,
                                               draft_vocab=args.draft_vocab,
                                               draft_vocab_counts=args.draft_vocab_counts,
                                               distributed=args.distributed)
        prompt_cache = _load_prompt_cache(args.prompt_cache_file, target, draft, args.max_kv_size)
        prompt = _prompt(tokenizer, text, args.chat, args.chat_template, len(args.image or []))
        if prompt_cache is not None:  # the cache's bound (checked equal above)
            options = replace(options, max_kv_size=None)
        if args.image and args.chat_template is not None:
            options = replace(options, chat_template=read_template(args.chat_template))
        steps = stream_generate(target, draft, tokenizer, prompt, options=options,
                                prompt_cache=prompt_cache, images=args.image,
                                prompt_progress_callback=_ProgressBar())
    except ParameterError as err:
        _fail(parser, flag_message(err))
    except (ModelLoadError, PromptCacheError, VocabError, GroupError, UsageError,
            VisionError) as err:
        _fail(parser, str(err))
    ranks = ranks_of(target)
    quiet = ranks is not None and ranks.rank != 0  # only rank 0 prints
    if args.draft is None and draft is None and not quiet:
        print(no_draft_notice(args.target), file=sys.stderr)
    if args.verbose and not quiet:
        draft_name = args.draft or default_draft(args.target) or NO_DRAFT
        where = f"; {ranks.size} ranks" if ranks is not None else ""
        print(f"target: {args.target or 'bundled demo target'}; draft: {draft_name}; "
              f"k={options.k}; {options.sampling}; {device_name()} backend, BLAS: "
              f"{active_blas()}{where}",
              file=sys.stderr)
    kernels = compiled_kernels()
    try:
        code = _stream_text(steps, quiet, explained=args.verbose and options.k == AUTO,
                            regime=sampling_regime(options.sampling))
        compiled = compiled_kernels() - kernels
        if args.verbose and not quiet and compiled > 0:
            print(f"(MLX compiled {compiled} CPU kernels during this run, once per machine: the "
                  "speed above includes that; the next runs are faster)", file=sys.stderr)
    except DesyncError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    except RuntimeError as err:
        if ranks is None:
            raise
        # a collective failed: another rank exited or its connection broke (its error is above)
        print(f"{parser.prog}: error: --distributed: the ranks' group failed during the "
              f"generation ({err}); another rank may have exited, see its error", file=sys.stderr)
        return 1
    if prompt_cache is not None:
        prompt_cache.save(args.prompt_cache_file)
    return code


def _stream_text(steps, quiet: bool = False, explained: bool = False,
                 regime: Any = None) -> int:
    """Print text as tokens are accepted, then the stats line on stderr (nothing when `quiet`:
    the other ranks of a distributed run), and with `explained` what k="auto" has learned (its
    policy in sampling `regime`). Ctrl-C stops cleanly (the generator is closed, so its caches
    are rolled back) with status 130."""
    stats, code = None, 0
    try:
        for response in steps:
            stats = response.stats
            if not quiet:
                print(response.text, end="", flush=True)
    except KeyboardInterrupt:
        steps.close()
        code = 130
    if not quiet:
        print(flush=True)
        if stats is not None:
            print(stats.summary(), file=sys.stderr)
        why = explain(stats.policy, regime) if explained and stats and stats.policy else None
        if why is not None:
            print(why, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

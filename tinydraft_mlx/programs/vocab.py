"""Token counts for draft-vocabulary pruning:
`python -m tinydraft_mlx.vocab FILES... -o counts.json`.

Counts how often each token of a model's tokenizer occurs in your own text (files, or directories
read recursively), so that `--draft-vocab N` / `load_models(..., draft_vocab=N,
draft_vocab_counts="counts.json")` keeps the N tokens your workload uses most. The file records a
fingerprint of the tokenizer and is refused with any other.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..engine.pruning import count_tokens, save_counts
from ..generation.loading import DEMO_DIR, ModelLoadError, resolve_model_path


def _files(paths: Sequence[str]) -> Iterator[Path]:
    for name in paths:
        path = Path(name)
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            yield path
        else:
            raise FileNotFoundError(f"{name!r} is neither a file nor a directory")


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8: weights, images)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """Count tokens in FILES with the tokenizer of --model and write the counts file."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    p = argparse.ArgumentParser(prog="python -m tinydraft_mlx.vocab",
                                description="Count token frequencies for --draft-vocab.")
    p.add_argument("files", nargs="+", help="text files or directories (read recursively)")
    p.add_argument("-o", "--output", required=True, help="the counts file to write (JSON)")
    p.add_argument("--model", default=None,
                   help="hub id or directory whose tokenizer to use (default: the demo target)")
    args = p.parse_args(argv)
    try:
        files = list(_files(args.files))
        tokenizer = load_tokenizer(resolve_model_path(args.model or DEMO_DIR / "target"))
    except (FileNotFoundError, ModelLoadError) as err:
        p.exit(2, f"{p.prog}: error: {err}\n")
    texts, skipped = [], []
    for f in files:
        text = read_text(f)
        (texts if text is not None else skipped).append(text if text is not None else f)
    if skipped:
        print(f"skipped {len(skipped)} binary (not UTF-8 text) files, e.g. {str(skipped[0])!r}",
              file=sys.stderr)
    if not texts:
        p.exit(2, f"{p.prog}: error: no text files among {args.files}\n")
    files = [f for f in files if f not in skipped]
    counts = count_tokens(tokenizer, texts)
    save_counts(args.output, tokenizer, counts, [str(f) for f in files][:1000])
    print(f"{len(files)} files, {sum(counts)} tokens, {sum(c > 0 for c in counts)} distinct "
          f"of {len(counts)} -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

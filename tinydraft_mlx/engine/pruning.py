"""Draft-vocabulary pruning (FR-Spec, for a standalone draft model): the draft's LM head keeps only
the N most frequent tokens, and the token counts that choose them.

A Qwen2.5-0.5B draft reads its whole LM head (151,936 x 896, about a quarter of its weights) every
draft step, for tokens that almost never occur. `PrunedDraft` computes the logits of the kept
tokens only and gives every other id -inf, so q is exactly zero outside them. The acceptance rule
already handles a q with zero mass anywhere (a token it never proposes is emitted only through
the residual), and p is never touched: the output stays exactly the target's. Only acceptance
can change, when the target's token falls outside the kept set.

Token counts live in a JSON file (`python -m tinydraft_mlx.vocab`) that names the tokenizer it
was counted with (a fingerprint of its vocabulary); a file of another tokenizer is refused. The
demo pair ships one, counted on its training text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .drafters import resolve_drafter
from .forward import head_module
from .sampling import ParameterError

FORMAT = "tinydraft-mlx token counts 1"
DEMO_COUNTS = Path(__file__).resolve().parents[1] / "demo" / "token_counts.json"


class VocabError(ValueError):
    """A counts file that cannot be used (missing, not ours, another tokenizer), or a draft whose
    head cannot be pruned; the message is one sentence."""


def _vocab(tokenizer: Any) -> dict[str, int]:
    return dict(getattr(tokenizer, "_tokenizer", tokenizer).get_vocab())


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Identifies a tokenizer by its vocabulary (every token and its id)."""
    items = sorted(_vocab(tokenizer).items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:32]


def count_tokens(tokenizer: Any, texts: Iterable[str]) -> list[int]:
    """How often each token id occurs in `texts` (encoded without special tokens)."""
    size = max(_vocab(tokenizer).values()) + 1
    counts = np.zeros(size, dtype=np.int64)
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids:
            counts += np.bincount(np.asarray(ids), minlength=size)[:size]
    return counts.tolist()


def save_counts(path: str | Path, tokenizer: Any, counts: list[int],
                sources: list[str] | None = None) -> Path:
    """Write `counts` (from `count_tokens`) with the tokenizer's fingerprint."""
    path = Path(path)
    path.write_text(json.dumps({
        "format": FORMAT,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "tokens": int(sum(counts)),
        "sources": sources or [],
        "counts": counts,
    }) + "\n")
    return path


def load_counts(path: str | Path, tokenizer: Any) -> list[int]:
    """The counts in `path`; VocabError unless it is a counts file of this tokenizer."""
    path = Path(path)
    if not path.is_file():
        raise VocabError(f"token counts file {str(path)!r} does not exist (make one with: "
                         "python -m tinydraft_mlx.vocab FILES... -o counts.json)")
    try:
        info = json.loads(path.read_text())
        assert info["format"] == FORMAT
        counts = [int(c) for c in info["counts"]]
    except Exception:  # unreadable, not JSON, not ours: one sentence either way
        raise VocabError(f"{str(path)!r} is not a tinydraft-mlx token counts file (make one "
                         "with: python -m tinydraft_mlx.vocab FILES... -o counts.json)") from None
    if info["tokenizer"] != tokenizer_fingerprint(tokenizer):
        raise VocabError(f"{str(path)!r} was counted with another tokenizer than this model's")
    return counts


def kept_ids(counts: list[int], n: int, width: int) -> list[int]:
    """The n most frequent ids below `width` (ties: lower id first), sorted."""
    order = sorted(range(min(len(counts), width)), key=lambda i: (-counts[i], i))
    rest = [i for i in range(len(counts), width)]  # ids the counts never saw, last
    return sorted((order + rest)[:n])


def _head_source(draft: nn.Module) -> nn.Module:
    head = head_module(draft)
    if head is None:
        raise VocabError(f"cannot prune the head of a {type(draft).__name__}: draft_vocab needs "
                         "an mlx-lm model with .model and an LM head (lm_head or tied embeddings)")
    return head


def _pruned_head(source: nn.Module, ids: mx.array) -> nn.Module:
    """A Linear computing `source`'s logits for `ids` only (rows of its weight)."""
    n = ids.size
    if isinstance(source, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        dims = source.scales.shape[-1] * source.group_size
        head = nn.QuantizedLinear(dims, n, bias=False, group_size=source.group_size,
                                  bits=source.bits, mode=getattr(source, "mode", "affine"))
        head.weight, head.scales = source.weight[ids], source.scales[ids]
        if "biases" in source:
            head.biases = source.biases[ids]
        elif "biases" in head:
            del head["biases"]
        return head
    if isinstance(source, (nn.Linear, nn.Embedding)):
        head = nn.Linear(source.weight.shape[1], n, bias="bias" in source)
        head.weight = source.weight[ids]
        if "bias" in source:
            head.bias = source.bias[ids]
        return head
    raise VocabError(f"cannot prune an LM head of type {type(source).__name__}")


class PrunedDraft(nn.Module):
    """`draft` whose logits are computed for `kept` ids only; all other ids get -inf, so the
    draft never proposes them and q is zero there. Same body, same cache, same output width
    (the draft's vocabulary), so the decode loop treats it as any draft model."""

    def __init__(self, draft: nn.Module, kept: list[int]) -> None:
        super().__init__()
        source = _head_source(draft)
        self.args = draft.args
        self.model = draft.model
        self._kept = mx.array(kept, dtype=mx.int32)
        self._width = draft.args.vocab_size
        self.head = _pruned_head(source, self._kept)
        mx.eval(self.head.parameters())

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    @property
    def kept(self) -> list[int]:
        """The ids the draft may propose."""
        return self._kept.tolist()

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.head_logits(self.model(inputs, cache=cache))

    def head_logits(self, hidden: mx.array) -> mx.array:
        """Logits over the whole vocabulary (-inf outside the kept ids) from hidden states."""
        small = self.head(hidden)  # (..., N)
        out = mx.full((*small.shape[:-1], self._width), -mx.inf, dtype=small.dtype)
        out[..., self._kept] = small  # (..., vocab)
        return out


def prune_draft(draft: nn.Module, tokenizer: Any, n: int,
                counts_file: str | Path | None = None) -> PrunedDraft:
    """`draft` keeping its `n` most frequent tokens by `counts_file` (None: the demo pair's
    counts, which only fit the demo tokenizer). ParameterError unless 1 <= n <= the draft's
    vocabulary; VocabError for a counts file of another tokenizer."""
    width = getattr(getattr(draft, "args", None), "vocab_size", None)
    if not isinstance(draft, nn.Module) or width is None:
        raise ParameterError("draft_vocab", "used with a draft model (not prompt lookup, mtp or "
                             "none)", _draft_name(draft))
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= width:
        raise ParameterError("draft_vocab", f"an integer in [1, {width}] (the draft's "
                             "vocabulary)", n)
    if counts_file is None:
        counts_file = DEMO_COUNTS
        if tokenizer_fingerprint(tokenizer) != _file_fingerprint(DEMO_COUNTS):
            raise VocabError("draft_vocab needs token counts for this tokenizer (the shipped "
                             "ones are the demo pair's): python -m tinydraft_mlx.vocab FILES... "
                             "-o counts.json, then pass that file")
    counts = load_counts(counts_file, tokenizer)
    return PrunedDraft(draft, kept_ids(counts, n, width))


def _draft_name(draft: object) -> str:
    """How the user named a draft that is not a model: "none", "prompt-lookup", or its type."""
    try:
        drafter = resolve_drafter(draft)
    except ParameterError:
        return type(draft).__name__
    return drafter.name if drafter.model is None else type(draft).__name__


def _file_fingerprint(path: Path) -> str | None:
    try:
        return json.loads(path.read_text())["tokenizer"]
    except Exception:
        return None

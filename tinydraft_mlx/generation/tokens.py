"""One token's own text and bytes, from the tokenizer's vocabulary.

A target's logits are often wider than its tokenizer's vocabulary (Qwen2.5-7B: 152,064 rows,
151,665 tokenizer entries): an id beyond the vocabulary has no text, and is rendered as none
(mlx-lm's streaming detokenizer would print "!" for it). A token can also be part of a UTF-8
character (byte-level BPE splits rare characters into bytes): its bytes are the vocabulary
entry's own, never the replacement character that decoding it alone gives.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
_SPACE = "\u2581"  # SentencePiece's word boundary


def vocabulary_size(tokenizer: Any) -> int:
    """Entries of the tokenizer's vocabulary, added tokens included (ids below it have text)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    return len(inner)


def has_text(tokenizer: Any, token: int, size: int | None = None) -> bool:
    """Whether `token` is in the tokenizer's vocabulary (`size`: its size, if known)."""
    return 0 <= token < (vocabulary_size(tokenizer) if size is None else size)


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): each byte is written as one printable character,
    the printable Latin-1 ones as themselves and the others as chr(256 + n) in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    chars = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def token_bytes(tokenizer: Any, token: int) -> list[int]:
    """The raw bytes of one token: a byte-level BPE entry's bytes through its alphabet, a
    SentencePiece byte token's byte, else the entry's UTF-8 (its word boundary a space); [] for
    an id beyond the vocabulary."""
    if not has_text(tokenizer, token):
        return []
    entry = tokenizer.convert_ids_to_tokens(token)
    if entry is None:
        return []
    byte = _BYTE_TOKEN.fullmatch(entry)
    if byte is not None:
        return [int(byte.group(1), 16)]
    table = _byte_of_char()
    if isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer) \
            and all(c in table for c in entry):
        return [table[c] for c in entry]
    return list(entry.replace(_SPACE, " ").encode())

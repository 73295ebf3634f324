"""A tokenizer per thread for the server's request side.

A request is tokenized on a thread of the event loop's pool (several at once) while the
generation thread detokenizes the running streams with the worker's tokenizer. A Hugging Face
fast tokenizer is one Rust object behind a borrow checker ("Already borrowed" when two threads
use it and one of them changes its truncation or padding state), and a slow one keeps Python
caches, so the request side never shares the worker's: each thread that plans requests gets its
own copy, made once on its first use (a copy of the demo's costs ~15 ms).
"""

from __future__ import annotations

import copy
import threading
from typing import Any


class PerThread:
    """`get()`: the calling thread's own copy of `tokenizer` (the object itself is left to the
    thread that owns it: the generation thread)."""

    def __init__(self, tokenizer: Any) -> None:
        self.original = tokenizer
        self._local = threading.local()
        self._copying = threading.Lock()  # the copies read the original one at a time

    def get(self) -> Any:
        mine = getattr(self._local, "tokenizer", None)
        if mine is None:
            with self._copying:
                mine = self._local.tokenizer = copy.deepcopy(self.original)
        return mine

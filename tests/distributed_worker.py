"""One rank of the distributed tests, started by `mlx.launch` (tests/test_distributed.py).

    mlx.launch --backend ring --hosts 127.0.0.1 -n 2 python tests/distributed_worker.py OUT MODE

Loads the demo pair with the target tensor-parallel over the ranks and writes what it generated
to OUT/rank<r>.json. MODE "scenarios": greedy with k=4, k="auto", prompt lookup and plain, with a
bounded cache, and sampling without a seed. MODE "desync": each rank samples with its own seed
(a deliberately desynchronised rank). MODE "die": rank 1 exits in the middle of a generation.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import tinydraft_mlx  # noqa: F401  # isort: skip  (first: the BLAS preload)
from tinydraft_mlx import generate, load_models
from tinydraft_mlx.engine.distributed import DesyncError, ranks_of
from tinydraft_mlx.engine.speculative import decode

PROMPT = "class Stack:\n    def push(self, item):"
# repeated text, so that prompt lookup finds n-grams to copy
LOOKUP = "    def push(self, item):\n        self.items.append(item)\n\n    def push(self, item):"
N = 8


def scenarios(target, draft, tok) -> dict:
    out = {}
    for name, d, k, kv in [("k4", draft, 4, None), ("auto", draft, "auto", None),
                           ("lookup", "prompt-lookup", 3, None), ("plain", None, 4, None),
                           ("bounded", draft, 4, 12)]:
        prompt = LOOKUP if name == "lookup" else PROMPT
        tokens, stats = generate(target, d, tok, prompt, k=k, max_tokens=N, max_kv_size=kv)
        out[name] = {"tokens": tokens, "k_histogram": stats.k_histogram}
    tokens, _ = generate(target, draft, tok, PROMPT, k=4, max_tokens=N, temperature=1.0)
    out["sampled"] = {"tokens": tokens}
    return out


def desync(target, tok, rank: int) -> dict:
    ids = tok.encode(PROMPT)
    try:  # plain sampling, no EOS: both ranks run the same number of forward passes
        tokens = [t.id for t in decode(target, None, ids, max_tokens=6, eos_token_ids=(),
                                       sampling=tinydraft_mlx.SamplingParams(1.0, seed=rank))]
        return {"tokens": tokens}
    except DesyncError as err:
        return {"desync": str(err)}


def main() -> None:
    out_dir, mode = Path(sys.argv[1]), sys.argv[2]
    target, draft, tok = load_models(distributed=True)
    ranks = ranks_of(target)
    result = {"rank": ranks.rank, "size": ranks.size}
    if mode == "scenarios":
        result.update(scenarios(target, draft, tok))
    elif mode == "desync":
        result.update(desync(target, tok, ranks.rank))
    elif mode == "die":
        steps = decode(target, draft, tok.encode(PROMPT), k=2, max_tokens=40)
        for i, _ in enumerate(steps):
            if ranks.rank == 1 and i == 3:
                os._exit(3)  # a rank that dies mid-generation
        result["completed"] = True
    (out_dir / f"rank{ranks.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

"""Hybrid (recurrent + attention) targets: what rolling back their recurrent state costs, and
what speculation gives on them.

    python -m bench.hybrid_models     # ~15 minutes on a 2-core machine; results/hybrid_models.*

The target is a random Qwen3.5-shaped model: Qwen3.5-0.8B's layer shapes (hidden 1024, Gated
DeltaNet layers with 16 key / 16 value heads of 128, full attention every 4th layer with 8 heads
of 256 and 2 KV heads, MLP 3584), 8 layers of them (6 GDN, 2 attention) and a 151,936-entry
vocabulary (the bundled tokenizer's width, so the 40M Qwen2-shaped draft of
bench/qwen_shapes.py pairs with it), float32. The draft is that 40M model wrapped in
bench/oracle_draft.py's oracle-acceptance draft (it pays its forward, then proposes the target's
own greedy token with probability alpha). Each contender runs in a process of its own:
mlx-lm's plain `generate_step` and `batch_generate`, our plain decoding, our speculative
decoding at k = 1..4 and k="auto" with alpha 0.5 and 0.9, at B = 1 and B = 4 (every row at
its own alpha draws: ragged rollbacks). Separately, in one process: a verify forward of k + 1
positions and the rollback of its recurrent layers (replay of n of them), timed apart, and the
memory the tape holds per k, projected for Qwen3.5-27B's layer shapes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = Path.home() / ".cache" / "tinydraft-mlx" / "shapes"
TARGET = SHAPES / "qwen3_5-8L"
DRAFT = SHAPES / "40M"
PROMPTS = ["def parse_args(self, args=None):\n"]
MAX_TOKENS = 48
REPEATS = 2
# Qwen3.5 layer shapes: hidden, GDN key heads, value heads, head dims, conv kernel, GDN layers
QWEN35 = {"0.8B": (1024, 16, 16, 128, 128, 4, 18), "27B": (5120, 16, 48, 128, 128, 4, 48)}


def config() -> dict:
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text", "hidden_size": 1024, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
            "intermediate_size": 3584, "vocab_size": 151936, "tie_word_embeddings": True,
            "linear_num_key_heads": 16, "linear_num_value_heads": 16,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                "partial_rotary_factor": 0.25},
        },
        "tie_word_embeddings": True,
    }


def build() -> None:
    """Write the random target (mlx-lm's own model, its initialisation) next to the shapes of
    bench/qwen_shapes.py, with the bundled tokenizer."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5

    if (TARGET / "model.safetensors").is_file():
        return
    TARGET.mkdir(parents=True, exist_ok=True)
    cfg = config()
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(cfg))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(TARGET / "model.safetensors"), weights)
    (TARGET / "config.json").write_text(json.dumps(cfg, indent=1))
    tok = ROOT / "tinydraft_mlx" / "demo" / "target"
    for f in tok.iterdir():
        if "token" in f.name or f.name == "vocab.json" or f.name == "merges.txt":
            shutil.copy(f, TARGET / f.name)


def worker(contender: str, batch: int, alpha: float) -> dict:
    from bench.common import machine  # noqa: I001  (before mlx.core: the BLAS preload)

    import mlx.core as mx
    from mlx_lm.generate import batch_generate as mlx_batch
    from mlx_lm.generate import generate_step

    from bench.oracle_draft import BatchOracleDraft, OracleDraft
    from tinydraft_mlx import BatchDecoder, generate, load_models
    from tinydraft_mlx.engine.sampling import SamplingParams

    target, draft, tok = load_models(str(TARGET), str(DRAFT), dtype="float32")
    # B = 4: every row decodes the first prompt (the oracle draft serves one reference), each
    # with its own acceptance draws
    ids = [tok.encode(PROMPTS[0])] * batch
    refs = [ids[0] + generate(target, None, tok, ids[0], max_tokens=MAX_TOKENS + 8)[0]]

    def run() -> int:
        if contender == "mlx_lm":
            if batch == 1:
                steps = zip(range(MAX_TOKENS), generate_step(mx.array(ids[0]), target))
                return sum(1 for _ in steps)
            out = mlx_batch(target, tok, ids, max_tokens=MAX_TOKENS, return_token_ids=True)
            return sum(len(t) for t in out.token_ids)
        k = 0 if contender == "plain" else ("auto" if contender == "auto" else int(contender))
        if batch == 1:
            d = OracleDraft(draft, refs[0], alpha, target=target) if k else None
            out, _ = generate(target, d, tok, ids[0], k=k or 1, max_tokens=MAX_TOKENS)
            return len(out)
        d = BatchOracleDraft(draft, refs[0], alpha, target=target) if k else None
        decoder = BatchDecoder(target, d)
        for i in ids:
            decoder.insert(i, draft="model" if d else None, k=k or 1, max_tokens=MAX_TOKENS,
                           sampling=SamplingParams())
        n = 0
        while len(decoder):
            n += sum(len(t) for t in decoder.step().values())
        return n

    run()  # warm-up (traces, the policy's first look)
    best = 0.0
    for _ in range(REPEATS):
        start = time.perf_counter()
        n = run()
        best = max(best, n / (time.perf_counter() - start))
    return {"contender": contender, "batch": batch, "alpha": alpha, "tok_s": best,
            "machine": machine()}


def rollback_cost() -> dict:
    """One process: for k = 1..4, a verify forward of k + 1 positions on one sequence's caches
    (evaluated) and then the rollback of the recurrent layers to n = k // 2 + 1 of them
    (evaluated), each timed over 20 repeats (medians); the tape's bytes after the verify."""
    import statistics

    import mlx.core as mx

    from bench import common  # noqa: F401, I001  (before mlx.core: the BLAS preload)
    from tinydraft_mlx import load_models
    from tinydraft_mlx.engine.cache import make_cache, rollback
    from tinydraft_mlx.engine.cache.recurrent import RecurrentCache
    from tinydraft_mlx.engine.forward import forward, prefill

    target, _, tok = load_models(str(TARGET), "none", dtype="float32")
    ids = tok.encode(PROMPTS[0] * 4)
    out = []
    for k in (1, 2, 3, 4):
        verify, replay = [], []
        tape = 0
        for _ in range(20):
            cache = make_cache(target, margin=k + 1)
            prefill(target, cache, ids)
            start = time.perf_counter()
            logits = forward(target, mx.array([ids[: k + 1]]), cache)
            mx.eval(logits, [c.state for c in cache])
            mid = time.perf_counter()
            rollback(cache, len(ids) + k // 2 + 1)
            mx.eval([c.cache for c in cache if isinstance(c, RecurrentCache)])
            end = time.perf_counter()
            verify.append(mid - start)
            replay.append(end - mid)
        cache = make_cache(target, margin=k + 1)
        prefill(target, cache, ids)
        forward(target, mx.array([ids[: k + 1]]), cache)
        for c in cache:
            if isinstance(c, RecurrentCache):
                for seg in c.tape:
                    tape += seg.conv.nbytes + sum(v.nbytes for v in seg.recurrence.arguments
                                                  .values() if isinstance(v, mx.array))
        out.append({"k": k, "verify_ms": 1e3 * statistics.median(verify),
                    "rollback_ms": 1e3 * statistics.median(replay), "tape_bytes": tape})
    return {"rollback": out}


def projected_bytes(shape: str, k: int, bytes_per: int = 2) -> dict:
    """What the tape holds per sequence for a verify of k + 1 positions, from the layer shapes
    (the arrays recorded: the convolution's input, q, k, v, g, beta, and the start state kept
    alive), and what a state per position (the alternative: every verified position's state
    written) would hold."""
    hidden, hk, hv, dk, dv, kernel, layers = QWEN35[shape]
    conv = 2 * hk * dk + hv * dv
    per_position = conv + 2 * hv * dk + hv * dv + 2 * hv  # conv input, q/k (repeated), v, g, beta
    state = hv * dv * dk * 4  # float32 state
    tape = layers * ((k + 1 + kernel - 1) * conv * bytes_per
                     + (k + 1) * (per_position - conv) * bytes_per + state)
    return {"shape": shape, "k": k, "tape_MB": tape / 1e6,
            "states_per_position_MB": layers * (k + 1) * state / 1e6}


def plot(report: dict, path: Path) -> None:
    from bench.common import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, batch in zip(axes, (1, 4)):
        rows = [r for r in report["runs"] if r["batch"] == batch]
        base = next(r["tok_s"] for r in rows if r["contender"] == "plain")
        labels, values = [], []
        for r in rows:
            label = r["contender"] if r["contender"] in ("mlx_lm", "plain") else \
                f"k={r['contender']} a={r['alpha']}"
            labels.append(label)
            values.append(r["tok_s"] / base)
        ax.barh(labels, values, color="tab:blue")
        ax.axvline(1.0, color="gray", lw=0.8)
        ax.set_title(f"B = {batch}: tok/s over our plain decoding")
    fig.suptitle("Qwen3.5-shaped random target (8 layers), 40M oracle-acceptance draft, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from bench.common import in_fresh_process, machine, save

    build()
    if not (DRAFT / "config.json").is_file():
        raise SystemExit(f"{DRAFT} is missing: run python -m bench.qwen_shapes 40M first")
    runs = []
    plan = [("mlx_lm", 1, 0.0), ("plain", 1, 0.0)]
    plan += [(str(k), 1, a) for a in (0.5, 0.9) for k in (1, 2, 3, 4)]
    plan += [("auto", 1, a) for a in (0.5, 0.9)]
    plan += [("mlx_lm", 4, 0.0), ("plain", 4, 0.0), ("2", 4, 0.9), ("auto", 4, 0.9)]
    for contender, batch, alpha in plan:
        runs.append(in_fresh_process(__file__, contender, batch, alpha))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "machine"}), flush=True)
    cost = in_fresh_process(__file__, "rollback", 0, 0.0)
    report = {"machine": machine(), "dtype": "float32", "max_tokens": MAX_TOKENS,
              "target": config()["text_config"], "draft": "40M Qwen2-shaped, oracle acceptance",
              "runs": runs, **cost,
              "projected": [projected_bytes(s, k) for s in QWEN35 for k in (1, 2, 4)]}
    print(json.dumps(report["rollback"]), flush=True)
    save(report, "hybrid_models", plot)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        contender = sys.argv[2]
        result = rollback_cost() if contender == "rollback" else \
            worker(contender, int(sys.argv[3]), float(sys.argv[4]))
        print(json.dumps(result))
    else:
        main()

"""Train the demo target's DFlash block drafter and ship it (tinydraft_mlx/demo/dflash/, the
reference's checkpoint layout), so that `load_models(draft=<that directory>)` drafts a block per
round offline on the demo target.

    python -m training.train_dflash                   # ~10 min on 2 CPU cores
    python -m training.train_dflash --resume          # more training of the shipped one

The recipe is training/dflash.py's (the paper's): the target's states after layers 1 and 4 (of
6) as context, blocks of 16 from an anchor token, KL from the target's own next-token
distributions. The text: windows of the demo's training code (the standard library,
training/train_demo.py's split) and, --own-share of every batch, the target's own greedy
continuations of training windows (--generated; the text greedy speculative decoding verifies).
Reported (results/train_dflash.json): the held-out KL and per-block-position top-1 agreement
with the target, teacher-forced on held-out stdlib windows, before and after, and the losses.
Nothing here is imported by the library.
"""

from __future__ import annotations

import argparse
import json
import time

from bench.common import command, machine, save  # isort: skip  (tinydraft_mlx before mlx)
import mlx.core as mx
import numpy as np

from tinydraft_mlx import batch_generate, load_models
from tinydraft_mlx.engine.drafters.dflash import load_dflash
from training.dflash import distil, drafter_config, features, new_drafter
from training.dflash import save as save_drafter
from training.train_demo import ROOT, corpus_files, encode

TARGET = ROOT / "tinydraft_mlx" / "demo" / "target"
OUT = ROOT / "tinydraft_mlx" / "demo" / "dflash"
LAYERS = [1, 4]  # the target layers whose outputs it reads (of 6)


def mask_token(tok) -> int:
    """The id the demo pair's token counts rank last: a mask token the text hardly uses."""
    counts = json.loads((ROOT / "tinydraft_mlx" / "demo" / "token_counts.json").read_text())
    ranked = counts["counts"]
    return int(min(range(len(ranked)), key=lambda i: ranked[i]))


def agreement(draft, target, windows: np.ndarray, anchor: int) -> dict:
    """Teacher-forced on `windows`: per block position, how often the drafter's argmax is the
    target's, and the mean KL(target || drafter) over the block."""
    size, hits, kl, n = draft.block_size, np.zeros(draft.block_size - 1), 0.0, 0
    for start in range(0, len(windows), 32):
        x = mx.array(windows[start : start + 32])
        logits, states = features(draft, target, x)
        masks = mx.full((x.shape[0], size - 1), draft.config.mask_token_id, dtype=x.dtype)
        block = mx.concatenate([x[:, anchor : anchor + 1], masks], axis=1)
        q, _ = draft(block, draft.make_cache(), context=states[:, :anchor])
        p = logits[:, anchor : anchor + size - 1]
        hits += np.array((mx.argmax(q, -1) == mx.argmax(p, -1)).sum(0))
        logp = p - mx.logsumexp(p, axis=-1, keepdims=True)
        logq = q - mx.logsumexp(q, axis=-1, keepdims=True)
        kl += float((mx.exp(logp) * (logp - logq)).sum(-1).mean(-1).sum())
        n += x.shape[0]
    return {"agreement": [round(h / n, 4) for h in hits], "kl": round(kl / n, 4)}


def own_text(target, tok, code: np.ndarray, rows: int, prompt_len: int, new: int,
             seed: int) -> np.ndarray:
    """The target's greedy continuations (`new` tokens) of `rows` code windows, as windows."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(code) - prompt_len - 1, size=rows)
    prompts = [code[s : s + prompt_len].tolist() for s in starts]
    out = batch_generate(target, None, tok, prompts, max_tokens=new, k=1)
    texts = [p + tokens for p, (tokens, _) in zip(prompts, out)]
    width = prompt_len + new
    return np.stack([t for t in texts if len(t) == width])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=96)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--generated", type=int, default=256, help="own-text rows to generate")
    p.add_argument("--own-share", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decay", type=float, default=None,
                   help="weight block position i by exp(-(i - 1) / DECAY) (default: alike)")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    started = time.time()
    target, _, tok = load_models(str(TARGET), "none", dtype="float32")
    train_files, held_files = corpus_files()
    code, held = encode(tok, train_files), encode(tok, held_files)
    rng = np.random.default_rng(args.seed)
    cut = lambda data, n: np.stack([data[s : s + args.seq] for s in  # noqa: E731
                                    rng.integers(0, len(data) - args.seq, n)])
    held_windows = cut(held, 256)
    if args.resume:
        draft = load_dflash(target, OUT)
        config = json.loads((OUT / "config.json").read_text())
    else:
        config = drafter_config(target, block_size=args.block_size, mask_token_id=mask_token(tok),
                                layers=args.layers, target_layer_ids=LAYERS)
        draft = new_drafter(target, config, args.seed)
    anchor = args.seq - args.block_size
    before = agreement(draft, target, held_windows, anchor)
    own = own_text(target, tok, code, args.generated, args.seq // 2, args.seq - args.seq // 2,
                   args.seed) if args.generated else None
    seq = args.seq

    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        """A batch: --own-share of it the target's own text, the rest fresh code windows."""
        mine = 0 if own is None else int(round(n * args.own_share))
        starts = rng.integers(0, len(code) - seq, n - mine)
        rows = [code[s : s + seq] for s in starts]
        if mine:
            rows += list(own[rng.integers(0, len(own), mine)])
        return np.stack(rows)

    def progress(step: int, loss: float) -> None:
        print(f"step {step}: loss {loss:.3f}", flush=True)

    losses = distil(draft, target, draw, steps=args.steps, batch=args.batch, lr=args.lr,
                    seed=args.seed, decay=args.decay, report=progress)
    after = agreement(draft, target, held_windows, anchor)
    save_drafter(draft, config, OUT, mx.float16)  # as the demo target's weights are stored
    settings = dict(vars(args))
    report = {"machine": machine(), "command": command(__file__, settings),
              "settings": {**settings, "dtype": "float32"},
              "layers_read": LAYERS, "minutes": round((time.time() - started) / 60, 1),
              "held_out": {"before": before, "after": after, "anchor": anchor},
              "loss_first_100": float(np.mean(losses[:100])),
              "loss_last_100": float(np.mean(losses[-100:]))}
    earlier = ROOT / "results" / "train_dflash.json"
    if args.resume and earlier.is_file():  # the passes before this one
        old = json.loads(earlier.read_text())
        report["passes"] = old.get("passes", [{k: old[k] for k in (
            "command", "minutes", "held_out", "loss_first_100", "loss_last_100")}])
    report.setdefault("passes", [])
    report["passes"].append({k: report[k] for k in (
        "command", "minutes", "held_out", "loss_first_100", "loss_last_100")})
    save(report, "train_dflash", plot)
    print(json.dumps(report["held_out"], indent=1))


def plot(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.common import finish_figure

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in ("before", "after"):
        rates = report["held_out"][name]["agreement"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    ax.set_xlabel("block position")
    ax.set_ylabel("top-1 agreement with the target (held out)")
    ax.legend()
    finish_figure(plt, fig, path, report, "DFlash drafter on the demo target",
                  report["command"])


if __name__ == "__main__":
    main()

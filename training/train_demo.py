"""Train the bundled demo pair from seeds: a byte-level BPE tokenizer, a Qwen2 target, and a Qwen2
draft distilled toward the target (KL to its soft labels), on the Python standard library source.

    python -m training.train_demo            # ~47 min on 2 CPU cores; writes tinydraft_mlx/demo/

PyTorch trains (2.6-6x faster than MLX on the CPU here); the result is saved as float16
safetensors with a transformers config, so both mlx-lm and transformers load it. Nothing here is
imported by the library.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tinydraft_mlx" / "demo"
EOS = "<|endoftext|>"
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "turtledemo"}


def corpus_files() -> tuple[list[Path], list[Path]]:
    """Stdlib .py files outside test folders, split by file: ~5% held out, by a hash of the path."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in stdlib.rglob("*.py")
        if not SKIP_PARTS & set(p.relative_to(stdlib).parts[:-1]) and p.stat().st_size < 400_000
    )
    held = [p for p in files if int(hashlib.sha1(p.name.encode()).hexdigest(), 16) % 20 == 0]
    held_set = set(held)
    return [p for p in files if p not in held_set], held


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((read(p) for p in files), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def encode(tok: PreTrainedTokenizerFast, files: list[Path]) -> np.ndarray:
    """All files as one stream of ids, each file followed by EOS."""
    eos = tok.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for p in files:
        ids += tok.encode(read(p)) + [eos]
    return np.array(ids, dtype=np.int32)


def make_config(vocab: int, hidden: int, layers: int, heads: int, kv: int, ffn: int, eos: int):
    return Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=ffn, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos,
    )


def batches(data: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        x = np.stack([data[s : s + seq + 1] for s in starts])
        yield torch.from_numpy(x[:, :-1]).long(), torch.from_numpy(x[:, 1:]).long()


def lr_at(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))))


@torch.no_grad()
def held_out_loss(model, data: np.ndarray, seq: int, windows: int = 64) -> float:
    model.eval()
    starts = np.linspace(0, len(data) - seq - 2, windows).astype(int)
    x = torch.from_numpy(np.stack([data[s : s + seq + 1] for s in starts])).long()
    losses = []
    for chunk in x.split(16):
        logits = model(chunk[:, :-1]).logits
        losses.append(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()).item())
    model.train()
    return float(np.mean(losses))


def train(model, batches, steps, peak_lr, teacher=None, alpha=0.5, log="", warmup=100):
    """Next-token cross-entropy over `batches` ((x, y) id tensors); with a teacher, mixed with
    KL(teacher || student) at T = 1. Returns the seconds it took; the model is left in eval mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    start = time.time()
    for step, (x, y) in zip(range(steps), batches):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup)
        logits = model(x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        if teacher is not None:
            with torch.no_grad():
                soft = F.log_softmax(teacher(x).logits, dim=-1)
            kl = F.kl_div(F.log_softmax(logits, -1), soft, log_target=True, reduction="batchmean")
            loss = alpha * loss + (1 - alpha) * kl / x.shape[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            rate = (step + 1) * x.numel() / (time.time() - start)
            print(f"{log} step {step}/{steps} loss {loss.item():.3f} ({rate:.0f} tok/s)",
                  flush=True)
    model.eval()
    return time.time() - start


def save(model, tok, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(directory)
    model.to(torch.float32)
    tok.save_pretrained(directory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--target-steps", type=int, default=900)
    ap.add_argument("--draft-steps", type=int, default=700)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    t0 = time.time()

    train_files, held_files = corpus_files()
    tok = train_tokenizer(train_files, args.vocab)
    train_ids, held_ids = encode(tok, train_files), encode(tok, held_files)
    eos = tok.convert_tokens_to_ids(EOS)
    vocab = len(tok)
    print(f"{len(train_files)} train files ({len(train_ids)} tokens), {len(held_files)} held out "
          f"({len(held_ids)} tokens), vocab {vocab}, {time.time() - t0:.0f}s", flush=True)

    target = Qwen2ForCausalLM(make_config(vocab, 256, 6, 4, 2, 768, eos))
    draft = Qwen2ForCausalLM(make_config(vocab, 128, 2, 2, 1, 384, eos))
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    target_s = train(target, batches(train_ids, args.batch, args.seq,
                                     np.random.default_rng(args.seed)),
                     args.target_steps, 2e-3, log="target")
    draft_s = train(draft, batches(train_ids, args.batch, args.seq,
                                   np.random.default_rng(args.seed + 1)),
                    args.draft_steps, 3e-3, teacher=target, log="draft")
    losses = {name: held_out_loss(m, held_ids, args.seq) for name, m in
              [("target", target), ("draft", draft)]}
    save(target, tok, args.out / "target")
    save(draft, tok, args.out / "draft")

    report = {
        "command": "python -m training.train_demo " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "seconds": {"total": round(time.time() - t0), "target": round(target_s),
                    "draft": round(draft_s)},
        "parameters": {"target": n_target, "draft": n_draft},
        "held_out_loss_nats": losses,
        "uniform_loss_nats": math.log(vocab),
        "corpus": {
            "source": f"Python {platform.python_version()} standard library, test folders skipped",
            "train_files": len(train_files), "train_tokens": int(len(train_ids)),
            "held_out_files": [str(p.relative_to(sysconfig.get_paths()["stdlib"]))
                               for p in held_files],
            "held_out_tokens": int(len(held_ids)),
        },
        "machine": {"platform": platform.platform(), "processor": platform.machine(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
    }
    (ROOT / "results").mkdir(exist_ok=True)
    (ROOT / "results" / "demo_training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("seconds", "parameters", "held_out_loss_nats")}))


if __name__ == "__main__":
    main()

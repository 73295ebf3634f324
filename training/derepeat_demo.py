"""Repair the bundled demo pair after its chat/editing retrain (training/retrain_demo.py): the
target's greedy text on code prompts fell into runs of one token ("Return a list of all all all
..."), and the draft agreed with it less. From the current weights:

1. The target: its usual objective on the same code + chat + edits mixture, plus unlikelihood
   (Welleck et al. 2019): token-level, a penalty -log(1 - p(c)) on every token c of the last
   WINDOW inputs that is not the next token; and sequence-level, every other step, on the
   target's own greedy continuations of training prompts, -log(1 - p(x_t)) at each token x_t
   that repeats a 4-gram or its previous token (what greedy decoding loops on).
2. The draft: distilled toward the new target (KL at T = 1, weighted against cross-entropy by
   --draft-alpha) on the same mixture and on the new target's own greedy continuations, the text
   greedy speculative decoding verifies.

    python -m training.derepeat_demo        # ~15 min on 2 CPU cores; writes tinydraft_mlx/demo/
                                         # and results/demo_derepeat.{json,png}
    python -m training.derepeat_demo --target-steps 0 ... --resume   # more draft distillation

The shipped pair is the result of the passes results/demo_derepeat.json lists, in order; "old"
there is the pair before the first pass (--old: its directory, e.g. a checkout of it).

Reported, old pair -> new: held-out loss (code, chat, edits) and copy accuracy
(retrain_demo.measure); on 24 held-out code prompts (bench/demo_quality.py's), greedy k = 4
acceptance of the draft along the target's greedy text (rounds simulated from teacher-forced
argmax agreement: the engine's greedy rule), and the longest run of one repeated token; the
greedy text of the README's and `make demo`'s prompts. The heads are retrained on the new target
afterwards with training/train_heads.py. Nothing here is imported by the library.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, Qwen2ForCausalLM

from bench.common import command, machine, pyplot
from bench.demo_quality import held_out_prompts
from training.retrain_demo import DEMO, Mixture, corpora, measure, stream
from training.train_demo import ROOT, lr_at

WINDOW = 16  # token-level unlikelihood: the candidates are the last WINDOW inputs
README_PROMPTS = ["def parse_args(", "class Node:", "import os\n"]  # README's and make demo's
K = 4


def token_unlikelihood(logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean over positions of sum_c -log(1 - p(c)), c in the last WINDOW inputs, c != y."""
    vocab = logits.shape[-1]
    onehot = F.one_hot(x, vocab).float()  # (B, L, V)
    cum = onehot.cumsum(1)
    recent = cum - F.pad(cum, (0, 0, WINDOW, 0))[:, : x.shape[1]]
    candidates = (recent > 0).float().scatter(2, y[..., None], 0.0)
    p = F.softmax(logits, -1).clamp(max=1 - 1e-5)
    return -(torch.log1p(-p) * candidates).sum(-1).mean()


def repeats(seq: torch.Tensor, start: int) -> torch.Tensor:
    """(L,) bool: positions >= start whose token equals the previous one or completes a 4-gram
    seen before in the sequence."""
    ids = seq.tolist()
    out = torch.zeros(len(ids), dtype=torch.bool)
    seen: set[tuple[int, ...]] = set()
    for t in range(len(ids)):
        gram = tuple(ids[max(0, t - 3) : t + 1])
        if t >= start and ((t and ids[t] == ids[t - 1]) or (len(gram) == 4 and gram in seen)):
            out[t] = True
        if len(gram) == 4:
            seen.add(gram)
    return out


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """(B, P + n): each prompt row (same length) and its n greedy tokens."""
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=0)


@torch.no_grad()
def greedy_rows(target, tok, prompts: list[str], n: int) -> list[tuple[torch.Tensor, int]]:
    """Each prompt with the target's n greedy tokens: (ids (1, P + n), P)."""
    rows = []
    for text in prompts:
        ids = torch.tensor([tok.encode(text)])
        rows.append((greedy(target, ids, n), ids.shape[1]))
    return rows


def sequence_unlikelihood(model, data: np.ndarray, rng, batch: int, prompt_len: int,
                          n: int) -> torch.Tensor:
    """Unlikelihood of the model's own greedy continuations' repeating tokens."""
    starts = rng.integers(0, len(data) - prompt_len - 1, size=batch)
    prompts = torch.from_numpy(np.stack([data[s : s + prompt_len] for s in starts])).long()
    model.eval()
    seqs = greedy(model, prompts, n)
    model.train()
    mask = torch.stack([repeats(s, prompt_len) for s in seqs])[:, 1:]
    logits = model(seqs[:, :-1]).logits
    p = F.softmax(logits, -1).gather(-1, seqs[:, 1:, None])[..., 0].clamp(max=1 - 1e-5)
    return -(torch.log1p(-p) * mask).sum() / mask.sum().clamp(min=1)


def _steps(model, steps: int, lr: float):
    """(step, optimizer) for `steps` AdamW steps on `model` (train mode), the learning rate set
    per step on train_demo's warm-up + cosine schedule."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, min(50, steps // 5))
        yield step, opt


def train_target(model, mix, code, steps, lr, weight, seq_weight, batch, seed) -> float:
    rng = np.random.default_rng(seed)
    start = time.time()
    for step, opt in _steps(model, steps, lr):
        x, y = mix.batch(batch)
        logits = model(x).logits
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss = ce + weight * token_unlikelihood(logits, x, y)
        if step % 2 and seq_weight:
            loss = loss + seq_weight * sequence_unlikelihood(model, code, rng, batch // 2, 32, 48)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"target step {step}/{steps} ce {ce.item():.3f} loss {loss.item():.3f} "
                  f"({time.time() - start:.0f} s)", flush=True)
    model.eval()
    return time.time() - start


def target_text(target, code: np.ndarray, rows: int, seed: int, prompt_len: int) -> torch.Tensor:
    """The target's greedy continuations (96 tokens) of `rows` code windows of `prompt_len`."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(code) - prompt_len - 1, size=rows)
    prompts = torch.from_numpy(np.stack([code[s : s + prompt_len] for s in starts])).long()
    return torch.cat([greedy(target, chunk, 96) for chunk in prompts.split(32)])


def train_draft(draft, target, mix, generated, steps, lr, alpha, batch, seed) -> float:
    """Cross-entropy on the data (weight alpha) + KL(target || draft) per token (1 - alpha),
    half of each batch from the mixture, half from the target's own text."""
    rng = np.random.default_rng(seed)
    start = time.time()
    for step, opt in _steps(draft, steps, lr):
        x, y = mix.batch(batch // 2)
        g = generated[rng.integers(0, len(generated), size=batch // 2)]
        for xs, ys in ((x, y), (g[:, :-1], g[:, 1:])):
            logits = draft(xs).logits
            with torch.no_grad():
                soft = F.log_softmax(target(xs).logits, -1)
            kl = F.kl_div(F.log_softmax(logits, -1), soft, log_target=True, reduction="batchmean")
            loss = (alpha * F.cross_entropy(logits.flatten(0, 1), ys.flatten())
                    + (1 - alpha) * kl / xs.shape[1]) / 2
            loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"draft step {step}/{steps} loss {loss.item():.3f} "
                  f"({time.time() - start:.0f} s)", flush=True)
    draft.eval()
    return time.time() - start


def longest_run(ids: list[int]) -> int:
    best = run = 1
    for a, b in zip(ids, ids[1:]):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best if ids else 0


@torch.no_grad()
def greedy_quality(target, draft, tok, prompts: list[str], n: int = 64) -> dict:
    """Greedy k = 4 acceptance of the draft along the target's greedy text (accepted / drafted,
    rounds as the engine's greedy rule runs them) and the longest run of one token, per prompt."""
    accepted = drafted = 0
    runs = []
    for seq, start in greedy_rows(target, tok, prompts, n):
        out = seq[0, start:].tolist()
        runs.append(longest_run(out))
        agree = (draft(seq[:, :-1]).logits.argmax(-1)[0, start - 1:] == seq[0, start:]).tolist()
        t = 0
        while t < n - 1:  # a round drafts min(K, tokens left - 1), as the engine caps k
            k = min(K, n - 1 - t)
            m = 0
            while m < k and agree[t + m]:
                m += 1
            accepted, drafted, t = accepted + m, drafted + k, t + m + 1
    return {"greedy_acceptance_k4": accepted / drafted, "longest_runs": runs,
            "prompts_with_run_over_3": sum(r > 3 for r in runs)}


def samples(target, tok) -> dict:
    return {p: tok.decode(greedy(target, torch.tensor([tok.encode(p)]), 48)[0].tolist()[
        len(tok.encode(p)):]) for p in README_PROMPTS}


def report_of(target, draft, tok, held, prompts, seq) -> dict:
    out = measure(target, draft, held, seq, tok)
    out.update(greedy_quality(target, draft, tok, prompts))
    out["samples"] = samples(target, tok)
    out["readme_longest_runs"] = [longest_run(tok.encode(s)) for s in out["samples"].values()]
    return out


def save_weights(model, directory: Path) -> None:
    """The model's weights (float16, as shipped) into `directory`'s model.safetensors; its
    config, tokenizer and chat template files stay as they are."""
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.float16).save_pretrained(tmp)
        model.to(torch.float32)
        shutil.copyfile(Path(tmp) / "model.safetensors", directory / "model.safetensors")


def plot(report: dict, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    which = ("old", "new")
    axes[0].bar(which, [report[w]["greedy_acceptance_k4"] for w in which], color=["C0", "C1"])
    axes[0].axhline(0.5, color="grey", ls="--", lw=1, label="bar: 0.50")
    axes[0].set(ylim=(0, 1), title="draft greedy acceptance, k = 4, held-out code")
    axes[0].legend()
    groups = [("longest_runs", "24 held-out code prompts x 64"),
              ("readme_longest_runs", "README's prompts x 48")]
    for i, w in enumerate(which):
        axes[1].bar(np.arange(2) + (i - 0.5) * 0.38, [max(report[w][key]) for key, _ in groups],
                    0.38, label=f"{w} pair")
    axes[1].set_xticks(np.arange(2), [label for _, label in groups])
    axes[1].set(title="longest run of one token, greedy")
    axes[1].legend()
    sets = list(report["old"]["held_out_loss_nats"])
    xs = np.arange(len(sets))
    for i, w in enumerate(which):
        axes[2].bar(xs + (i - 0.5) * 0.38, [report[w]["held_out_loss_nats"][s] for s in sets],
                    0.38, label=f"{w} pair")
    axes[2].set_xticks(xs, sets)
    axes[2].set(title="target held-out loss (nats)")
    axes[2].legend()
    fig.suptitle("Demo pair repaired: unlikelihood for the target, the draft distilled on its "
                 "text (training/derepeat_demo.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-steps", type=int, default=400)
    ap.add_argument("--draft-steps", type=int, default=600)
    ap.add_argument("--unlikelihood", type=float, default=0.5)
    ap.add_argument("--sequence-unlikelihood", type=float, default=1.0)
    ap.add_argument("--draft-alpha", type=float, default=0.2)
    ap.add_argument("--generated", type=int, default=512, help="target continuations for the draft")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mix", type=float, nargs=3, default=(0.5, 0.2, 0.3))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=32,
                    help="code tokens before each of the target's continuations for the draft")
    ap.add_argument("--old", type=Path, default=DEMO, help="the pair reported as old")
    ap.add_argument("--resume", action="store_true",
                    help="this run continues the one in results/demo_derepeat.json (its "
                         "commands and times are kept in the report)")
    ap.add_argument("--dry", action="store_true", help="measure the current pair only")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(DEMO / "target")
    code, chat, edits, held = corpora(tok, args.seed)
    prompts = held_out_prompts(24, 0)
    old = report_of(*(Qwen2ForCausalLM.from_pretrained(args.old / name, dtype=torch.float32)
                      .eval() for name in ("target", "draft")), tok, held, prompts, args.seq)
    target = Qwen2ForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()
    draft = Qwen2ForCausalLM.from_pretrained(DEMO / "draft", dtype=torch.float32).eval()
    print("old", json.dumps(old), flush=True)
    if args.dry:
        return
    chat_s, edits_s = stream(chat, tok), stream(edits, tok)
    mix = Mixture(code, chat_s, edits_s, args.mix, args.seq, args.seed)
    target_s = 0.0 if not args.target_steps else train_target(
        target, mix, code, args.target_steps, 5e-4, args.unlikelihood,
        args.sequence_unlikelihood, args.batch, args.seed)
    generated = target_text(target, code, args.generated, args.seed + 2, args.prompt_len)
    mix = Mixture(code, chat_s, edits_s, args.mix, args.seq, args.seed + 1)
    draft_s = train_draft(draft, target, mix, generated, args.draft_steps, 2e-3,
                          args.draft_alpha, args.batch, args.seed + 1)
    new = report_of(target, draft, tok, held, prompts, args.seq)
    print("new", json.dumps(new), flush=True)
    for name, model in (("target", target), ("draft", draft)):
        save_weights(model, DEMO / name)
    settings = {k: v for k, v in vars(args).items() if k not in ("dry", "resume", "old")}
    line = command("training.derepeat_demo", {**settings, "resume": args.resume})
    out = ROOT / "results" / "demo_derepeat.json"
    before = json.loads(out.read_text()) if args.resume else {"passes": []}
    passes = before["passes"] + [{"command": line, "settings": settings,
                                  "seconds": {"total": round(time.time() - t0),
                                              "target": round(target_s),
                                              "draft": round(draft_s)}}]
    report = {"passes": passes, "old": old, "new": new,
              "machine": {**machine(), "torch": torch.__version__}}
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))


if __name__ == "__main__":
    main()

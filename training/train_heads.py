"""Train the demo target's MTP layer and an EAGLE-3 head from the target's own outputs, and ship
them: the MTP layer beside the target's weights (tinydraft_mlx/demo/target/mtp.safetensors,
under Qwen3-Next / Qwen3.5's `mtp.*` names), so that `load_models(draft="mtp")` works offline on
the demo target; the EAGLE-3 head in the speculators format (tinydraft_mlx/demo/eagle3/).

    python -m training.train_heads                          # both, ~25 min on 2 CPU cores
    python -m training.train_heads --head mtp               # one of them
    python -m training.train_heads --head mtp --resume      # more training of the shipped one
    python -m training.train_heads --head none --generated 0   # the draft model's figures only

The layer is what Qwen3-Next's MTP is: fc([norm(embed(x_{t+1})), norm(h_t)]) -> one Qwen2
decoder layer (the target's kind) -> norm -> the target's tied head, predicting x_{t+2}. It is
trained by distillation: the target's final states h_t (frozen) go in, and the loss is
KL(p_target(. | x_<=t+1) || q_head), the target's own next-token distribution at the position
the head predicts (what acceptance rewards), at T = 1. The text: windows of the demo's training
text (the standard library's code, training/train_demo.py's split) and, --own-share of every batch,
the target's own greedy continuations of training windows (--generated; the text greedy
speculative decoding verifies, the recipe that lifted the draft model's acceptance,
training/derepeat_demo.py).
Reported (results/train_heads.json, each head's passes listed): the held-out KL and top-1
agreement with the target, teacher-forced, on held-out stdlib windows and along the target's
greedy text after bench/demo_quality.py's held-out prompts, before and after; the demo's draft
model measured the same way (at t, its argmax for the token a head at t predicts), the
reference.
The EAGLE-3 head (speculators' layout: fc over the states entering target layers 1, 3 and 5,
one Llama layer reading [norm(embed), norm(state)], norm, lm_head over the 2,048 tokens the demo
pair's token counts rank first, d2t / t2d) is tests/eagle_reference.py's torch module, the one
the tests check the engine's EAGLE-3 head against, trained the same way (KL to the target's
distribution restricted to its vocabulary). The MTP layer is trained one step ahead,
teacher-forced; the EAGLE-3 head over UNROLL chained steps, each reading its own previous output
as a chain does (its next steps read nothing else of the target: trained one step ahead only,
its second position accepted 0.08 of the time on the demo, bench/drafters.py).
Nothing here is imported by the library.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, Qwen2ForCausalLM

from bench.common import command, machine, save
from bench.demo_quality import held_out_prompts
from training.derepeat_demo import greedy_rows, target_text
from training.train_demo import ROOT, corpus_files, encode, lr_at

TARGET = ROOT / "tinydraft_mlx" / "demo" / "target"
DRAFT = ROOT / "tinydraft_mlx" / "demo" / "draft"
EAGLE_DIR = ROOT / "tinydraft_mlx" / "demo" / "eagle3"
EAGLE_LAYERS = [1, 3, 5]  # the target layers whose input the EAGLE-3 head reads (of 6)
EAGLE_VOCAB = 2048
UNROLL = 3  # EAGLE-3's chained steps trained together ("training-time test")
GREEDY_NEW = 64  # greedy tokens after each held-out prompt (greedy_agreement)


class MtpLayer(torch.nn.Module):
    """The MTP layer in torch, over a frozen target (its embeddings and head shared)."""

    def __init__(self, target: Qwen2ForCausalLM) -> None:
        super().__init__()
        config = target.config.__class__.from_dict(target.config.to_dict())
        config.num_hidden_layers = 1
        config.layer_types = ["full_attention"]
        size = config.hidden_size
        self.one = Qwen2ForCausalLM(config).model  # one decoder layer + its final norm
        del self.one.embed_tokens
        self.fc = torch.nn.Linear(2 * size, size, bias=False)
        self.norm_e = torch.nn.RMSNorm(size, eps=config.rms_norm_eps)
        self.norm_h = torch.nn.RMSNorm(size, eps=config.rms_norm_eps)
        with torch.no_grad():  # start as "the next token's embedding, through the layer"
            self.fc.weight.copy_(torch.cat([torch.eye(size), torch.zeros(size, size)], 1))
            self.one.layers[0].load_state_dict(target.model.layers[-1].state_dict())
            self.one.norm.weight.copy_(target.model.norm.weight)
        self.target = [target]  # not a submodule: frozen, not saved

    def forward(self, tokens: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """(B, L) next tokens, (B, L, D) target states -> (B, L, V) logits."""
        target = self.target[0]
        e = self.norm_e(target.model.embed_tokens(tokens))
        x = self.fc(torch.cat([e, self.norm_h(states)], dim=-1))
        out = self.one(inputs_embeds=x).last_hidden_state
        return target.lm_head(out)

    def weights(self) -> dict[str, torch.nn.Parameter]:
        """Its parameters (live) under the hub's `mtp.*` names."""
        out = {"mtp.fc.weight": self.fc.weight, "mtp.pre_fc_norm_embedding.weight":
               self.norm_e.weight, "mtp.pre_fc_norm_hidden.weight": self.norm_h.weight,
               "mtp.norm.weight": self.one.norm.weight}
        for name, value in self.one.layers[0].named_parameters():
            out[f"mtp.layers.0.{name}"] = value
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """The layer under the hub's `mtp.*` names, float16 (the target's dtype)."""
        return {k: v.detach().to(torch.float16).contiguous() for k, v in self.weights().items()}


@torch.no_grad()
def teacher(target, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final states over x and its log-probabilities at every position."""
    states = target.model(x).last_hidden_state
    return states, F.log_softmax(target.lm_head(states), dim=-1)


def loss_of(head, target, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(target || head) where the head at t reads h_t and x_{t+1} and the target's
    distribution at t + 1 is the label; and the top-1 agreement, (B, L - 1) booleans (at t:
    the head's and the target's argmax for x_{t+2} equal)."""
    states, logp = teacher(target, x)
    logits = head(x[:, 1:], states[:, :-1])
    labels = logp[:, 1:]
    logq = F.log_softmax(logits, dim=-1)
    kl = F.kl_div(logq.flatten(0, 1), labels.flatten(0, 1), log_target=True,
                  reduction="batchmean")
    return kl, logits.argmax(-1) == labels.argmax(-1)


class Eagle3:
    """The EAGLE-3 head being trained: tests/eagle_reference.py's module over the target."""

    def __init__(self, target: Qwen2ForCausalLM) -> None:
        import json

        from tests.eagle_reference import Eagle3Reference

        c = target.config
        self.config = {
            "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": {
                "model_type": "llama", "hidden_size": c.hidden_size, "num_hidden_layers": 1,
                "intermediate_size": c.intermediate_size,
                "num_attention_heads": c.num_attention_heads,
                "num_key_value_heads": c.num_key_value_heads, "rms_norm_eps": c.rms_norm_eps,
                "rope_theta": 10000.0, "vocab_size": c.vocab_size},
            "draft_vocab_size": EAGLE_VOCAB, "norm_before_residual": False,
            "target_hidden_size": c.hidden_size, "eagle_aux_hidden_state_layer_ids": EAGLE_LAYERS,
        }
        counts = json.loads((ROOT / "tinydraft_mlx" / "demo" / "token_counts.json").read_text())
        ranked = sorted(range(c.vocab_size), key=lambda i: -counts["counts"][i])
        self.kept = sorted(ranked[:EAGLE_VOCAB])
        self.module = Eagle3Reference(self.config, target.model.embed_tokens.weight, self.kept)
        with torch.no_grad():  # its head starts as the target's rows for its tokens
            self.module.lm_head.weight.copy_(target.model.embed_tokens.weight[self.kept])

    def parameters(self):
        return self.module.parameters()

    def loss(self, target, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KL summed over UNROLL chained steps (weights 1, 0.7, 0.49), each step read as a chain
        runs it (tests/eagle_reference.py `steps`); the first step's top-1 agreement, as
        loss_of's."""
        with torch.no_grad():
            out = target(x, output_hidden_states=True)
            states = torch.cat([out.hidden_states[i] for i in EAGLE_LAYERS], dim=-1)
            labels = F.log_softmax(out.logits[:, 1:, self.kept], dim=-1)
        total = 0.0
        for s, ((logits, _), _) in enumerate(self.module.steps(x[:, 1:], states[:, :-1],
                                                               UNROLL)):
            logq = F.log_softmax(logits[:, s:, self.kept], dim=-1)
            total = total + 0.7 ** s * F.kl_div(logq.flatten(0, 1), labels[:, s:].flatten(0, 1),
                                                log_target=True, reduction="batchmean")
            if s == 0:
                full = out.logits[:, 1:].argmax(-1)  # agreement with the target's own top-1
                agree = logits.argmax(-1) == full
        return total, agree

    def load(self) -> None:
        """Start from the shipped head (EAGLE_DIR)."""
        load_into(self.module.weights(), EAGLE_DIR / "model.safetensors")

    def save(self) -> dict[str, torch.Tensor]:
        import json

        from safetensors.torch import save_file

        EAGLE_DIR.mkdir(parents=True, exist_ok=True)
        (EAGLE_DIR / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        tensors = {k: v.to(torch.float16) if v.is_floating_point() else v
                   for k, v in self.module.tensors().items()}
        save_file(tensors, str(EAGLE_DIR / "model.safetensors"), metadata={"format": "pt"})
        return tensors


class Mtp:
    """The MTP layer being trained."""

    def __init__(self, target: Qwen2ForCausalLM) -> None:
        self.module = MtpLayer(target)

    def parameters(self):
        return self.module.parameters()

    def loss(self, target, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_of(self.module, target, x)

    def load(self) -> None:
        """Start from the shipped layer (the target's mtp.safetensors)."""
        load_into(self.module.weights(), TARGET / "mtp.safetensors")

    def save(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import save_file

        tensors = self.module.tensors()
        save_file(tensors, str(TARGET / "mtp.safetensors"), metadata={"format": "pt"})
        return tensors


def load_into(weights: dict[str, torch.nn.Parameter], path) -> None:
    """Copy a saved head's tensors into its live parameters (every one must be there)."""
    from safetensors.torch import load_file

    saved = load_file(str(path))
    missing = sorted(set(weights) - set(saved))
    if missing:
        raise SystemExit(f"{path} lacks {missing[:3]}: train from scratch (without --resume)")
    with torch.no_grad():
        for name, param in weights.items():
            param.copy_(saved[name].float())


@torch.no_grad()
def held_out(head, target, data: np.ndarray, seq: int, windows: int = 48) -> dict:
    """KL and top-1 agreement over held-out stdlib windows (teacher-forced)."""
    starts = np.linspace(0, len(data) - seq - 2, windows).astype(int)
    x = torch.from_numpy(np.stack([data[s : s + seq] for s in starts])).long()
    kls, agrees = [], []
    for chunk in x.split(16):
        kl, agree = head.loss(target, chunk)
        kls.append(kl.item())
        agrees.append(agree.float().mean().item())
    return {"kl": float(np.mean(kls)), "top1_agreement": float(np.mean(agrees))}


@torch.no_grad()
def greedy_agreement(head, target, rows) -> float:
    """Top-1 agreement along the target's own greedy text: at every generated position, the
    head reading the target's state before it and the token after predicts the token after
    that as the target does (a first draft position's greedy acceptance)."""
    hits = total = 0
    for ids, prompt_len in rows:
        _, agree = head.loss(target, ids)
        tail = agree[0, prompt_len - 1 :]  # from the first head proposal after the prefill
        hits += int(tail.sum())
        total += tail.numel()
    return hits / total


class DraftModel:
    """The demo's draft model, measured as a head would be (not trained here): at t its argmax
    after x_<=t+1 against the target's, for the token a head at t predicts."""

    def __init__(self) -> None:
        self.model = Qwen2ForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()

    @torch.no_grad()
    def loss(self, target, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ours, theirs = self.model(x).logits[:, 1:], target(x).logits[:, 1:]
        kl = F.kl_div(F.log_softmax(ours, -1).flatten(0, 1),
                      F.log_softmax(theirs, -1).flatten(0, 1), log_target=True,
                      reduction="batchmean")
        return kl, ours.argmax(-1) == theirs.argmax(-1)


def windows_of(generated: torch.Tensor, seq: int, rng, count: int) -> torch.Tensor:
    """`count` rows of the target's greedy text, each its last `seq` tokens."""
    return generated[rng.integers(0, len(generated), size=count), -seq:]


def train_head(head, target, data, held, generated, rows, args) -> dict:
    """Train one head (a batch: stdlib windows, and --own-share of it the target's greedy text
    where `generated` has rows); its figures."""
    before = held_out(head, target, held, args.seq)
    before["greedy_agreement"] = greedy_agreement(head, target, rows)
    print("held-out before", before, flush=True)
    params = [q for q in head.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    start = time.time()
    own = round(args.batch * args.own_share) if len(generated) else 0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=50)
        starts = rng.integers(0, len(data) - args.seq - 1, size=args.batch - own)
        x = torch.from_numpy(np.stack([data[s : s + args.seq] for s in starts])).long()
        if own:
            x = torch.cat([x, windows_of(generated, args.seq, rng, own)])
        loss, agree = head.loss(target, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}/{args.steps} kl {loss.item():.3f} top-1 "
                  f"{agree.float().mean().item():.3f} ({time.time() - start:.0f} s)", flush=True)
    seconds = time.time() - start
    after = held_out(head, target, held, args.seq)
    after["greedy_agreement"] = greedy_agreement(head, target, rows)
    print("held-out after", after, flush=True)
    tensors = head.save()
    return {"parameters": int(sum(v.numel() for k, v in tensors.items()
                                  if v.is_floating_point())),
            "train_seconds": round(seconds, 1), "held_out_before": before,
            "held_out_after": after, "tokens_seen": args.steps * args.batch * args.seq}


def first_pass(entry: dict) -> dict:
    """A report entry written before passes were listed, as its one pass."""
    settings = {k: v for k, v in entry["settings"].items() if k != "head"}
    settings.setdefault("generated", 0)  # written before the greedy text was an option
    line = command("training.train_heads", {**settings, "head": entry["settings"]["head"]})
    return {"command": line,
            "steps": settings["steps"], "train_seconds": entry["train_seconds"],
            "held_out_before": entry["held_out_before"], "held_out_after": entry["held_out_after"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head", choices=["mtp", "eagle3", "both", "none"], default="both",
                   help="none: measure the draft model only (the heads' reference)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--generated", type=int, default=1024,
                   help="the target's greedy continuations (96 tokens) of as many training "
                        "windows (0: stdlib windows only)")
    p.add_argument("--own-share", type=float, default=0.5,
                   help="the share of every batch from the target's greedy text")
    p.add_argument("--prompt-len", type=int, default=128,
                   help="code tokens before each greedy continuation")
    p.add_argument("--resume", action="store_true",
                   help="start from the shipped head instead of its initialisation")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(TARGET)
    target = Qwen2ForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    for param in target.parameters():
        param.requires_grad_(False)
    train_files, held_files = corpus_files()
    data, held = encode(tok, train_files), encode(tok, held_files)
    t0 = time.time()
    generated = (target_text(target, data, args.generated, args.seed + 2, args.prompt_len)
                 if args.generated else torch.zeros(0, args.seq, dtype=torch.long))
    rows = greedy_rows(target, tok, held_out_prompts(24, 0), GREEDY_NEW)
    print(f"greedy text: {len(generated)} training rows, {len(rows)} held-out rows "
          f"({time.time() - t0:.0f} s)", flush=True)
    out = ROOT / "results" / "train_heads.json"
    report = json.loads(out.read_text()) if out.is_file() else {}
    report.update({"machine": machine(), "torch": torch.__version__,
                   "objective": "KL(target || head) at T = 1, one step ahead (EAGLE-3: over "
                                f"{UNROLL} chained steps), teacher-forced; a batch is stdlib "
                                "code windows (training/train_demo.py's split) and, with "
                                "--generated, --own-share of it rows of the target's greedy "
                                "continuations of training windows",
                   "greedy_agreement": "top-1 agreement at the generated positions of the "
                                       f"target's {GREEDY_NEW} greedy tokens after each of "
                                       "bench/demo_quality.py's 24 held-out code prompts"})
    draft = DraftModel()
    report["draft_model"] = {**held_out(draft, target, held, args.seq),
                             "greedy_agreement": greedy_agreement(draft, target, rows)}
    print("draft model", report["draft_model"], flush=True)
    heads = {"mtp": Mtp, "eagle3": Eagle3}
    for name in {"both": ["mtp", "eagle3"], "none": []}.get(args.head, [args.head]):
        head = heads[name](target)
        if args.resume:
            head.load()
        line = command("training.train_heads", {
            **{k: v for k, v in vars(args).items() if k not in ("head", "resume")},
            "head": name, "resume": args.resume})
        passes = list(report[name].get("passes") or [first_pass(report[name])]
                      if args.resume and name in report else [])
        result = train_head(head, target, data, held, generated, rows, args)
        passes.append({"command": line, "steps": args.steps,
                       "train_seconds": result["train_seconds"],
                       "held_out_before": result["held_out_before"],
                       "held_out_after": result["held_out_after"]})
        if args.resume and name in report:  # "before" stays the first pass's
            result["held_out_before"] = report[name]["held_out_before"]
        report[name] = {"settings": vars(args), **result, "passes": passes}
    save(report, "train_heads", plot)


def plot(report: dict, path) -> None:
    from bench.common import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    names, values, colors = [], [], []
    for head in ("mtp", "eagle3"):
        if head not in report:
            continue
        entry = report[head]
        last = (entry.get("passes") or [entry])[-1]["held_out_before"]
        bars = [("stdlib\ninit", entry["held_out_before"].get("top1_agreement"), "#bbbbbb"),
                ("stdlib\nafter", entry["held_out_after"].get("top1_agreement"), "#4c72b0"),
                ("greedy\nbefore", last.get("greedy_agreement"), "#dddddd"),
                ("greedy\nafter", entry["held_out_after"].get("greedy_agreement"), "#dd8452")]
        for label, value, color in bars:
            if value is not None:
                names.append(f"{head}\n{label}")
                values.append(value)
                colors.append(color)
    ax.bar(range(len(names)), values, color=colors)
    ax.set_xticks(range(len(names)), names, fontsize=7)
    for i, v in enumerate(values):
        ax.text(i, v + 0.01, f"{v:.2f}", ha="center", fontsize=8)
    if "draft_model" in report:
        ax.axhline(report["draft_model"]["greedy_agreement"], color="#dd8452", ls="--", lw=1,
                   label="0.9M draft model, greedy text")
        ax.legend(loc="lower right", fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("top-1 agreement with the target")
    ax.set_title("Demo target's heads, held-out (teacher-forced, one step ahead):\n"
                 "stdlib code, and the target's own greedy text (before / after the last pass)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

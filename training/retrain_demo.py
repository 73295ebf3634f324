"""Retrain the bundled demo pair to behave more like a real one: from its current weights, on the
standard library's code as before plus chat-formatted exchanges about Python (ChatML, the demo
tokenizer's template) and editing exchanges whose answer copies a file back with a change (so the
target learns to copy from its context, as real models do when they edit, and prompt lookup can
show its value offline). The draft is then distilled again toward the new target.

    python -m training.retrain_demo          # ~30 min on 2 CPU cores; writes tinydraft_mlx/demo/
                                          # and results/demo_retrain.{json,png}

Every exchange is built from the same stdlib files as the code corpus, with `ast`: "write a
function that <its docstring's first line>" -> the function; "what does <name> do?" -> its
docstring; "rename / change ... in this code" -> the code with the change. Held-out files (the
same ~5% as training/train_demo.py) give the held-out sets. Old pair vs new, reported: held-out loss
on code, chat and edits; the draft's acceptance against the target (teacher-forced on held-out
text: the expected acceptance sum(min(p, q)) at T = 1 and greedy top-1 agreement); and copy
accuracy, the share of an edited file's tokens the target predicts top-1 when answering an
editing prompt (teacher-forced, so one early miss does not hide the rest). Nothing here is
imported by the library.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import platform
import random
import re
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, Qwen2ForCausalLM

from bench.common import command
from training.train_demo import ROOT, corpus_files, encode, read, save, train

DEMO = ROOT / "tinydraft_mlx" / "demo"
MAX_SNIPPET = 110  # tokens: an editing exchange holds its snippet twice within one window


def _functions(path: Path) -> list[tuple[str, str, str]]:
    """(name, source, docstring) of the module's functions and methods with a docstring."""
    text = read(path)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            source = ast.get_source_segment(text, node)
            if doc and source and not node.name.startswith("__"):
                out.append((node.name, _dedent(source, node.col_offset), doc.strip()))
    return out


def _dedent(source: str, col: int) -> str:
    lines = source.splitlines()
    return "\n".join([lines[0]] + [line[col:] if line[:col].strip() == "" else line
                                   for line in lines[1:]])


def _edit(name: str, source: str, rng: random.Random) -> tuple[str, str] | None:
    """(instruction, changed source) for one small change, or None when none applies."""
    idents = sorted(set(re.findall(r"\b[a-z_][a-z0-9_]{2,}\b", source)) - {"self", "return",
                                                                           "def", "None", "for",
                                                                           "not", "and", "import"})
    choice = rng.random()
    if choice < 0.5 and idents:
        old = rng.choice(idents)
        new = rng.choice(["value", "item", "result", "data", "count", "node", "text"]) + "_"
        changed = re.sub(rf"\b{old}\b", new, source)
        return f"Rename `{old}` to `{new}` in this code", changed
    if choice < 0.75:
        changed = re.sub(r"^def \w+", f"def {name}_v2", source, count=1)
        return f"Rename the function `{name}` to `{name}_v2`", changed
    lines = source.splitlines()
    if len(lines) < 3:
        return None
    body = next((i for i, line in enumerate(lines) if i > 0 and line.strip()
                 and not line.strip().startswith(('"', "'"))), None)
    if body is None:
        return None
    indent = lines[body][: len(lines[body]) - len(lines[body].lstrip())]
    changed = "\n".join(lines[:body] + [f"{indent}# checked by the caller"] + lines[body:])
    return "Add the comment `# checked by the caller` before the body", changed


def exchanges(files: list[Path], tok, seed: int) -> tuple[list[str], list[str]]:
    """(chat texts, editing texts), each rendered with the demo tokenizer's chat template."""
    rng = random.Random(seed)
    chat, edits = [], []
    for path in files:
        for name, source, doc in _functions(path):
            if len(tok.encode(source)) > MAX_SNIPPET:
                continue
            first = doc.split("\n\n")[0].replace("\n", " ")
            if rng.random() < 0.5:
                messages = [{"role": "user", "content": f"Write a Python function `{name}`: "
                                                        f"{first}"},
                            {"role": "assistant", "content": f"```python\n{source}\n```"}]
            else:
                messages = [{"role": "user", "content": f"What does `{name}` in "
                                                        f"{path.stem}.py do?"},
                            {"role": "assistant", "content": doc.split("\n\n")[0]}]
            chat.append(tok.apply_chat_template(messages, tokenize=False))
            change = _edit(name, source, rng)
            if change is not None and change[1] != source:
                instruction, changed = change
                messages = [{"role": "user", "content": f"{instruction}:\n```python\n{source}\n"
                                                        "```"},
                            {"role": "assistant", "content": f"```python\n{changed}\n```"}]
                edits.append(tok.apply_chat_template(messages, tokenize=False))
    return chat, edits


def stream(texts: list[str], tok) -> tuple[np.ndarray, np.ndarray]:
    """All texts as one id stream, each followed by EOS, and the offset where each begins."""
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    ids, starts = [], []
    for text in texts:
        starts.append(len(ids))
        ids += tok.encode(text) + [eos]
    return np.array(ids, dtype=np.int32), np.array(starts)


def corpora(tok, seed: int) -> tuple[np.ndarray, list[str], list[str], dict]:
    """The training code stream, chat and editing texts, and the held-out sets (code, chat,
    edits: (ids, exchange starts or None)) of the demo's files."""
    train_files, held_files = corpus_files()
    code, held_code = encode(tok, train_files), encode(tok, held_files)
    chat, edits = exchanges(train_files, tok, seed)
    held_chat, held_edits = exchanges(held_files, tok, seed + 1)
    held = {"code": (held_code, None), "chat": stream(held_chat, tok),
            "edits": stream(held_edits, tok)}
    return code, chat, edits, held


class Mixture:
    """Batches of windows: code windows anywhere in the code stream; chat and editing windows
    from the start of an exchange (so each holds whole exchanges)."""

    def __init__(self, code, chat, edits, weights, seq, seed):
        self.parts = [(code, None), chat, edits]
        self.weights, self.seq = np.array(weights) / sum(weights), seq
        self.rng = np.random.default_rng(seed)

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for part in self.rng.choice(3, size=size, p=self.weights):
            data, starts = self.parts[part]
            if starts is None:
                s = int(self.rng.integers(0, len(data) - self.seq - 1))
            else:
                s = int(self.rng.choice(starts[starts < len(data) - self.seq - 1]))
            rows.append(data[s : s + self.seq + 1])
        x = torch.from_numpy(np.stack(rows)).long()
        return x[:, :-1], x[:, 1:]


def _windows(data, starts, seq, n):
    if starts is None:
        offsets = np.linspace(0, len(data) - seq - 2, n).astype(int)
    else:
        ok = starts[starts < len(data) - seq - 1]
        offsets = ok[np.linspace(0, len(ok) - 1, min(n, len(ok))).astype(int)]
    return torch.from_numpy(np.stack([data[s : s + seq + 1] for s in offsets])).long()


@torch.no_grad()
def measure(target, draft, held: dict, seq: int, tok) -> dict:
    """Held-out loss per set, the draft's acceptance against the target, and copy accuracy."""
    out = {"held_out_loss_nats": {}, "acceptance_t1": {}, "greedy_agreement": {}}
    for name, (data, starts) in held.items():
        x = _windows(data, starts, seq, 48)
        losses, accept, agree = [], [], []
        for chunk in x.split(16):
            t_logits = target(chunk[:, :-1]).logits
            d_logits = draft(chunk[:, :-1]).logits
            losses.append(F.cross_entropy(t_logits.flatten(0, 1), chunk[:, 1:].flatten()).item())
            p, q = F.softmax(t_logits, -1), F.softmax(d_logits, -1)
            accept.append(torch.minimum(p, q).sum(-1).mean().item())
            agree.append((t_logits.argmax(-1) == d_logits.argmax(-1)).float().mean().item())
        out["held_out_loss_nats"][name] = float(np.mean(losses))
        out["acceptance_t1"][name] = float(np.mean(accept))
        out["greedy_agreement"][name] = float(np.mean(agree))
    out["copy_accuracy"] = copy_accuracy(target, held["edits"][0], held["edits"][1], tok)
    return out


def copy_accuracy(model, data, starts, tok, n: int = 40) -> float:
    """Share of the answer's tokens predicted top-1 (teacher-forced) in held-out editing
    exchanges: the answer is the file again with one change, so this is mostly copying."""
    marker = tok.encode("<|im_start|>assistant\n")
    hits = total = 0
    for s, e in zip(starts[:n], list(starts[1:n + 1])):
        ids = list(data[s:e])
        at = next(i for i in range(len(ids)) if ids[i : i + len(marker)] == marker)
        answer = at + len(marker)
        logits = model(torch.tensor([ids[:-1]])).logits[0]
        predicted = logits.argmax(-1)[answer - 1 :]
        truth = torch.tensor(ids[answer:])
        hits += int((predicted == truth).sum())
        total += len(truth)
    return hits / total


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("held_out_loss_nats", "held-out loss (nats, lower is better)"),
               ("acceptance_t1", "draft acceptance sum(min(p, q)), T = 1"),
               ("greedy_agreement", "draft/target greedy agreement")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    sets = list(report["old"]["held_out_loss_nats"])
    for ax, (key, title) in zip(axes, metrics):
        xs = np.arange(len(sets))
        for i, which in enumerate(("old", "new")):
            ax.bar(xs + (i - 0.5) * 0.38, [report[which][key][s] for s in sets], 0.38,
                   label=f"{which} pair")
        ax.set_xticks(xs, sets)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    ax = axes[3]
    ax.bar([0, 1], [report["old"]["copy_accuracy"], report["new"]["copy_accuracy"]],
           color=["C0", "C1"])
    ax.set_xticks([0, 1], ["old pair", "new pair"])
    ax.set_ylim(0, 1)
    ax.set_title("copy accuracy on held-out edits (top-1)", fontsize=9)
    fig.suptitle("Demo pair retrained on code + chat + edits (training/retrain_demo.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-steps", type=int, default=300)
    ap.add_argument("--draft-steps", type=int, default=250)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mix", type=float, nargs=3, default=(0.5, 0.25, 0.25),
                    metavar=("CODE", "CHAT", "EDITS"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEMO)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(DEMO / "target")
    code, chat, edits, held = corpora(tok, args.seed)
    held_chat, held_edits = held["chat"][1], held["edits"][1]  # one start per exchange
    sets = {"code": (code, None), "chat": stream(chat, tok), "edits": stream(edits, tok)}
    print(f"code {len(code)} tokens, {len(chat)} chat and {len(edits)} editing exchanges "
          f"({len(held_chat)} / {len(held_edits)} held out), {time.time() - t0:.0f} s",
          flush=True)

    target = Qwen2ForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()
    draft = Qwen2ForCausalLM.from_pretrained(DEMO / "draft", dtype=torch.float32).eval()
    old = measure(target, draft, held, args.seq, tok)
    print("old", json.dumps(old), flush=True)
    mix = Mixture(sets["code"][0], sets["chat"], sets["edits"], args.mix, args.seq, args.seed)
    target_s = train(target, iter(lambda: mix.batch(args.batch), None), args.target_steps, 1e-3,
                     log="target", warmup=min(50, args.target_steps // 5))
    mix = Mixture(sets["code"][0], sets["chat"], sets["edits"], args.mix, args.seq,
                  args.seed + 1)
    draft_s = train(draft, iter(lambda: mix.batch(args.batch), None), args.draft_steps, 2e-3,
                    teacher=target, log="draft", warmup=min(50, args.draft_steps // 5))
    new = measure(target, draft, held, args.seq, tok)
    print("new", json.dumps(new), flush=True)
    for name, model in (("target", target), ("draft", draft)):
        save(model, tok, args.out / name)
        config_file = args.out / name / "config.json"  # mlx-lm's qwen2 reads the top-level key
        config = json.loads(config_file.read_text())
        config["rope_theta"] = config["rope_parameters"]["rope_theta"]
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    report = {
        "command": command("training.retrain_demo",
                           {k: v for k, v in vars(args).items() if k != "out"}),
        "from": "the demo pair of training/train_demo.py (results/demo_training.json)",
        "seconds": {"total": round(time.time() - t0), "target": round(target_s),
                    "draft": round(draft_s)},
        "corpus": {"code_tokens": int(len(code)), "chat_exchanges": len(chat),
                   "editing_exchanges": len(edits), "held_out_chat": len(held_chat),
                   "held_out_edits": len(held_edits),
                   "uniform_loss_nats": math.log(len(tok))},
        "old": old,
        "new": new,
        "machine": {"platform": platform.platform(), "processor": platform.machine(),
                    "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "device": "cpu", "dtype": "float32 (saved as float16)"},
    }
    (ROOT / "results" / "demo_retrain.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, ROOT / "results" / "demo_retrain.png")
    print(json.dumps({k: report[k] for k in ("seconds", "old", "new")}))


if __name__ == "__main__":
    main()

"""Train a DFlash block drafter (tinydraft_mlx.engine.drafters.dflash's module, MLX) on a target's
own outputs, and write it in the reference's checkpoint layout. Used by `train_dflash.py` (the
demo's drafter) and by the tests' fixtures (a tiny drafter for a tiny target).

The recipe is the paper's (arXiv 2602.06036): the target's states after the chosen layers
(spread over its depth) are the context; a block starts at an anchor position a with the
token x_a and block_size - 1 mask tokens; the loss is the KL divergence from the target's own
next-token distributions at positions a .. a + block_size - 2 (teacher-forced on the text) to
the drafter's at block positions 1 .. block_size - 1, at T = 1 (what acceptance rewards). Every
batch draws one anchor for all its windows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from tinydraft_mlx.engine import hidden
from tinydraft_mlx.engine.drafters.dflash import DFlashConfig, DFlashDraft

WARMUP = 100  # steps of a rising learning rate


def drafter_config(target: nn.Module, *, block_size: int, mask_token_id: int, layers: int,
                   target_layer_ids: list[int], version: int = 1, selector_top_k: int = 8,
                   selector_rank: int = 16) -> dict:
    """A config.json for a DFlash drafter of `layers` Qwen3 layers shaped as the target's."""
    args = hidden.text_model(target).args
    size, heads = args.hidden_size, args.num_attention_heads
    extra = {"block_size": block_size, "mask_token_id": mask_token_id,
             "target_layer_ids": target_layer_ids}
    if version == 2:
        extra.update(conv_kernel_size=3, conv_group_size=max(1, size // 8),
                     selector_rank=selector_rank, selector_top_k=selector_top_k)
    return {
        "architectures": ["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"],
        "model_type": "qwen3", "vocab_size": args.vocab_size, "hidden_size": size,
        "intermediate_size": 2 * size, "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(args, "num_key_value_heads", None) or heads,
        "head_dim": getattr(args, "head_dim", None) or size // heads,
        "rms_norm_eps": 1e-6, "rope_theta": float(getattr(args, "rope_theta", 10000.0)),
        "max_position_embeddings": 4096,
        "num_target_layers": len(hidden.text_model(target).layers),
        "tie_word_embeddings": False, "dflash_config": extra,
    }


def features(draft: DFlashDraft, target: nn.Module, x: mx.array) -> tuple[mx.array, mx.array]:
    """The target's logits over windows `x` and the states the drafter reads."""
    if not hidden.watch(target, draft.after):
        raise ValueError("the target's layers the drafter reads are not found")
    with hidden.capture() as seen:
        logits = target(x)
    return logits, draft.read(seen)[-1]


def block_loss(draft: DFlashDraft, logits: mx.array, states: mx.array, x: mx.array,
               anchor: int, decay: float | None = None) -> mx.array:
    """KL(target || drafter) over a block at `anchor` of every window (see the docstring),
    block position i weighted exp(-(i - 1) / decay) where `decay` is given (the paper's
    emphasis on the early positions, which every accepted run passes through), else alike."""
    size = draft.block_size
    masks = mx.full((x.shape[0], size - 1), draft.config.mask_token_id, dtype=x.dtype)
    block = mx.concatenate([x[:, anchor : anchor + 1], masks], axis=1)
    q, _ = draft(block, draft.make_cache(), context=states[:, :anchor])
    p = logits[:, anchor : anchor + size - 1]
    logp = p - mx.logsumexp(p, axis=-1, keepdims=True)
    logq = q - mx.logsumexp(q, axis=-1, keepdims=True)
    kl = (mx.exp(logp) * (logp - logq)).sum(-1)  # (B, size - 1)
    if decay is None:
        return kl.mean()
    weights = mx.exp(-mx.arange(size - 1, dtype=kl.dtype) / decay)
    return (kl * weights).sum(-1).mean() / weights.sum()


def rows_of(windows: np.ndarray) -> Callable[[np.random.Generator, int], np.ndarray]:
    """Draw training rows from a fixed (n, S) array of windows."""
    return lambda rng, n: windows[rng.integers(0, len(windows), n)]


def distil(draft: DFlashDraft, target: nn.Module,
           draw: Callable[[np.random.Generator, int], np.ndarray], *, steps: int,
           batch: int = 16, lr: float = 3e-4, seed: int = 0, decay: float | None = None,
           report: Callable[[int, float], None] | None = None) -> list[float]:
    """Adam on `block_loss` over batches `draw(rng, batch)` of (batch, S) token ids (a fresh
    draw per step: a fixed small set is learnt by heart), the learning rate warmed up over
    WARMUP steps then decayed on a cosine; the losses. `report(step, mean loss of the last
    100)` every 100 steps. (Through the target's LM head the drafter's logits are large: a rate
    of 1e-3 or more diverged on the demo target, the loss jumping to 12-26 in the first steps.)"""
    rng = np.random.default_rng(seed)
    size = draft.block_size
    warm = min(WARMUP, max(1, steps // 10))
    schedule = optim.join_schedules([optim.linear_schedule(lr / warm, lr, warm),
                                     optim.cosine_decay(lr, max(1, steps - warm), lr / 10)],
                                    [warm])
    opt = optim.Adam(learning_rate=schedule)
    step = nn.value_and_grad(draft, block_loss)
    losses = []
    for i in range(steps):
        x = mx.array(draw(rng, batch))
        length = x.shape[1]
        logits, states = features(draft, target, x)
        logits, states = mx.stop_gradient(logits), mx.stop_gradient(states)
        anchor = int(rng.integers(1, length - size + 1))
        loss, grads = step(draft, logits, states, x, anchor, decay)
        opt.update(draft, grads)
        mx.eval(draft.parameters(), opt.state, loss)
        losses.append(float(loss))
        if report is not None and (i + 1) % 100 == 0:
            report(i + 1, float(np.mean(losses[-100:])))
    return losses


def new_drafter(target: nn.Module, config: dict, seed: int = 0) -> DFlashDraft:
    """A drafter of `config` over `target`, freshly initialised (MLX's default inits; a DFlash2
    convolution's base kernel starts as the identity)."""
    mx.random.seed(seed)
    draft = DFlashDraft(target, DFlashConfig.parse(config, "a new drafter"))
    for layer in draft.layers:
        for name in ("attention_conv", "mlp_conv"):
            if name in layer:
                kernel = mx.zeros(layer[name].base_kernel.shape)
                layer[name].base_kernel = kernel.at[:, 0].add(1.0)
    return draft


def save(draft: DFlashDraft, config: dict, out: Path, dtype: mx.Dtype | None = None) -> Path:
    """The drafter's config.json and model.safetensors (DFlash2's codebooks under the hub's
    names, without ".weight"; its floating-point tensors cast to `dtype` where given) in
    `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {k: v.astype(dtype) if dtype is not None else v
               for k, v in tree_flatten(draft.parameters())}
    for name in ("predecessor_codebook", "successor_codebook"):
        key = f"candidate_selector.{name}"
        if key + ".weight" in weights:
            weights[key] = weights.pop(key + ".weight")
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    return out

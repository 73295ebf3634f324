"""An EAGLE-3 head in the speculators format as a drafter.

A speculators EAGLE-3 directory holds a config.json (`"speculators_model_type": "eagle3"`, the
head's `transformer_layer_config` (a Llama decoder layer's), `draft_vocab_size`,
`norm_before_residual`, `target_hidden_size`, optionally the target layers it reads) and its
tensors: `fc` (3 target states -> one), `layers.0.*` (one decoder layer whose attention reads the
normed token embedding and the normed state side by side: q/k/v take 2 x hidden inputs),
`norm`, `lm_head` over its own small vocabulary, `d2t` (draft id -> target id offset) and `t2d`,
and optionally `embed_tokens` (else the target's are used).

For a position t the head reads the target's residual stream entering three layers (low, mid,
high: by default layers 2, L // 2 and L - 3 of L, as vLLM and speculators pick them; the output
of the layer before each, hidden.py's ("after", j)) and the embedding of x_{t+1}:

    g = fc([h_low, h_mid, h_high])       (a chain step feeds its own output instead)
    out = layer(embed(x_{t+1}), g)       (residual: g, or hidden_norm(g) with norm_before_residual)
    logits = lm_head(norm(out))          -> x_{t+2}, scattered into the target's vocabulary

A token outside the draft vocabulary gets -inf, so q = 0 there and rejection sampling stays
exact; proposals are target ids. Its cache and chain are the MTP layer's (chains.py's
HeadChain: entry i is (states at i, x_{i+1})). The attention, its RoPE and the MLP are mlx-lm's
Llama modules (q/k/v widened to the layer's 2 x hidden input), the norms mlx's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .. import hidden
from ..hidden import embeddings as target_embeddings
from .alike import quantize_alike
from .mtp import MtpError

EAGLE3 = "eagle3"


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer (see the module docstring)."""

    def __init__(self, args: llama.ModelArgs, norm_before_residual: bool) -> None:
        super().__init__()
        size, eps = args.hidden_size, args.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = nn.RMSNorm(size, eps=eps)
        self.hidden_norm = nn.RMSNorm(size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(size, eps=eps)
        self.self_attn = attention = llama.Attention(args)
        for name in ("q_proj", "k_proj", "v_proj"):  # they read [embedding, state]
            width = getattr(attention, name).weight.shape[0]
            setattr(attention, name, nn.Linear(2 * size, width, bias=args.attention_bias))
        self.mlp = llama.MLP(args)

    def __call__(self, embeds: mx.array, state: mx.array, mask: Any, cache: Any) -> mx.array:
        normed = self.hidden_norm(state)
        residual = normed if self.norm_before_residual else state
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        h = residual + self.self_attn(x, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(hidden.StateHead):
    """An EAGLE-3 head over its target (see the module docstring): `head(tokens, cache,
    hidden=states)` -> (logits over the target's vocabulary, the (B, L, D) states its next step
    reads); states are the (B, L, 3 D_target) fused target states, or its own output. `after`:
    the target layers whose outputs it reads."""

    kind = EAGLE3

    def __init__(self, target: nn.Module, args: llama.ModelArgs, draft_vocab: int,
                 target_hidden: int, after: tuple[int, ...], norm_before_residual: bool,
                 own_embeddings: bool, fc_bias: bool) -> None:
        super().__init__(target)
        size = args.hidden_size
        self.fc = nn.Linear(3 * target_hidden, size, bias=fc_bias)
        self.layers = [Eagle3Layer(args, norm_before_residual)]
        self.norm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(size, draft_vocab, bias=False)
        if own_embeddings:
            self.embed_tokens = nn.Embedding(args.vocab_size, size)
        self.d2t = mx.zeros((draft_vocab,), dtype=mx.int32)
        object.__setattr__(self, "after", after)
        object.__setattr__(self, "vocab", args.vocab_size)
        object.__setattr__(self, "fused", 3 * target_hidden)

    def __call__(self, tokens: mx.array, cache: list[Any] | None = None,
                 hidden: mx.array | None = None) -> tuple[mx.array, mx.array]:
        if hidden is None:
            raise ValueError("an EAGLE-3 head reads the target's hidden states (hidden=...)")
        embed = self.embed_tokens if "embed_tokens" in self else target_embeddings(self.target)
        state = self.fc(hidden) if hidden.shape[-1] == self.fused else hidden
        c = cache[0] if cache else None
        out = self.layers[0](embed(tokens), state, create_attention_mask(state, c), c)
        small = self.lm_head(self.norm(out))
        ids = mx.arange(small.shape[-1], dtype=mx.int32) + self.d2t
        full = mx.full((*small.shape[:-1], self.vocab), -mx.inf, dtype=small.dtype)
        full = mx.put_along_axis(full, mx.broadcast_to(ids, small.shape), small, axis=-1)
        return full, out

    def make_cache(self) -> list[Any]:
        """One KV cache: the layer's."""
        return [KVCache()]

    def read(self, seen: hidden.Seen) -> list[mx.array]:
        """Per forward of a capture, the three layers' states side by side, (..., L, 3 D)."""
        parts = [hidden.gathered(seen, ("after", j)) for j in self.after]
        return [mx.concatenate(states, axis=-1) for states in zip(*parts)]


def is_eagle3(path: str | Path) -> bool:
    """Whether `path` is a directory holding a speculators EAGLE-3 head."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("speculators_model_type") == EAGLE3
    except (OSError, ValueError):
        return False


def load_eagle3(target: nn.Module, path: str | Path) -> Eagle3Head:
    """The EAGLE-3 head in the speculators directory `path`, for `target` (its states made
    capturable), cast to the target's dtype, quantized as the target is where it is
    (alike.py). MtpError (one sentence) where it does not fit."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    layer = dict(config.get("transformer_layer_config") or {})
    layer.setdefault("model_type", "llama")
    layer.setdefault("num_hidden_layers", 1)
    args = llama.ModelArgs.from_dict(layer)
    text = hidden.text_model(target)
    depth = len(text.layers)
    ids = (config.get("eagle_aux_hidden_state_layer_ids")
           or (config.get("speculators_config") or {}).get("aux_hidden_state_layer_ids")
           or [2, depth // 2, depth - 3])
    if len(ids) != 3 or not all(1 <= i <= depth for i in ids):
        raise MtpError(f"{str(path)!r}: an EAGLE-3 head reads 3 target layers in 1..{depth} "
                       f"(got {ids})")
    width = getattr(text.args, "vocab_size", None)
    if width != args.vocab_size:
        raise MtpError(f"{str(path)!r} is an EAGLE-3 head for a vocabulary of {args.vocab_size} "
                       f"tokens; this target's has {width}")
    weights: dict[str, mx.array] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    weights = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
               for k, v in weights.items() if k != "t2d"}
    target_hidden = config.get("target_hidden_size") or text.args.hidden_size
    head = Eagle3Head(target, args, config.get("draft_vocab_size", args.vocab_size),
                      target_hidden, tuple(i - 1 for i in ids),
                      bool(config.get("norm_before_residual", False)),
                      "embed_tokens.weight" in weights, "fc.bias" in weights)
    if "d2t" in weights:
        weights["d2t"] = weights["d2t"].astype(mx.int32)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise MtpError(f"{str(path)!r}: the EAGLE-3 tensors do not fit its config: {err}") \
            from None
    norm = hidden.final_norm(target)
    dtype = norm.weight.dtype if norm is not None and "weight" in norm else mx.float32
    head.set_dtype(dtype)  # floating-point weights only: d2t stays int32
    quantize_alike(head, target)  # beside a quantized target (alike.py)
    mx.eval(head.parameters())
    if not hidden.watch(target, head.after):
        raise MtpError(f"{type(target).__name__}: the layers an EAGLE-3 head reads are not found")
    return head

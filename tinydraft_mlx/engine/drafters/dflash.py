"""DFlash and DFlash2 block drafters (z-lab, arXiv 2602.06036), from the reference's checkpoint
layout: one forward proposes a whole block.

A DFlash directory holds a config.json (`architectures` "DFlashDraftModel" or
"DFlash2DraftModel"; a Qwen3 decoder's shape; `dflash_config` with `block_size`,
`mask_token_id`, `target_layer_ids` and the optional `input_embedding_scale`,
`output_multiplier`, `final_logit_softcapping`, and for DFlash2 `conv_kernel_size`,
`conv_group_size`, `selector_rank`, `selector_top_k`) and its tensors: `fc` (the target layers'
states side by side -> one), `hidden_norm`, `layers.{i}.*` (Qwen3 decoder layers), `norm`; DFlash2
adds `layers.{i}.attention_conv` / `mlp_conv` (grouped dynamic causal convolutions over the
block) and `candidate_selector.*`. It has no embeddings and no LM head: the target's are used.

For a block starting at position t (the last token x_t, whose target state is not known yet):

    ctx = hidden_norm(fc([h_a, h_b, ...]))   the target's states after layers target_layer_ids,
                                             for every position before t
    x   = embed([x_t, m, m, ..., m])         m: mask_token_id, block_size positions
    each layer: its attention's queries are the block's, its keys/values the context's
    (k_proj / v_proj of ctx, the same ctx at every layer) followed by the block's own; no
    causal mask inside the block; RoPE at the positions t - |ctx| ... t + block_size - 1
    logits = output_multiplier * lm_head(norm(x))[1:]    -> x_{t+1} ... x_{t+block_size-1}

Every proposed position's distribution comes from that one forward (DFlash), or (DFlash2) a
candidate selector walks the block: at each position the top `selector_top_k` ids of its
logits, scored by their logit plus a bilinear term in the previous proposal's code, the
position's state and the candidate's code; the proposal is drawn from those scores.

The context's keys/values are cached (one entry per position whose target state has been read);
the block's are not kept. The attention, MLP, RoPE and norms are mlx-lm's / mlx's modules; the
attention is ours only in how keys and values are assembled (context, then block, per row).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from .. import hidden
from .alike import quantize, quantize_alike
from .mtp import MtpError

DFLASH = "dflash"
ARCHITECTURES = {"DFlashDraftModel": DFLASH, "DFlash2DraftModel": "dflash2"}


@dataclass(frozen=True)
class DFlashConfig:
    """What a DFlash drafter's config.json says (the entries the reference reads)."""

    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_positions: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    attention_bias: bool = False
    causal: bool = False
    input_scale: float = 1.0
    output_multiplier: float = 1.0
    softcap: float | None = None
    conv_kernel: int = 0
    conv_group: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    version: int = 1

    @classmethod
    def parse(cls, config: dict, where: str) -> DFlashConfig:
        """From a config.json's dict; MtpError (one sentence) for what we do not run."""
        extra = dict(config.get("dflash_config") or {})

        def value(name: str, default: Any = None) -> Any:
            return extra.get(name, config.get(name, default))

        kinds = set(config.get("layer_types") or ["full_attention"])
        if kinds != {"full_attention"}:
            raise MtpError(f"{where}: DFlash layers of kinds {sorted(kinds)}; tinydraft-mlx "
                           "runs full-attention DFlash layers only")
        layers = int(config["num_hidden_layers"])
        ids = value("target_layer_ids")
        if ids is None:
            ids = default_layer_ids(int(config["num_target_layers"]), layers)
        heads = int(config["num_attention_heads"])
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        theta = config.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))
        version = 2 if "DFlash2DraftModel" in (config.get("architectures") or []) else 1
        softcap = value("final_logit_softcapping")
        return cls(
            hidden_size=int(config["hidden_size"]), layers=layers, heads=heads,
            kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]), eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta), rope_scaling=rope,
            max_positions=int(config.get("max_position_embeddings", 32768)),
            block_size=int(value("block_size", 16)), mask_token_id=int(value("mask_token_id")),
            target_layer_ids=tuple(int(i) for i in ids),
            attention_bias=bool(config.get("attention_bias", False)),
            causal=bool(config.get("is_causal") or False),
            input_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            softcap=float(softcap) if softcap else None,
            conv_kernel=int(value("conv_kernel_size", 0) or 0),
            conv_group=int(value("conv_group_size", 0) or 0),
            selector_rank=int(value("selector_rank", 0) or 0),
            selector_top_k=int(value("selector_top_k", 0) or 0), version=version)


def default_layer_ids(target_layers: int, draft_layers: int) -> list[int]:
    """The target layers a DFlash drafter of `draft_layers` layers reads when its config names
    none (the reference's rule: spread over 1 .. target_layers - 3; the middle one for one)."""
    if draft_layers == 1:
        return [target_layers // 2]
    span = target_layers - 4
    return [round(1 + i * span / (draft_layers - 1)) for i in range(draft_layers)]


class BlockAttention(nn.Module):
    """A DFlash layer's attention: queries from the block, keys/values from the new context
    positions and the block (see the module docstring), written into the layer's cache."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.head_dim
        self.scale, self.causal = c.head_dim ** -0.5, c.causal
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, c.heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, c.kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, c.kv_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.eps)
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.eps)
        self.rope = initialize_rope(c.head_dim, c.rope_theta, False, c.rope_scaling,
                                    c.max_positions)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        return x.reshape(*x.shape[:2], n, -1)

    def keys_values(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(B, N, D) positions -> their (B, kv_heads, N, head_dim) keys (normed, before RoPE)
        and values."""
        k = self.k_norm(self._heads(self.k_proj(x), self.kv_heads)).transpose(0, 2, 1, 3)
        return k, self._heads(self.v_proj(x), self.kv_heads).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, ctx: mx.array, layout: _Layout, cache: Any) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self._heads(self.q_proj(x), self.heads)).transpose(0, 2, 1, 3)
        k, v = self.keys_values(mx.concatenate([ctx, x], axis=1))  # the context, then the block
        if layout.order is not None:  # rows with fewer context positions: [ctx_b, block, pad]
            k = mx.take_along_axis(k, layout.order, axis=2)
            v = mx.take_along_axis(v, layout.order, axis=2)
        q = self.rope(q, offset=layout.block_at)
        k = self.rope(k, offset=layout.start)
        keys, values = cache.update_and_fetch(k, v)
        mask = layout.mask(keys.shape[2], L, self.causal)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _Layout:
    """Where a forward's keys go, per row: `slots` (B,) the cache's write position, `shift`
    (B,) what turns a slot into a position, `counts` (B,) the new context positions of each row
    (the rest of the N padded ones are padding, after the block)."""

    def __init__(self, slots: Any, shift: Any, counts: mx.array | None, n: int, L: int) -> None:
        self.slots, self.counts = slots, counts
        self.start = slots + shift
        if counts is None:  # every row has all N
            self.order, self.ends = None, slots + n + L
            self.block_at = self.start + n
            return
        s = mx.arange(n + L)[None]
        c = counts[:, None]
        order = mx.where(s < c, s, mx.where(s < c + L, n + s - c, s - L))
        self.order = order[:, None, :, None]
        self.ends = slots + counts + L
        self.block_at = self.start + counts

    def mask(self, read: int, L: int, causal: bool) -> mx.array | None:
        """(B, 1, L, read): a block query sees the row's cached and new context and the block
        (up to itself when `causal`), not the padding."""
        ends = mx.array(self.ends) if not isinstance(self.ends, mx.array) else self.ends
        if self.counts is None and not causal and ends.ndim == 0:
            return None  # one row, everything written is seen
        ends = ends.reshape(-1, 1, 1, 1)
        slots = mx.arange(read)[None, None, None]
        visible = slots < ends
        if causal:
            queries = ends - L + mx.arange(L)[None, None, :, None]
            visible = visible & (slots <= queries)
        return visible


class GroupedDynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution over the block: each group of `group`
    channels is mixed with its previous `kernel` - 1 positions by a learned base kernel plus one
    predicted from the position's own state (`prepare` before a sub-layer, `finish` after)."""

    def __init__(self, size: int, kernel: int, group: int) -> None:
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = mx.zeros((2, kernel, size))
        self.kernel_projection = nn.Linear(size, 2 * kernel * (size // group), bias=False)

    def _convolve(self, x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
        B, L, D = x.shape
        groups = D // self.group
        blocks = x.reshape(B, L, groups, self.group)
        dynamic = dynamic.reshape(B, L, self.kernel, groups, 1)
        out = mx.zeros_like(blocks)
        for lag in range(self.kernel):
            shifted = blocks if lag == 0 else mx.pad(blocks[:, :-lag],
                                                     [(0, 0), (lag, 0), (0, 0), (0, 0)])
            weight = base[lag].reshape(1, 1, groups, self.group).astype(x.dtype)
            out = out + (weight + dynamic[:, :, lag]) * shifted
        return out.reshape(B, L, D)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        groups = x.shape[-1] // self.group
        dynamic = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel, groups)
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0]), \
            dynamic[..., 1, :, :]

    def finish(self, x: mx.array, dynamic: mx.array) -> mx.array:
        return self._convolve(x, dynamic, self.base_kernel[1])


class BlockLayer(nn.Module):
    """A DFlash decoder layer (DFlash2: with its convolutions around both sub-layers)."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = BlockAttention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.eps)
        if c.version == 2:
            self.attention_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel, c.conv_group)
            self.mlp_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel, c.conv_group)

    def _sub(self, name: str, x: mx.array, run: Any) -> mx.array:
        if name not in self:
            return run(x)
        conv = self[name]
        x, dynamic = conv.prepare(x)
        return conv.finish(run(x), dynamic)

    def __call__(self, x: mx.array, ctx: mx.array, layout: _Layout, cache: Any) -> mx.array:
        h = x + self._sub("attention_conv", self.input_layernorm(x),
                          lambda y: self.self_attn(y, ctx, layout, cache))
        return h + self._sub("mlp_conv", self.post_attention_layernorm(h), self.mlp)


class CandidateSelector(nn.Module):
    """DFlash2's candidate selector: per block position, the top `top_k` ids of its logits,
    scored by logit + <code(previous proposal) * proj(state), code(candidate)>."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.top_k = c.selector_top_k
        self.predecessor_codebook = nn.Embedding(c.vocab_size, c.selector_rank)
        self.successor_codebook = nn.Embedding(c.vocab_size, c.selector_rank)
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)

    def candidates(self, logits: mx.array) -> mx.array:
        """(..., top_k) ids: the block positions' candidates."""
        return mx.argpartition(logits, -self.top_k, axis=-1)[..., -self.top_k:]

    def scores(self, logits: mx.array, projected: mx.array, candidates: mx.array,
               previous: mx.array) -> mx.array:
        """(B, top_k) scores of one position's candidates after the `previous` (B,) ids;
        logits (B, V), projected (B, rank) its state's projection, candidates (B, top_k)."""
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        code = self.predecessor_codebook(previous) * projected
        return unary + (self.successor_codebook(candidates) * code[:, None]).sum(-1)


class DFlashDraft(nn.Module):
    """A DFlash (or DFlash2) drafter over its target (see the module docstring). Called as
    `draft(block, cache, context=states, counts=None, shift=None)` -> the block's proposals'
    (B, L - 1, V) logits and their (B, L - 1, D) states; `context` (B, N, D_fused) the target
    states of the positions its cache has not read, all N of them or `counts[b]` for row b
    (padding after), `shift` (B,) position - slot where the cache does not start at position 0.
    The cache advances by N + L; the caller rolls it back to what the context adds."""

    kind = DFLASH

    def __init__(self, target: nn.Module, config: DFlashConfig) -> None:
        super().__init__()
        c = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.eps)
        self.layers = [BlockLayer(c) for _ in range(c.layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.eps)
        if c.version == 2:
            self.candidate_selector = CandidateSelector(c)
        object.__setattr__(self, "target", target)  # shared, not a parameter
        object.__setattr__(self, "config", c)
        object.__setattr__(self, "after", c.target_layer_ids)
        object.__setattr__(self, "block_size", c.block_size)

    @property
    def context_width(self) -> int:
        """The width of the states it reads: the chosen target layers' side by side."""
        return len(self.after) * self.config.hidden_size

    @property
    def dtype(self) -> mx.Dtype:
        """Its floating-point dtype (the target's)."""
        return self.norm.weight.dtype

    @property
    def selects(self) -> bool:
        """Whether proposals are walked by a candidate selector (DFlash2)."""
        return "candidate_selector" in self

    def embed(self, tokens: mx.array) -> mx.array:
        """The target's raw token embeddings of `tokens`, times `input_embedding_scale`."""
        table = hidden.embeddings(self.target)
        out = table(tokens)
        return out * self.config.input_scale if self.config.input_scale != 1.0 else out

    def logits(self, states: mx.array) -> mx.array:
        """The target's LM head on the drafter's states, times `output_multiplier`, softcapped
        where the config says."""
        text = hidden.text_model(self.target)
        head = getattr(text, "lm_head", None)
        out = head(states) if head is not None else hidden.embeddings(self.target).as_linear(
            states)
        c = self.config
        if c.output_multiplier != 1.0:
            out = out * c.output_multiplier
        if c.softcap:
            out = mx.tanh(out / c.softcap) * c.softcap
        return out

    def __call__(self, block: mx.array, cache: list[Any], context: mx.array,
                 counts: mx.array | None = None,
                 shift: mx.array | int = 0) -> tuple[mx.array, mx.array]:
        B, L = block.shape
        x = self.embed(block)
        if context.shape[1]:
            ctx = self.hidden_norm(self.fc(context))
        else:  # no new context (a quantized matmul must not see an empty input)
            ctx = mx.zeros((B, 0, self.config.hidden_size), x.dtype)
        layout = _Layout(cache[0].offset, shift, counts, ctx.shape[1], L)
        for layer, c in zip(self.layers, cache):
            x = layer(x, ctx, layout, c)
        states = self.norm(x[:, 1:])
        return self.logits(states), states

    def absorb(self, context: mx.array, cache: list[Any], shift: int = 0) -> None:
        """Write the keys/values of (1, N, D_fused) context states into a one-sequence cache
        (a prefill: no block, no attention)."""
        ctx = self.hidden_norm(self.fc(context))
        start = cache[0].offset + shift
        for layer, c in zip(self.layers, cache):
            a = layer.self_attn
            k, v = a.keys_values(ctx)
            c.update_and_fetch(a.rope(k, offset=start), v)

    def make_cache(self) -> list[Any]:
        """One KV cache per layer: the context's keys and values."""
        return [KVCache() for _ in self.layers]

    def read(self, seen: hidden.Seen) -> list[mx.array]:
        """Per forward of a capture, the target layers' states side by side, (..., L, D')."""
        parts = [hidden.gathered(seen, ("after", j)) for j in self.after]
        return [mx.concatenate(states, axis=-1) for states in zip(*parts)]

    def target_states(self, ids: list[int]) -> mx.array:
        """What this drafter reads over `ids`, (1, len(ids), D'), from one uncached forward."""
        with hidden.capture() as seen:
            self.target(mx.array([ids]))
        return self.read(seen)[-1]

    def source(self) -> Any:
        """A fresh drafter for one sequence (the drafter protocol's `Source`)."""
        from .blocks import BlockDraft

        return BlockDraft(self)


def is_dflash(path: str | Path) -> bool:
    """Whether `path` is a directory holding a DFlash or DFlash2 drafter."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        arch = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any(a in ARCHITECTURES for a in arch)


def load_dflash(target: nn.Module, path: str | Path) -> DFlashDraft:
    """The DFlash drafter in directory `path` for `target` (its states made capturable), cast to
    the target's dtype; quantized as its checkpoint says (config "quantization"), or, where the
    target is quantized and the checkpoint is not, alike (the target's bits and group size:
    a drafter that costs as little beside it). MtpError (one sentence) where it does not fit."""
    path = Path(path)
    where = repr(str(path))
    raw = json.loads((path / "config.json").read_text())
    config = DFlashConfig.parse(raw, where)
    text = hidden.text_model(target)
    depth = len(getattr(text, "layers", None) or hidden.body(target).layers)
    if not all(0 <= i <= depth - 2 for i in config.target_layer_ids):
        raise MtpError(f"{where}: a DFlash drafter reads target layers in 0..{depth - 2} "
                       f"(got {list(config.target_layer_ids)})")
    table = hidden.embeddings(target)
    width = table.weight.shape[0]
    size = getattr(table, "dims", None) or table.weight.shape[1]
    if config.vocab_size != width:
        raise MtpError(f"{where} is a DFlash drafter for a vocabulary of {config.vocab_size} "
                       f"tokens; this target's has {width}")
    weights: dict[str, mx.array] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    for name in ("predecessor_codebook", "successor_codebook"):  # stored without ".weight"
        key = f"candidate_selector.{name}"
        if key in weights:
            weights[key + ".weight"] = weights.pop(key)
    draft = DFlashDraft(target, config)
    if size is not None and size != config.hidden_size:
        raise MtpError(f"{where}: a DFlash drafter of hidden size {config.hidden_size} reads "
                       f"this target's embeddings of size {size}")
    stored = raw.get("quantization") or raw.get("quantization_config")
    if stored:
        quantize(draft, int(stored["group_size"]), int(stored["bits"]),
                 stored.get("mode", "affine"), weights)
    try:
        draft.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise MtpError(f"{where}: the DFlash tensors do not fit its config: {err}") from None
    norm = hidden.final_norm(target)
    draft.set_dtype(norm.weight.dtype if norm is not None and "weight" in norm else mx.float32)
    if not stored:
        quantize_alike(draft, target)
    mx.eval(draft.parameters())
    if not hidden.watch(target, config.target_layer_ids):
        raise MtpError(f"{type(target).__name__}: the layers a DFlash drafter reads are not found")
    return draft

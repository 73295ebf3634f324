"""A target's own multi-token-prediction (MTP) layer as a drafter.

Checkpoints of Qwen3-Next and Qwen3.5 ship `mtp.*` tensors (DeepSeek-V3 and GLM-4.5 ship the
same pieces as one more decoder layer, `model.layers.{num_hidden_layers}.*`); mlx-lm's
converters and model classes drop them. The layer predicts the token after next: for a position
t it reads the target's final hidden state h_t (hidden.py: what the LM head reads) and the
embedding of the token x_{t+1} that followed, and runs

    x = fc([pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])
    out = norm(layer(x))            (one decoder layer with its own KV cache)
    logits = the target's LM head(out)      -> x_{t+2}

with the target's embeddings and LM head shared. Its cache entry i holds the pair (h_i,
x_{i+1}) at RoPE position i (as vLLM's and SGLang's MTP runners lay it out). A chain of k drafts
feeds each next step its own `out` in place of the target's state (which the verify has not
computed yet); those entries are rolled back after the verify and re-fed with the target's
states of the accepted positions (chains.py). Only the first MTP layer runs (a second layer's
cache would need states of its own depth for every position; the checkpoints we know ship one).

The decoder layer is the target's own class from mlx-lm (a full-attention layer of it, built for
the same config: Qwen3-Next's MoE, Qwen3.5's gated attention), the norms and the projection are
mlx's; nothing of a model file is copied. Qwen3-Next / Qwen3.5 store their RMSNorm weights
zero-centred (weight + 1 is the scale), which mlx-lm's `sanitize` shifts for the body: the head's
norms are shifted here the same way.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .. import hidden
from ..hidden import embeddings as target_embeddings
from .alike import quantize, quantize_alike

MTP = "mtp"
CONVERTED = "mtp.safetensors"  # where programs/convert.py writes the head beside a conversion
SHIFTED_NORMS = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe"})  # weight + 1 is the scale
_HEAD = "_tinydraft_mtp"  # the head attached to its target
_DEEPSEEK = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
             "shared_head.norm": "norm"}
_SHARED = ("embed_tokens", "shared_head.head")  # copies of the target's, not the head's


class MtpError(ValueError):
    """A checkpoint has no usable MTP layer; the message is one sentence for the user."""


class MtpHead(hidden.StateHead):
    """An MTP layer over its target (see the module docstring). Called as a draft model is, with
    the target's final states beside the ids: `head(tokens, cache, hidden=states)` -> (logits,
    out), tokens (B, L), states (B, L, D) (state i is the one before token i), out the (B, L, D)
    states a next step reads. The target's embeddings and head are shared, not its parameters."""

    kind = MTP

    def __init__(self, target: nn.Module, layer: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__(target)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.layers = [layer]
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, tokens: mx.array, cache: list[Any] | None = None,
                 hidden: mx.array | None = None) -> tuple[mx.array, mx.array]:
        if hidden is None:
            raise ValueError("an MTP head reads the target's hidden states (hidden=...)")
        e = self.pre_fc_norm_embedding(target_embeddings(self.target)(tokens))
        x = self.fc(mx.concatenate([e, self.pre_fc_norm_hidden(hidden)], axis=-1))
        c = cache[0] if cache else None
        x = self.layers[0](x, create_attention_mask(x, c), c)
        out = self.norm(x)
        return lm_head(self.target)(out), out

    def make_cache(self) -> list[Any]:
        """One KV cache: the layer's."""
        return [KVCache()]

    def read(self, seen: hidden.Seen) -> list[mx.array]:
        """The target's final states in a capture."""
        return hidden.gathered(seen, hidden.FINAL)


def lm_head(target: nn.Module) -> Any:
    """The target's LM head as a function of its final states (tied embeddings or lm_head)."""
    text = hidden.text_model(target)
    if getattr(getattr(text, "args", None), "tie_word_embeddings", False) \
            or not hasattr(text, "lm_head"):
        return target_embeddings(target).as_linear
    return text.lm_head


def model_type(target: nn.Module) -> str | None:
    """The target's text model type, as mlx-lm names its module ("qwen3_5" for the
    "qwen3_5_text" a vision-language checkpoint's `text_config` names)."""
    kind = getattr(getattr(hidden.text_model(target), "args", None), "model_type", None)
    return kind.removesuffix("_text") if isinstance(kind, str) else kind


def attention_layer(target: nn.Module) -> tuple[int, nn.Module]:
    """(index, layer) of the target's first full-attention decoder layer."""
    layers = hidden.text_model(target).layers
    for i, layer in enumerate(layers):
        if hasattr(layer, "self_attn") and not getattr(layer, "is_linear", False) \
                and not getattr(layer, "use_sliding", False):
            return i, layer
    raise MtpError(f"{model_type(target)} has no full-attention decoder layer to build an MTP "
                   "layer from")


def read_tensors(path: str | Path, layers: int) -> dict[str, mx.array]:
    """The MTP tensors under `path` (a checkpoint directory, a directory of MTP tensors, or one
    safetensors file), named as the head's parameters (`fc.weight`, `layers.0.self_attn...`):
    `mtp.*` (Qwen3-Next / Qwen3.5), or `model.layers.{layers}.*` (DeepSeek-V3 / GLM-4.5; its
    copies of the embeddings and head dropped). {} where there are none."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    deep = f"model.layers.{layers}."
    out: dict[str, mx.array] = {}
    for file in files:  # only files whose header names MTP tensors are read
        if not any(key.startswith(("mtp.", deep)) for key in tensor_names(file)):
            continue
        for key, value in mx.load(str(file)).items():
            if key.startswith("mtp."):
                name = key.removeprefix("mtp.")
            elif key.startswith(deep):
                name = key.removeprefix(deep)
                if name.startswith(_SHARED):
                    continue
                for old, new in _DEEPSEEK.items():
                    if name.startswith(old + "."):
                        name = new + name[len(old):]
                        break
                else:
                    name = "layers.0." + name
            else:
                continue
            if re.match(r"layers\.(\d+)\.", name) and not name.startswith("layers.0."):
                continue  # a second MTP layer: not used (module docstring)
            out[name] = value
    return out


def tensor_names(file: Path) -> list[str]:
    """The tensor names a safetensors file holds, from its header (nothing else is read)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return [key for key in header if key != "__metadata__"]


def _experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Per-expert projections (`mlp.experts.E.P.weight`, Qwen3-Next) stacked, and fused ones
    (`mlp.experts.gate_up_proj` (E, 2I, H) gate first, `mlp.experts.down_proj`, Qwen3.5 MoE)
    split, as mlx-lm's `switch_mlp`."""
    pattern = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(\w+)\.weight$")
    groups: dict[tuple[str, str], dict[int, mx.array]] = {}
    out = {}
    for name, value in weights.items():
        m = pattern.match(name)
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, mid = name[: -len(".experts.gate_up_proj")], value.shape[-2] // 2
            out[f"{prefix}.switch_mlp.gate_proj.weight"] = value[..., :mid, :]
            out[f"{prefix}.switch_mlp.up_proj.weight"] = value[..., mid:, :]
        elif name.endswith(".mlp.experts.down_proj"):
            out[name[: -len(".experts.down_proj")] + ".switch_mlp.down_proj.weight"] = value
        elif m:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = value
        else:
            out[name] = value
    for (prefix, proj), experts in groups.items():
        out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in sorted(experts)])
    return out


def _is_norm(name: str) -> bool:
    """An RMSNorm's weight (`pre_fc_norm_hidden.weight`, `layers.0.self_attn.q_norm.weight`)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and "norm" in parts[-2]


def _new_head(target: nn.Module) -> MtpHead:
    """An MTP head for `target`, its layer the target's own full-attention class (unloaded)."""
    args = hidden.text_model(target).args
    index, model_layer = attention_layer(target)
    cls = type(model_layer)
    kwargs = {"layer_idx": index} if "layer_idx" in inspect.signature(cls).parameters else {}
    return MtpHead(target, cls(args, **kwargs), args.hidden_size,
                   getattr(args, "rms_norm_eps", 1e-6))


def build_head(target: nn.Module, weights: dict[str, mx.array], alike: bool = True) -> MtpHead:
    """The head for `target` from its tensors (`read_tensors`' names), cast to the target's
    dtype and, with `alike`, quantized as the target is where it is (alike.py). MtpError where
    the tensors do not fit the target's layer."""
    head = _new_head(target)
    weights = _experts(weights)
    if model_type(target) in SHIFTED_NORMS:
        weights = {k: v + 1.0 if _is_norm(k) and v.ndim == 1 else v for k, v in weights.items()}
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise MtpError(f"the MTP tensors do not fit a {model_type(target)} layer: {err}") from None
    norm = hidden.final_norm(target)
    dtype = norm.weight.dtype if norm is not None and "weight" in norm else mx.float32
    head.set_dtype(dtype)
    if alike:
        quantize_alike(head, target)
    mx.eval(head.parameters())
    return head


def load_mtp(target: nn.Module, path: str | Path) -> MtpHead:
    """The target's MTP head from the tensors under `path` (its checkpoint directory, or a
    directory / file of MTP tensors), attached to the target (`head_of`) and the target's final
    states made capturable. MtpError (one sentence) where there are none or they do not fit."""
    if not hidden.watch(target):
        raise MtpError(f"{model_type(target)}: the final norm an MTP layer reads is not found")
    converted = read_converted(path)
    if converted is not None:  # programs/convert.py's file: the head's own parameters
        head = build_converted(target, *converted)
        attach(target, head)
        return head
    layers = getattr(hidden.text_model(target).args, "num_hidden_layers", -1)
    weights = read_tensors(path, layers)
    if not weights:
        raise MtpError(
            f"{str(path)!r} has no MTP tensors (looked for 'mtp.*' and 'model.layers.{layers}.*' "
            "in its safetensors): mlx-community conversions strip them, so point at the original "
            "checkpoint (or a directory holding its mtp.* tensors)")
    head = build_head(target, weights)
    attach(target, head)
    return head


def read_converted(path: str | Path) -> tuple[dict[str, mx.array], dict] | None:
    """The head's parameters and their quantization (empty: none) from a conversion's
    `mtp.safetensors` (programs/convert.py: metadata `tinydraft_mtp` = "head"), None where
    `path` holds none."""
    path = Path(path)
    file = path if path.is_file() else path / CONVERTED
    if not file.is_file():
        return None
    weights, metadata = mx.load(str(file), return_metadata=True)
    if metadata.get("tinydraft_mtp") != "head":
        return None
    params = {k.removeprefix("mtp."): v for k, v in weights.items() if k.startswith("mtp.")}
    return params, json.loads(metadata.get("quantization") or "{}")


def build_converted(target: nn.Module, weights: dict[str, mx.array],
                    quantization: dict) -> MtpHead:
    """The head from a conversion's parameters (already in the head's layout, quantized as
    `quantization` says). MtpError where they do not fit the target."""
    head = _new_head(target)
    if quantization:
        quantize(head, quantization["group_size"], quantization["bits"],
                 quantization.get("mode", "affine"), stored=weights)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise MtpError(f"the converted MTP layer does not fit this {model_type(target)}: "
                       f"{err}") from None
    mx.eval(head.parameters())
    return head


def attach(target: nn.Module, head: MtpHead) -> None:
    """Make `head` the target's MTP drafter (draft="mtp" resolves to it)."""
    hidden.watch(target)
    target.__dict__[_HEAD] = head


def head_of(target: nn.Module | None) -> MtpHead | None:
    """The MTP head attached to `target`, None if none is."""
    return None if target is None else getattr(target, "__dict__", {}).get(_HEAD)

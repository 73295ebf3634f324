"""Loading a target/draft pair through mlx-lm, and checking that they can work together.

Hub ids and local directories are both accepted. Remote code is never trusted. Checkpoints written
by transformers 5 keep the RoPE base under "rope_parameters", which mlx-lm's qwen2 does not read (it
would silently use 1e6): we pass it through explicitly.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import load as mlx_lm_load

from ..engine import skinny
from ..engine.backend import resolve_dtype, warn_if_slow_blas
from ..engine.cache import make_cache
from ..engine.distributed import join
from ..engine.drafters.dflash import is_dflash, load_dflash
from ..engine.drafters.eagle import is_eagle3, load_eagle3
from ..engine.drafters.lookup import NO_DRAFT, PROMPT_LOOKUP, PromptLookup
from ..engine.drafters.mtp import MTP, MtpError, MtpHead, load_mtp
from ..engine.pruning import prune_draft
from ..engine.sampling import ParameterError
from ..vision import VisionError, has_vision_tower, load_vision
from ..vision.part import available as vision_available

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"
_ALLOW = ["*.json", "model*.safetensors", "mtp*.safetensors", "*.txt", "*.jinja",
          "tokenizer.model", "*.tiktoken"]
# Each family's default draft: the smallest model of the family that shares its tokenizer, named
# from the target's own name (publisher, variant and quantization kept), so "mlx-community/
# Qwen3-8B-4bit" gets "mlx-community/Qwen3-0.6B-4bit". Mistral has no such sibling.
_FAMILY_DRAFTS = (
    (re.compile(r"^(Qwen2\.5-(?:Coder-)?)\d+(?:\.\d+)?B(.*)$"), r"\g<1>0.5B\g<2>"),
    (re.compile(r"^(Qwen3-)\d+(?:\.\d+)?B(?:-A\d+B)?(?:-Instruct-2507|-Thinking-2507)?(.*)$"),
     r"\g<1>0.6B\g<2>"),
    (re.compile(r"^(?:Meta-)?Llama-3\.[123]-\d+B(.*)$"), r"Llama-3.2-1B\g<1>"),
    (re.compile(r"^(gemma-3-)\d+b(.*)$"), r"\g<1>1b\g<2>"),
    # Qwen3.5 (hybrid GDN + attention, dense and MoE): the 0.8B shares the tokenizer
    (re.compile(r"^(Qwen3\.5-)\d+(?:\.\d+)?B(?:-A\d+B)?(.*)$"), r"\g<1>0.8B\g<2>"),
)


class ModelLoadError(ValueError):
    """A checkpoint could not be found or used; the message is one sentence for the user."""


def _looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def resolve_model_path(name: str | Path) -> Path:
    """A local directory for `name`: the directory itself, or the hub snapshot (downloaded or
    cached). Raises ModelLoadError with one sentence when neither is possible."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if not _looks_like_hub_id(str(name)):
        raise ModelLoadError(f"model directory {str(name)!r} does not exist")
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(str(name), allow_patterns=_ALLOW))
    except Exception as err:  # offline, unknown repo, gated, invalid id: all end the same way
        if constants.HF_HUB_OFFLINE:
            why = "HF_HUB_OFFLINE is set, so it was not looked up: unset it to download it"
        else:
            why = f"{type(err).__name__}: {_first_sentence(str(err)) or 'no reason given'}"
        raise ModelLoadError(
            f"could not load {str(name)!r}: it is not in the local Hugging Face cache and the hub "
            f"could not provide it ({why}); a local checkpoint directory works offline"
        ) from None


def _first_sentence(text: str, limit: int = 200) -> str:
    """The first sentence of `text` (one line), cut at a word, never mid-word, past `limit`."""
    line = " ".join(text.split())
    end = line.find(". ")
    sentence = line if end < 0 else line[: end + 1]
    if len(sentence) <= limit:
        return sentence
    return sentence[:limit].rsplit(" ", 1)[0] + " ..."


def config_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """What mlx-lm reads at the top level of a config, taken from transformers 5's forms: the RoPE
    base (and scaling) under "rope_parameters", flat or per layer type (Gemma 3: full attention's
    base, and the sliding layers' as "rope_local_base_freq"), and the sliding-window period from
    "layer_types" (mlx-lm would otherwise take its default and silently misplace the layers); for
    hybrid linear-attention models (Qwen3-Next, Qwen3.5) the full-attention period from
    "layer_types" (mlx-lm reads "full_attention_interval"), Granite 4's layer names in it
    (mlx-lm reads "mamba" / "attention"), Mamba-2's inner width (expand x hidden) and a
    text-only Qwen3.5 checkpoint's model type ("qwen3_5_text") as mlx-lm's model of it
    ("qwen3_5"); the same for the text model a vision-language checkpoint nests under
    "text_config". Raises ModelLoadError for a layer layout mlx-lm's model cannot express."""
    rope = config.get("rope_parameters")
    overrides: dict[str, Any] = {}
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        local = rope.get("sliding_attention")
        if isinstance(local, dict) and "rope_local_base_freq" not in config \
                and "rope_theta" in local:
            overrides["rope_local_base_freq"] = local["rope_theta"]
        rope = rope["full_attention"]
    if isinstance(rope, dict):
        for key in ("rope_theta", "partial_rotary_factor"):
            if key not in config and key in rope:
                overrides[key] = rope[key]
        if rope.get("rope_type", "default") != "default" and config.get("rope_scaling") is None:
            overrides["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    period = _period(config.get("layer_types"), "sliding_attention")
    if period is not None and "sliding_window_pattern" not in config:
        overrides["sliding_window_pattern"] = period
    model_type = config.get("model_type", "")
    layer_types = config.get("layer_types") or []
    if model_type == "granitemoehybrid" and "linear_attention" in layer_types:
        # transformers 5's names for Granite 4's layers; mlx-lm reads its own
        overrides["layer_types"] = [{"linear_attention": "mamba", "full_attention": "attention"}
                                    .get(kind, kind) for kind in layer_types]
    elif "linear_attention" in layer_types:
        period = _period(layer_types, "linear_attention")
        if period is None:
            raise ModelLoadError(
                f"layer_types {layer_types} is not 'every p-th layer full attention', "
                "the only layout mlx-lm's Qwen3-Next / Qwen3.5 models build")
        if "full_attention_interval" not in config:
            overrides["full_attention_interval"] = period
    if model_type == "mamba2" and "intermediate_size" not in config and "expand" in config:
        overrides["intermediate_size"] = config["expand"] * config["hidden_size"]
    if model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        overrides["model_type"] = model_type.removesuffix("_text")
    text = config.get("text_config")
    if isinstance(text, dict) and (inner := config_overrides(text)):
        # a vision-language checkpoint (the hub's Qwen3.5): its text model's config, alike
        overrides["text_config"] = {**text, **inner}
    return overrides


def _period(layer_types: Any, other: str) -> int | None:
    """p when every p-th layer is full attention and the others are `other` (Gemma 3's sliding
    pattern, Qwen3-Next's linear one)."""
    if not isinstance(layer_types, list) or other not in layer_types \
            or "full_attention" not in layer_types:
        return None
    p = layer_types.index("full_attention") + 1
    pattern = ["full_attention" if (i + 1) % p == 0 else other for i in range(len(layer_types))]
    return p if pattern == layer_types else None


def load_model(name: str | Path, dtype: str | mx.Dtype | None = None,
               group: mx.distributed.Group | None = None) -> tuple[nn.Module, Any]:
    """Load one checkpoint through mlx-lm: (model, tokenizer), floating-point weights cast to
    `dtype` (None: float32 on the CPU, the checkpoint's own dtype on a GPU; quantized weights stay
    quantized). Loading is lazy and the cast happens before the weights are materialised, so a
    cast never holds two copies of the weights. With `group`, the model is sharded over it
    (mlx-lm's `model.shard(group)`, tensor parallel) before anything is materialised, so each
    rank reads and keeps only its shard (as mlx-lm's `sharded_load`)."""
    dt = resolve_dtype(dtype)
    path = resolve_model_path(name)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{str(name)!r} has no config.json: not a model checkpoint")
    config = json.loads(config_file.read_text())
    try:
        model, tokenizer = mlx_lm_load(str(path), model_config=config_overrides(config), lazy=True)
    except (FileNotFoundError, ValueError) as err:
        raise ModelLoadError(f"could not load {str(name)!r}: {err}") from None
    _refuse_without_rollback(model, name)
    if group is not None:
        if not hasattr(model, "shard"):
            raise ModelLoadError(f"{str(name)!r}: mlx-lm cannot shard a {type(model).__name__} "
                                 "(no tensor-parallel support for this architecture)")
        model.shard(group)
    if dt is not None:
        _cast(model, dt)
    for _, weight in tree_flatten(model.parameters()):
        mx.eval(weight)  # one tensor at a time: its stored copy is freed before the next is read
    return model, tokenizer


def _cast(model: nn.Module, dtype: mx.Dtype) -> None:
    """Floating-point weights to `dtype`, except those the model keeps as they are (mlx-lm's
    `cast_predicate`: e.g. Qwen3.5's A_log, kept in float32 by its converter)."""
    keep = getattr(model, "cast_predicate", None)
    if keep is None:
        model.set_dtype(dtype)
        return
    model.update(tree_unflatten([
        (name, w.astype(dtype) if mx.issubdtype(w.dtype, mx.floating) and keep(name) else w)
        for name, w in tree_flatten(model.parameters())]))


def _refuse_without_rollback(model: nn.Module, name: str | Path) -> None:
    """ModelLoadError for an architecture whose caches cannot roll back a rejected draft: a
    layer state other than attention's keys and values and the Gated DeltaNet / Mamba-2 states
    that engine/cache/recurrent.py replays (e.g. LFM2's short convolutions, Mamba-1, RWKV)."""
    try:
        make_cache(model)
    except ValueError as err:
        kind = getattr(getattr(model, "args", None), "model_type", None) or type(model).__name__
        raise ModelLoadError(
            f"{str(name)!r} ({kind}) cannot be decoded speculatively: {err}; decode it plainly "
            "with mlx-lm, or pick a model of those families"
        ) from None


def _hf_tokenizer(tokenizer: Any) -> Any:
    return getattr(tokenizer, "_tokenizer", tokenizer)


def check_tokenizers(target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Raise ModelLoadError unless both tokenizers map text to the same ids (vocabulary, added and
    special tokens, EOS)."""
    t, d = _hf_tokenizer(target_tokenizer), _hf_tokenizer(draft_tokenizer)
    if t.get_vocab() != d.get_vocab():
        raise ModelLoadError(
            f"the draft's tokenizer differs from the target's (vocabularies of "
            f"{len(d.get_vocab())} and {len(t.get_vocab())} entries that do not match): "
            "they must share one tokenizer"
        )
    if list(t.all_special_tokens) != list(d.all_special_tokens):
        raise ModelLoadError(
            f"the draft's special tokens {list(d.all_special_tokens)} differ from the target's "
            f"{list(t.all_special_tokens)}: they must share one tokenizer"
        )
    t_eos = getattr(target_tokenizer, "eos_token_ids", {t.eos_token_id})
    d_eos = getattr(draft_tokenizer, "eos_token_ids", {d.eos_token_id})
    if set(t_eos) != set(d_eos):
        raise ModelLoadError(
            f"the draft's EOS tokens {sorted(d_eos)} differ from the target's {sorted(t_eos)}"
        )


def default_draft(target: str | Path | None) -> str | None:
    """The draft to use when none is named: the bundled demo draft for the demo target (None, or
    its directory); for a Qwen2.5, Qwen3, Qwen3.5, Llama 3.x or Gemma 3 hub id, the family's
    small model of the same publisher, variant and suffix (Qwen2.5-0.5B, Qwen3-0.6B,
    Qwen3.5-0.8B, Llama-3.2-1B, gemma-3-1b); for a local directory, that name as a sibling
    directory if one exists; else None. Loading still refuses a draft whose tokenizer differs
    from the target's."""
    local = Path(target).expanduser() if target is not None else None
    exists = local is not None and local.exists()
    if local is None or (exists and local.resolve() == (DEMO_DIR / "target").resolve()):
        return str(DEMO_DIR / "draft")  # the demo target, by default or by its directory
    if not exists and not _looks_like_hub_id(str(target)):
        return None
    org, _, name = str(target).rpartition("/") if not exists else ("", "", local.name)
    for pattern, draft in _FAMILY_DRAFTS:
        if pattern.match(name):
            sibling = pattern.sub(draft, name)
            break
    else:
        return None
    if sibling == name:
        return None  # the target is itself the family's smallest model
    if not exists:
        return f"{org}/{sibling}"
    path = local.parent / sibling
    return str(path) if path.is_dir() else None


def no_draft_notice(target: str | Path | None) -> str:
    """The line to show when no draft was named and none is known for `target`: generation
    will decode plainly, and how to pass one."""
    return (f"no draft model is known for {target}: decoding plainly (no speculation); pass a "
            "draft of the same family and tokenizer (e.g. Qwen2.5-0.5B for a Qwen2.5 target) with "
            "--draft, or --draft prompt-lookup")


def load_models(
    target: str | Path | None = None,
    draft: str | Path | None = None,
    *,
    dtype: str | mx.Dtype | None = None,
    draft_vocab: int | None = None,
    draft_vocab_counts: str | Path | None = None,
    distributed: bool = False,
    vision: bool | None = None,
) -> tuple[nn.Module, nn.Module | PromptLookup | None, Any]:
    """Load (target, draft, tokenizer).

    target: hub id or local directory; None loads the bundled demo target.
    draft: hub id or local directory; None picks `default_draft(target)`; "none" loads no draft;
    "prompt-lookup" returns a `PromptLookup` drafter (no model); a speculators EAGLE-3 directory
    (config "speculators_model_type": "eagle3") returns an `Eagle3Head` over the target, a DFlash
    directory (config "architectures" ["DFlashDraftModel"] or ["DFlash2DraftModel"]) a
    `DFlashDraft` block drafter over it; "mtp"
    returns the target's own
    MTP layer (an `MtpHead`, from the `mtp.*` tensors of its checkpoint, which mlx-community
    conversions strip: use the original checkpoint), after which draft="mtp" also names it
    wherever this target decodes (a separate directory of MTP tensors: `load_mtp`).
    dtype: "float32", "float16", "bfloat16" or an mx.Dtype; default float32 on the CPU backend and
    the checkpoint's own dtype on a GPU (as mlx-lm: bfloat16 for Qwen2.5).

    draft_vocab: keep only the N most frequent tokens in the draft's LM head (a `PrunedDraft`:
    cheaper draft steps, the output still exactly the target's; see `tinydraft_mlx.engine.pruning`),
    by the counts in `draft_vocab_counts` (`python -m tinydraft_mlx.vocab`; default: the counts
    shipped for the demo pair's tokenizer).

    distributed: join the group `mlx.launch` started and load the target tensor-parallel over
    it (each rank materialises only its shard); the draft loads whole on every rank. Generation
    then keeps the ranks in step by itself (see `tinydraft_mlx.engine.distributed`).

    vision: a vision-language checkpoint's vision tower, loaded by mlx-vlm beside the target
    (sharing its language model's weights) so that prompts may carry images
    (`tinydraft_mlx.vision`): None loads it where the checkpoint has one and mlx-vlm is
    installed (a warning, and text only, where mlx-vlm cannot load it: a conversion that dropped
    its tensors), True requires it (ModelLoadError without), False never loads it. Not with
    `distributed`.

    On the CPU backend both models' large projections take the skinny-matmul path (see
    `tinydraft_mlx.engine.skinny`; `skinny.disable(model)` turns it off).
    """
    resolve_dtype(dtype)  # fail on a bad dtype before loading anything
    if draft_vocab_counts is not None and draft_vocab is None:
        raise ParameterError("draft_vocab_counts", "used with draft_vocab (it says which tokens "
                             "draft_vocab keeps)", str(draft_vocab_counts))
    if draft_vocab is not None and draft is not None and str(draft).lower() in (NO_DRAFT,
                                                                                PROMPT_LOOKUP, MTP):
        raise ParameterError("draft_vocab", "used with a draft model (not prompt lookup, mtp or "
                             "none)", str(draft).lower())
    warn_if_slow_blas()
    if target is None:
        if not (DEMO_DIR / "target" / "config.json").is_file():
            raise ModelLoadError("no target given and the bundled demo pair is not installed")
        target = str(DEMO_DIR / "target")
        draft = draft if draft is not None else default_draft(None)
    elif draft is None:
        draft = default_draft(str(target))
    group = join().group if distributed else None
    target_model, tokenizer = load_model(target, dtype, group)
    skinny.enable(target_model)
    if vision or (vision is None and not distributed):
        _load_vision(target_model, target, required=bool(vision), distributed=distributed)
    if str(draft).lower() == MTP:
        return target_model, load_head(target_model, target), tokenizer
    if draft is not None and str(draft).lower() not in (NO_DRAFT, PROMPT_LOOKUP):
        head = load_eagle(target_model, draft)
        if head is not None:
            if draft_vocab is not None:
                raise ParameterError("draft_vocab", "used with a draft model (not a drafter "
                                     "that reads the target)", str(draft))
            return target_model, head, tokenizer
    draft_model = load_draft(draft, tokenizer, dtype=dtype)
    if draft_vocab is not None:
        draft_model = prune_draft(draft_model, tokenizer, draft_vocab, draft_vocab_counts)
    return target_model, draft_model, tokenizer


def _load_vision(target: nn.Module, name: str | Path, required: bool, distributed: bool) -> None:
    """Attach the checkpoint's vision tower to `target` (`load_models`' `vision`)."""
    if required and distributed:
        raise ParameterError("vision", "False or None with distributed (a tensor-parallel "
                             "target has no vision tower here)", True)
    path = resolve_model_path(name)
    if not has_vision_tower(path):
        if required:
            raise ModelLoadError(f"{name} has no vision tower (its config has no vision_config)")
        return
    if not (required or vision_available()):
        return
    try:
        load_vision(target, path)
    except VisionError as err:
        raise ModelLoadError(str(err)) from None
    except Exception as err:  # mlx-vlm's loader: a conversion that dropped the vision tensors
        why = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        if required:
            raise ModelLoadError(f"{name}: mlx-vlm could not load its vision tower ({why})") \
                from None
        warnings.warn(f"{name} loads as a text model: mlx-vlm could not load its vision tower "
                      f"({why}); prompts with images are refused", stacklevel=3)


def load_head(target: nn.Module, path: str | Path) -> MtpHead:
    """The MTP layer of a target already loaded, from the tensors in `path` (its checkpoint: a
    hub id or a directory; or a directory / file of MTP tensors). ModelLoadError (one sentence)
    where there are none or they do not fit the target."""
    local = Path(path).expanduser()
    try:
        return load_mtp(target, local if local.exists() else resolve_model_path(path))
    except MtpError as err:
        raise ModelLoadError(str(err)) from None


def load_eagle(target: nn.Module, path: str | Path) -> nn.Module | None:
    """The drafter that reads the target's states at `path` (a hub id or a directory) for a
    target already loaded: an EAGLE-3 head (speculators format) or a DFlash / DFlash2 block
    drafter; None where `path` is neither. ModelLoadError where it does not fit."""
    local = Path(path).expanduser()
    if not local.is_dir():
        if not _looks_like_hub_id(str(path)):
            return None
        try:
            local = resolve_model_path(path)
        except ModelLoadError:
            return None  # load_draft says why in its own words
    loader = load_eagle3 if is_eagle3(local) else load_dflash if is_dflash(local) else None
    if loader is None:
        return None
    try:
        return loader(target, local)
    except MtpError as err:
        raise ModelLoadError(str(err)) from None


def load_draft(
    draft: str | Path | None, target_tokenizer: Any, *, dtype: str | mx.Dtype | None = None
) -> nn.Module | PromptLookup | None:
    """A draft for a target already loaded: None or "none" -> None, "prompt-lookup" -> a
    `PromptLookup`, else the checkpoint (hub id or directory), refused unless it shares the
    target's tokenizer."""
    if draft is None or str(draft).lower() == NO_DRAFT:
        return None
    if str(draft).lower() == PROMPT_LOOKUP:
        return PromptLookup()
    draft_model, draft_tokenizer = load_model(draft, dtype)
    check_tokenizers(target_tokenizer, draft_tokenizer)
    skinny.enable(draft_model)
    return draft_model

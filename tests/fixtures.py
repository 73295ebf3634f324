"""Tiny Qwen2 checkpoints built at test time with transformers, plus a byte-level BPE tokenizer.

Random Qwen2 models with the default 0.02 init repeat one token forever; these use a 0.2 init and a
sharpened, untied output head so greedy paths are diverse and top-1/top-2 logit gaps are far above
the ~1e-5 disagreement between frameworks. The draft copies the target's first layers (and the
target's later layers are damped), so it imitates the target without being identical: acceptance
lands strictly between 0 and 1.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

VOCAB = 384  # tokenizer entries, incl. <|endoftext|>
TARGET_WIDTH = VOCAB + 64  # the target's logit width is padded, as Qwen2.5-7B's is
EOS = "<|endoftext|>"


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for name in ["argparse.py", "json/encoder.py", "textwrap.py", "string.py"]:
        lines += (stdlib / name).read_text().splitlines()
    return lines


def build_tokenizer(directory: Path, vocab_size: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(directory)


def _config(layers: int, width: int, eos_id: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=width,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,  # not mlx-lm's fallback 1e6: a dropped RoPE base shows
        tie_word_embeddings=False,
        initializer_range=0.2,
        eos_token_id=eos_id,
    )


def build_pair(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write root/target (4 layers) and root/draft (2 layers, narrower logits); same tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    target_dir, draft_dir = root / "target", root / "draft"
    build_tokenizer(target_dir)
    build_tokenizer(draft_dir)
    eos_id = AutoTokenizer.from_pretrained(target_dir).convert_tokens_to_ids(EOS)

    torch.manual_seed(seed)
    target = Qwen2ForCausalLM(_config(4, TARGET_WIDTH, eos_id)).eval()
    draft = Qwen2ForCausalLM(_config(2, VOCAB, eos_id)).eval()
    _shape_pair(target, draft, eos_id, copied=2)
    target.save_pretrained(target_dir)
    draft.save_pretrained(draft_dir)
    return target_dir, draft_dir


def _shape_pair(target, draft, eos_id: int, copied: int) -> None:
    """Sharpen the target's head (EOS never wins greedily: long oracle paths), damp its later
    layers, and make the draft a copy of its embedding, head, norm and first `copied` layers."""
    import torch

    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)
        target.lm_head.weight[eos_id] = 0.0
        for layer in target.model.layers[2:]:
            layer.self_attn.o_proj.weight.mul_(0.35)
            layer.mlp.down_proj.weight.mul_(0.35)
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight[:VOCAB])
        draft.lm_head.weight.copy_(target.lm_head.weight[:VOCAB])
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        for i in range(copied):
            draft.model.layers[i].load_state_dict(target.model.layers[i].state_dict())


def build_unrelated(root: Path, seed: int = 123) -> Path:
    """A draft with the same tokenizer but independent random weights (near-zero acceptance)."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    directory = root / "unrelated"
    build_tokenizer(directory)
    eos_id = AutoTokenizer.from_pretrained(directory).convert_tokens_to_ids(EOS)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(_config(2, VOCAB, eos_id)).eval().save_pretrained(directory)
    return directory


def build_other_tokenizer(root: Path) -> Path:
    """A draft checkpoint whose tokenizer differs (smaller BPE vocabulary)."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    directory = root / "other_tokenizer"
    build_tokenizer(directory, vocab_size=300)
    eos_id = AutoTokenizer.from_pretrained(directory).convert_tokens_to_ids(EOS)
    torch.manual_seed(7)
    Qwen2ForCausalLM(_config(1, 300, eos_id)).eval().save_pretrained(directory)
    return directory


WIDE = TARGET_WIDTH + 64  # wider than the target's logits: ids the target's embedding lacks


def build_wide_draft(root: Path) -> Path:
    """A draft whose logits are wider than the target's (WIDE rows). The extra rows copy the head
    rows of the 64 lowest ids, scaled up, so wherever the draft would propose one of those it
    proposes an id the target does not have."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    source = root / "draft"
    directory = root / "wide_draft"
    build_tokenizer(directory)
    eos_id = AutoTokenizer.from_pretrained(directory).convert_tokens_to_ids(EOS)
    narrow = Qwen2ForCausalLM.from_pretrained(source).eval()
    wide = Qwen2ForCausalLM(_config(2, WIDE, eos_id)).eval()
    with torch.no_grad():
        state = narrow.state_dict()
        for name, value in wide.state_dict().items():
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                value[:VOCAB] = state[name]
                value[VOCAB:] = 0.0
                if name == "lm_head.weight":
                    value[TARGET_WIDTH:] = 1.3 * state[name][:WIDE - TARGET_WIDTH]
            else:
                value.copy_(state[name])
    wide.save_pretrained(directory)
    return directory


# -- other architectures ------------------------------------------------------------------------
# Tiny checkpoints of the mlx-lm architectures Mac users run with a standard KV cache. Each family
# gets a target and a draft (the draft copies the target's first layers), built like the Qwen2
# pair: a 0.2 init and a sharpened untied head, so greedy paths are diverse with clear margins.
FAMILIES = ("qwen3", "llama", "mistral", "gemma3")
GEMMA_WINDOW = 8  # sliding-window layers see 8 positions: every test sequence wraps them
# seeds whose greedy paths on test_architectures' prompts keep top-1/top-2 margins above 5e-3
FAMILY_SEEDS = {"qwen3": 2, "llama": 2, "mistral": 1, "gemma3": 1}


def _family_config(family: str, layers: int, width: int, eos_id: int):
    import transformers as tf

    common = dict(vocab_size=width, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, tie_word_embeddings=False,
                  initializer_range=0.2, eos_token_id=eos_id, bos_token_id=eos_id)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16, rope_theta=10000.0)
    if family == "llama":  # Llama 3.x: its RoPE scaling ("llama3") is part of what is checked
        return tf.LlamaConfig(**common, rope_theta=50000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "mistral":
        return tf.MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
    if family == "gemma3":  # layers 1-5 of every 6 slide over GEMMA_WINDOW positions, the 6th not
        return tf.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16,
                                   sliding_window=GEMMA_WINDOW, rope_theta=10000.0,
                                   rope_local_base_freq=1000.0, final_logit_softcapping=None)
    raise ValueError(f"unknown family {family!r}")


def build_family_pair(root: Path, family: str, seed: int | None = None) -> tuple[Path, Path]:
    """Write root/<family>/target and root/<family>/draft: same tokenizer, the draft a shallower
    copy of the target (Gemma 3: 6 layers each, one full-attention layer per 6)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = root / family / "target", root / family / "draft"
    build_tokenizer(target_dir)
    build_tokenizer(draft_dir)
    eos_id = AutoTokenizer.from_pretrained(target_dir).convert_tokens_to_ids(EOS)
    layers, draft_layers = (6, 6) if family == "gemma3" else (4, 2)
    torch.manual_seed(FAMILY_SEEDS[family] if seed is None else seed)
    target = AutoModelForCausalLM.from_config(_family_config(family, layers, TARGET_WIDTH, eos_id))
    draft = AutoModelForCausalLM.from_config(_family_config(family, draft_layers, VOCAB, eos_id))
    target.eval()
    draft.eval()
    _shape_pair(target, draft, eos_id, copied=draft_layers)
    if family == "gemma3":  # the copied layers beyond the first two: damped further
        with torch.no_grad():
            for layer in draft.model.layers[2:]:
                layer.mlp.down_proj.weight.mul_(0.5)
    target.save_pretrained(target_dir)
    draft.save_pretrained(draft_dir)
    return target_dir, draft_dir


# hybrid models: recurrent layers (Gated DeltaNet, Mamba-2) interleaved with full attention
HYBRIDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "granitemoehybrid", "mamba2")
# seeds whose greedy paths on test_hybrid's prompts keep top-1/top-2 margins above 2e-3
HYBRID_SEEDS = {"qwen3_next": 1, "qwen3_5": 3, "qwen3_5_moe": 1, "nemotron_h": 1,
                "granitemoehybrid": 0, "mamba2": 2}


def _hybrid_config(family: str, layers: int, width: int, eos_id: int):
    """Target (4 layers: recurrent, attention, recurrent, attention) or draft (its first 2)."""
    import transformers as tf

    common = dict(vocab_size=width, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
                  initializer_range=0.2, eos_token_id=eos_id, bos_token_id=eos_id)
    gdn = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
               linear_value_head_dim=16, full_attention_interval=2)
    if family == "qwen3_next":  # GDN + gated attention, sparse MoE MLPs
        return tf.Qwen3NextConfig(**common, **gdn, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if family == "qwen3_5":  # the text model of Qwen3.5 (dense MLPs), as transformers 5 writes it
        return tf.Qwen3_5TextConfig(**common, **gdn)
    if family == "qwen3_5_moe":  # Qwen3.5's MoE text model (fused expert weights)
        return tf.Qwen3_5MoeTextConfig(**common, **gdn, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32,
                                       shared_expert_intermediate_size=32)
    if family == "nemotron_h":  # Mamba-2 mixers and attention ("M*M-": the last an MLP)
        return tf.NemotronHConfig(**common, mamba_num_heads=4, mamba_head_dim=16,
                                  ssm_state_size=16, n_groups=2, mamba_d_conv=4, mamba_expand=1,
                                  hybrid_override_pattern="M*M-"[:layers])
    if family == "granitemoehybrid":  # Granite 4: Mamba-2 (one group) and
        # attention, a shared MLP (mlx-lm and transformers disagree for mamba_n_groups > 1)
        return tf.GraniteMoeHybridConfig(
            **common, layer_types=["mamba", "attention", "mamba", "attention"][:layers],
            mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
            mamba_expand=1, mamba_d_conv=4, num_local_experts=0, shared_intermediate_size=128,
            position_embedding_type="rope", rope_parameters={"rope_type": "default",
                                                             "rope_theta": 10000.0})
    if family == "mamba2":  # Mamba-2 only, no attention layer (one group: as Granite's)
        return tf.Mamba2Config(vocab_size=width, hidden_size=64, num_hidden_layers=layers,
                               num_heads=8, head_dim=16, state_size=16, n_groups=1, expand=2,
                               conv_kernel=4, initializer_range=0.2, tie_word_embeddings=False,
                               eos_token_id=eos_id, bos_token_id=eos_id)
    raise ValueError(f"unknown hybrid family {family!r}")


def build_hybrid_pair(root: Path, family: str, damp: float = 0.2) -> tuple[Path, Path]:
    """Write root/<family>/target (4 layers) and root/<family>/draft (a copy of its first 2, a
    hybrid draft too); same tokenizer. The target's later layers are damped by `damp`, so the
    draft agrees with it often but not always."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = root / family / "target", root / family / "draft"
    build_tokenizer(target_dir)
    build_tokenizer(draft_dir)
    eos_id = AutoTokenizer.from_pretrained(target_dir).convert_tokens_to_ids(EOS)
    torch.manual_seed(HYBRID_SEEDS[family])
    target = AutoModelForCausalLM.from_config(_hybrid_config(family, 4, TARGET_WIDTH, eos_id))
    draft = AutoModelForCausalLM.from_config(_hybrid_config(family, 2, VOCAB, eos_id))
    target.eval()
    draft.eval()
    mamba = family in ("nemotron_h", "mamba2")  # Mamba-style names
    _copy_pair(target, draft, eos_id, damp, ("o_proj.weight", "out_proj.weight",
                                             "down_proj.weight", "output_linear.weight"),
               "embeddings" if mamba else "embed_tokens", "norm_f" if mamba else "norm",
               "backbone" if family == "mamba2" else "model")
    for model, directory in ((target, target_dir), (draft, draft_dir)):
        if family == "qwen3_5_moe":  # fused experts, as the hub ships them (transformers 5
            _save_fused(model, directory)  # saves one tensor per expert, which mlx-lm refuses)
        else:
            model.save_pretrained(directory)
    return target_dir, draft_dir


def _copy_pair(target, draft, eos_id: int, damp: float, damped: tuple[str, ...],
               embed: str = "embed_tokens", norm: str = "norm", body: str = "model") -> None:
    """Sharpen the target's head (EOS never wins greedily), damp its layers past the second (the
    parameters whose names end in `damped`), and make the draft a copy of its embedding, head,
    final norm and first 2 layers (`body`: the module holding them)."""
    import torch

    t, d = getattr(target, body), getattr(draft, body)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)
        target.lm_head.weight[eos_id] = 0.0
        for layer in t.layers[2:]:
            for name, weight in layer.named_parameters():
                if name.endswith(damped):
                    weight.mul_(damp)
        getattr(d, embed).weight.copy_(getattr(t, embed).weight[:VOCAB])
        draft.lm_head.weight.copy_(target.lm_head.weight[:VOCAB])
        getattr(d, norm).load_state_dict(getattr(t, norm).state_dict())
        for i in range(2):
            d.layers[i].load_state_dict(t.layers[i].state_dict())


def _save_fused(model, directory: Path) -> None:
    """The model's tensors under their in-memory names (experts.gate_up_proj: (E, 2I, H), gate
    first), and its config."""
    from safetensors.torch import save_file

    model.config.save_pretrained(directory)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def build_gpt_oss_pair(root: Path, damp: float = 0.2) -> tuple[Path, Path, Path]:
    """gpt-oss (alternating sliding-window and full attention, attention sinks, MoE with biases):
    root/gpt_oss/oracle (the target as transformers 5 saves it, for the oracle), root/gpt_oss/
    target and root/gpt_oss/draft (a copy of the target's first 2 layers) in the layout mlx-lm
    loads (experts split into gate / up / down SwitchGLU weights: transformers 5 saves them in
    its in-memory layout, (E, H, 2I) interleaved, which mlx-lm's converter does not read)."""
    import torch
    import transformers as tf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    base = root / "gpt_oss"
    dirs = oracle_dir, target_dir, draft_dir = base / "oracle", base / "target", base / "draft"
    for directory in dirs:
        build_tokenizer(directory)
    eos_id = AutoTokenizer.from_pretrained(oracle_dir).convert_tokens_to_ids(EOS)

    def config(layers: int, width: int):
        return tf.GptOssConfig(
            vocab_size=width, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=GEMMA_WINDOW,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
            max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=False,
            eos_token_id=eos_id, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

    torch.manual_seed(0)
    target = tf.AutoModelForCausalLM.from_config(config(4, TARGET_WIDTH)).eval()
    draft = tf.AutoModelForCausalLM.from_config(config(2, VOCAB)).eval()
    _copy_pair(target, draft, eos_id, damp, ("o_proj.weight", "down_proj", "down_proj_bias"))
    target.save_pretrained(oracle_dir)
    for model, directory in ((target, target_dir), (draft, draft_dir)):
        model.config.save_pretrained(directory)
        save_file(_mlx_experts(model.state_dict()), str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
    return oracle_dir, target_dir, draft_dir


def _mlx_experts(state: dict) -> dict:
    """gpt-oss expert tensors as mlx-lm's model holds them: gate_up (E, H, 2I), interleaved
    gate/up, -> gate_proj / up_proj (E, I, H); down (E, I, H) -> down_proj (E, H, I)."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            out[stem + "gate_proj.weight"] = t[..., ::2].transpose(1, 2).contiguous()
            out[stem + "up_proj.weight"] = t[..., 1::2].transpose(1, 2).contiguous()
        elif name.endswith("experts.gate_up_proj_bias"):
            stem = name.removesuffix("gate_up_proj_bias")
            out[stem + "gate_proj.bias"] = t[..., ::2].contiguous()
            out[stem + "up_proj.bias"] = t[..., 1::2].contiguous()
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = t.transpose(1, 2).contiguous()
        elif name.endswith("experts.down_proj_bias"):
            out[name.removesuffix("_bias") + ".bias"] = t.contiguous()
        else:
            out[name] = t.contiguous()
    return out


def build_gemma4(root: Path) -> Path:
    """A Gemma 4 text target (sliding / sliding / full attention, twice; its last 2 layers share
    the KV caches of earlier ones; per-layer input embeddings), as transformers 5 saves it."""
    import torch
    import transformers as tf
    from transformers import AutoTokenizer

    directory = root / "gemma4"
    build_tokenizer(directory)
    eos_id = AutoTokenizer.from_pretrained(directory).convert_tokens_to_ids(EOS)
    config = tf.Gemma4TextConfig(
        vocab_size=TARGET_WIDTH, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=GEMMA_WINDOW,
        max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=False,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        eos_token_id=eos_id, bos_token_id=eos_id, pad_token_id=eos_id,
        vocab_size_per_layer_input=TARGET_WIDTH, hidden_size_per_layer_input=16,
        num_kv_shared_layers=2)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
        model.lm_head.weight[eos_id] = 0.0
    model.save_pretrained(directory)
    return directory


# MTP layers (tests/test_mtp.py): the tensors a checkpoint ships beside the target's, under the
# hub's names, built from the target's own attention layer so the layer agrees with it often
MTP_FAMILIES = ("qwen3", "qwen3_next", "qwen3_5", "qwen3_5_moe")
HEAD_PROMPTS = [  # the heads' tests' prompts (tests/test_mtp.py, tests/test_eagle.py)
    "def parse_args(self, args=None, namespace=None):\n    if args is None:",
    "import os\nimport sys\n\nclass Encoder(object):\n    def",
    "x = 1",
    "class",
]
ZERO_CENTRED = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # RMSNorm weights stored as scale - 1
FIRST_ATTENTION = {"qwen3": 0, "qwen3_next": 1, "qwen3_5": 1, "qwen3_5_moe": 1}  # mimicked


def write_mtp(target_dir: Path, family: str, layout: str = "mtp", noise: float = 0.01,
              hidden_mix: float = 0.02, into: str = "mtp.safetensors", seed: int = 0) -> dict:
    """Write the MTP tensors of the target in `target_dir` and return them (name -> numpy):
    layout "mtp" (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.layers.0.*`, `mtp.norm`: Qwen3-Next /
    Qwen3.5) or "deepseek" (`model.layers.{N}.eh_proj / enorm / hnorm / shared_head.norm` and
    the layer, plus copies of the embeddings and head), into `into` (a new file, or
    "model.safetensors": inside the target's own, as the hub ships them). The head mimics the
    target's first attention layer run on the next token's embedding (the target's other
    layers are damped, `damp_layers`): the layer and final norm are the target's (with relative
    `noise`), `fc` = [I | hidden_mix I] and the embedding's norm at the embeddings' scale."""
    import json

    import numpy as np
    from safetensors.numpy import load_file, save_file

    config = json.loads((target_dir / "config.json").read_text())
    n_layers, size = config["num_hidden_layers"], config["hidden_size"]
    weights = load_file(str(target_dir / "model.safetensors"))
    weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    first = FIRST_ATTENTION[family]
    prefix = f"model.layers.{first}."
    rng = np.random.default_rng(seed)

    def noisy(v):
        return (v * (1 + noise * rng.standard_normal(v.shape))).astype(v.dtype)

    layer = {k[len(prefix):]: noisy(v) for k, v in weights.items() if k.startswith(prefix)}
    zero = 1.0 if family in ZERO_CENTRED else 0.0  # stored = scale - zero ... as the model's
    embed = weights["model.embed_tokens.weight"]
    rms = float(np.sqrt(np.mean(embed ** 2)))
    fc = np.concatenate([np.eye(size), hidden_mix * np.eye(size)], axis=1).astype(np.float32)
    norms = {"pre_fc_norm_embedding": np.full(size, rms - zero, np.float32),
             "pre_fc_norm_hidden": np.full(size, 1.0 - zero, np.float32),
             "norm": noisy(weights["model.norm.weight"])}
    if layout == "mtp":
        out = {"mtp.fc.weight": noisy(fc), **{f"mtp.{k}.weight": v for k, v in norms.items()},
               **{f"mtp.layers.0.{k}": v for k, v in layer.items()}}
    else:
        base = f"model.layers.{n_layers}."
        names = {"pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
                 "norm": "shared_head.norm"}
        out = {base + "eh_proj.weight": noisy(fc),
               **{base + names[k] + ".weight": v for k, v in norms.items()},
               **{base + k: v for k, v in layer.items()},
               base + "embed_tokens.weight": embed,
               base + "shared_head.head.weight": weights["lm_head.weight"]}
    if into == "model.safetensors":
        save_file({**weights, **out}, str(target_dir / into), metadata={"format": "pt"})
    else:
        save_file(out, str(target_dir / into), metadata={"format": "pt"})
    return out


def damp_layers(directory: Path, damp: float, keep: int) -> None:
    """Scale the writes to the residual stream (attention / recurrence outputs and MLP down
    projections) of every layer but layer `keep` by `damp`, in place: the model leans on that
    layer over its embeddings, which an MTP head can mimic (`write_mtp`)."""
    from safetensors.numpy import load_file, save_file

    path = directory / "model.safetensors"
    weights = load_file(str(path))
    for name, value in weights.items():
        if ".layers." in name and f".layers.{keep}." not in name and name.endswith(
                ("o_proj.weight", "down_proj.weight", "out_proj.weight", "down_proj")):
            weights[name] = (value * damp).astype(value.dtype)
    save_file(weights, str(path), metadata={"format": "pt"})


# EAGLE-3 heads (tests/test_eagle.py): a speculators-format directory for a target, trained a
# little here on the target's own distributions so that it agrees with it on some positions
EAGLE_LAYERS = [1, 2, 3]  # the target layers whose input it reads (4-layer targets)


def write_eagle3(target_dir: Path, out: Path, kept: int = 256, steps: int = 150,
                 seed: int = 0) -> Path:
    """Write a speculators EAGLE-3 directory for the target in `target_dir` to `out`: config
    (one Llama layer of the target's size, `kept` draft-vocabulary tokens: the target's most
    likely ones over the corpus, the last of them padding ids) and tensors from
    tests/eagle_reference.py's module, trained `steps` Adam steps to match the target's next-
    next-token distribution restricted to the kept tokens."""
    import json

    import numpy as np
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.eagle_reference import Eagle3Reference

    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    size = target.config.hidden_size
    config = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": size, "num_hidden_layers": 1,
            "intermediate_size": 2 * size, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": size // 4, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "vocab_size": target.config.vocab_size},
        "draft_vocab_size": kept, "norm_before_residual": False, "target_hidden_size": size,
        "eagle_aux_hidden_state_layer_ids": EAGLE_LAYERS,
    }
    ids = [tok.encode(line) for line in _corpus() if line.strip()]
    stream = np.array([i for line in ids for i in line], dtype=np.int64)
    windows = torch.from_numpy(np.stack([stream[s : s + 24] for s in
                                         range(0, len(stream) - 25, 12)]))
    with torch.no_grad():
        counts = torch.zeros(target.config.vocab_size)
        for chunk in windows.split(256):
            counts += target(chunk).logits.softmax(-1).sum((0, 1))
    keep = sorted(counts.argsort(descending=True)[:kept].tolist())
    head = Eagle3Reference(config, target.model.embed_tokens.weight, keep)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        x = windows[torch.randint(0, len(windows), (16,))]
        with torch.no_grad():
            run = target(x, output_hidden_states=True)
            states = torch.cat([run.hidden_states[i] for i in EAGLE_LAYERS], dim=-1)
            p = run.logits[:, 1:, keep].softmax(-1)  # the target at t + 1, on the kept tokens
        logits, _, _ = head(x[:, 1:], states[:, :-1])
        logq = logits[..., keep].log_softmax(-1)
        loss = F.kl_div(logq.flatten(0, 1), p.flatten(0, 1), reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        opt.step()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(head.tensors(), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# DFlash block drafters (tests/test_dflash.py, tests/test_drafters.py): a reference-layout
# directory for a target, trained a little here (training/dflash.py) on the target's own
# distributions so that it agrees with it on some positions
DFLASH_LAYERS = [0, 2]  # the target layers whose output it reads (4-layer targets)


def write_dflash(target_dir: Path, out: Path, version: int = 1, block_size: int = 16,
                 steps: int = 150, seed: int = 0) -> Path:
    """Write a DFlash (version 1) or DFlash2 drafter of one layer for the target in
    `target_dir` to `out`: mask token the target's last (padding) id, `steps` Adam steps of
    training/dflash.py's distillation on 40-token windows of the corpus."""
    import numpy as np
    from transformers import AutoTokenizer

    from tinydraft_mlx import load_models
    from training.dflash import distil, drafter_config, new_drafter, rows_of, save

    target, _, _ = load_models(str(target_dir), "none", dtype="float32")
    tok = AutoTokenizer.from_pretrained(target_dir)
    config = drafter_config(target, block_size=block_size, mask_token_id=TARGET_WIDTH - 1,
                            layers=1, target_layer_ids=DFLASH_LAYERS, version=version)
    draft = new_drafter(target, config, seed)
    stream = np.array([i for line in _corpus() if line.strip() for i in tok.encode(line)])
    windows = np.stack([stream[s : s + 40] for s in range(0, len(stream) - 41, 10)])
    distil(draft, target, rows_of(windows), steps=steps, seed=seed)
    return save(draft, config, out)

"""Record the reference outputs tests/test_dflash.py compares our DFlash drafters with.

The reference is z-lab's `dflash` package, version 0.1.0 (its PyTorch `DFlashDraftModel` and
`DFlash2DraftModel`). It pins versions of tqdm, datasets and requests that conflict with this
project's, so it is not part of the test extra; this script, run where it is installed
(`pip install --no-deps dflash==0.1.0` beside torch and transformers), writes for each of
DFlash and DFlash2 a tiny random drafter in the reference's checkpoint layout (config.json,
model.safetensors; DFlash2's codebooks under the hub's names, without ".weight") and beside it
`<name>.safetensors`: a fake target's embedding table and LM head, context states, a block,
and what the reference computes from them:

- `logits`: `compute_logits` of the drafter's block states (positions 1 .. L - 1), the context
  covering positions 0 .. N - 1 and the block N .. N + L - 1;
- DFlash2: `path`, `candidates`, `q`: its candidate selector's walk at temperature `T` (a
  sampled path, the candidates per position and the q each proposal was drawn from).

    python tests/dflash_reference/make.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).parent
VOCAB, SIZE, LAYERS, TARGET_LAYERS = 64, 32, 2, 6
CONTEXT, BLOCK, MASK, T = 11, 8, 3, 0.7


def config(version: int) -> dict:
    extra = {"block_size": BLOCK, "mask_token_id": MASK, "target_layer_ids": [1, 3],
             "output_multiplier": 1.25, "input_embedding_scale": 0.9}
    if version == 2:
        extra.update(conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5)
    return {
        "architectures": ["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"],
        "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": SIZE,
        "intermediate_size": 2 * SIZE, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "num_target_layers": TARGET_LAYERS,
        "attention_bias": False, "tie_word_embeddings": False, "dflash_config": extra,
    }


def record(version: int) -> None:
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    from transformers import Qwen3Config

    torch.manual_seed(version)
    raw = config(version)
    c = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures",)})
    c.num_target_layers, c.dflash_config = TARGET_LAYERS, raw["dflash_config"]
    model = (DFlash2DraftModel if version == 2 else DFlashDraftModel)(c).eval()
    with torch.no_grad():  # every tensor set here: some are left uninitialised (torch.empty)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    embed, head = 0.5 * torch.randn(VOCAB, SIZE), 0.5 * torch.randn(VOCAB, SIZE)
    context = torch.randn(1, CONTEXT, 2 * SIZE)
    block = torch.tensor([[17] + [MASK] * (BLOCK - 1)])
    output = torch.nn.Linear(SIZE, VOCAB, bias=False)
    output.weight.data.copy_(head)
    with torch.no_grad():
        states = model(target_hidden=context,
                       noise_embedding=torch.nn.functional.embedding(block, embed) * 0.9,
                       position_ids=torch.arange(CONTEXT + BLOCK)[None])[:, 1:]
        logits = model.compute_logits(states, output)
        out = {"embed": embed, "head": head, "context": context, "block": block.int(),
               "logits": logits}
        if version == 2:
            torch.manual_seed(11)
            path, candidates, q = model.propose(states, block[:, 0], output, T)
            out.update(path=path.int(), candidates=candidates.int(), q=q)
    where = HERE / ("dflash2" if version == 2 else "dflash")
    where.mkdir(exist_ok=True)
    (where / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in ("predecessor_codebook", "successor_codebook"):  # the hub's names
        key = f"candidate_selector.{name}"
        if key + ".weight" in tensors:
            tensors[key] = tensors.pop(key + ".weight")
    save_file(tensors, str(where / "model.safetensors"), metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in out.items()}, str(where.with_suffix(".safetensors")))


if __name__ == "__main__":
    for version in (1, 2):
        record(version)

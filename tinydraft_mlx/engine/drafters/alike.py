"""Drafters quantized as their target is: a drafter's float weights beside a 4-bit body would
read several times the bytes per parameter the body does, and a drafter pays only where its
step costs a fraction of the target's. Used where a drafter's checkpoint is float and its
target quantized: a DFlash drafter, an EAGLE-3 head, the MTP layer read from an original
checkpoint beside a conversion."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import hidden


def target_quantization(target: nn.Module) -> dict | None:
    """The target's {"group_size", "bits", "mode"} where its embeddings are quantized (as
    mlx-lm's conversions quantize them with the body), else None."""
    table = hidden.embeddings(target)
    if isinstance(table, nn.QuantizedEmbedding):
        return {"group_size": table.group_size, "bits": table.bits,
                "mode": getattr(table, "mode", "affine")}
    return None


def quantize(module: nn.Module, group_size: int, bits: int, mode: str = "affine",
             stored: dict[str, mx.array] | None = None) -> None:
    """Quantize `module`'s linear layers in place: those a checkpoint stores quantized
    (`stored`'s `.scales`), else every one whose input width the group size divides."""
    def chosen(path: str, layer: nn.Module) -> bool:
        if stored is not None:
            return f"{path}.scales" in stored
        return isinstance(layer, nn.Linear) and layer.weight.shape[-1] % group_size == 0

    nn.quantize(module, group_size=group_size, bits=bits, mode=mode, class_predicate=chosen)


def quantize_alike(module: nn.Module, target: nn.Module) -> bool:
    """Quantize `module` as `target` is, where it is; whether it was."""
    alike = target_quantization(target)
    if alike is None:
        return False
    quantize(module, alike["group_size"], alike["bits"], alike["mode"])
    return True

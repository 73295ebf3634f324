"""`python -m tinydraft_mlx.convert`: a checkpoint converted as mlx-lm converts it, keeping the
MTP layer it ships.

    python -m tinydraft_mlx.convert --hf-path Qwen3.5-9B --mlx-path Qwen3.5-9B-4bit -q
    python -m tinydraft_mlx.convert --mlx-path mlx-community/...-4bit --mtp-from Qwen3.5-9B

The body is mlx-lm's own conversion (`mlx_lm.convert.convert`: its flags, its quantization, its
files), so `mlx_lm.load` reads the result as any conversion. Qwen3-Next and Qwen3.5 checkpoints
ship an MTP layer (`mtp.*`) that mlx-lm's conversion drops; here it is built as the drafter
(engine/drafters/mtp.py: the target's own layer class, its norms shifted, its experts stacked),
quantized as the body is (the body's group size, bits and mode; `--mtp-dtype original` keeps it
in the body's float dtype instead), and written to `mtp.safetensors` beside the body: a file
mlx-lm does not read (it loads `model*.safetensors`), which `load_models(OUT, "mtp")` and
`--draft mtp` do. Its metadata says what it holds (`tinydraft_mtp`: the head's own parameters,
`quantization`: how).

`--mtp-from ORIGINAL` adds the MTP layer of an original checkpoint to an existing conversion
(e.g. an mlx-community 4-bit directory), quantized as that body is, after checking that the layer
belongs to that body: the original's token embeddings, quantized (or cast) as the body's are,
must equal the body's (a fingerprint no other checkpoint of the same shapes passes), and the
layer must fit the body's config (shapes). A refusal is one line.

Nothing is left half-written: the conversion is built in a sibling directory and renamed into
place at the end, `mtp.safetensors` written to a temporary file and renamed; on any failure
they are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

FORMAT = "head"  # the `tinydraft_mtp` metadata of a converted MTP file
FILE = "mtp.safetensors"
FINGERPRINT_TOLERANCE = 1e-3  # relative, on the embeddings (module docstring)


class ConvertError(ValueError):
    """What stops a conversion, in one sentence."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tinydraft_mlx.convert",
        description="Convert a checkpoint as mlx-lm does, keeping its MTP layer.")
    p.add_argument("--hf-path", "--model", help="the original checkpoint (a directory)")
    p.add_argument("--mlx-path", default="mlx_model", help="where to write the conversion "
                   "(with --mtp-from: the existing conversion to add the MTP layer to)")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize the body (and the "
                   "MTP layer alike)")
    p.add_argument("--q-group-size", type=int, default=None, help="as mlx_lm.convert")
    p.add_argument("--q-bits", type=int, default=None, help="as mlx_lm.convert")
    p.add_argument("--q-mode", default="affine", help="as mlx_lm.convert")
    p.add_argument("--quant-predicate", default=None,
                   help="a mixed recipe of mlx_lm.convert (the MTP layer takes its default)")
    p.add_argument("--dtype", default=None, help="as mlx_lm.convert")
    p.add_argument("--mtp-dtype", choices=("quantized", "original"), default="quantized",
                   help="the MTP layer quantized as the body (default) or in its float dtype")
    p.add_argument("--mtp-from", default=None, help="add the MTP layer of this original "
                   "checkpoint to the conversion at --mlx-path")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.mtp_from is not None:
            body = Path(args.mlx_path)
            if not (body / "config.json").exists():
                raise ConvertError(f"--mlx-path {str(body)!r} is not a conversion (no "
                                   "config.json)")
            add_mtp(body, Path(args.mtp_from), keep_dtype=args.mtp_dtype == "original")
        else:
            if args.hf_path is None:
                raise ConvertError("--hf-path is required (or --mtp-from with --mlx-path)")
            convert(Path(args.hf_path), Path(args.mlx_path), quantize=args.quantize,
                    q_group_size=args.q_group_size, q_bits=args.q_bits, q_mode=args.q_mode,
                    quant_predicate=args.quant_predicate, dtype=args.dtype,
                    keep_dtype=args.mtp_dtype == "original")
    except (ConvertError, ValueError, OSError) as err:
        print(f"tinydraft-mlx convert: error: {err}", file=sys.stderr)
        return 2
    return 0


def convert(original: Path, out: Path, *, quantize: bool = False, q_group_size: int | None = None,
            q_bits: int | None = None, q_mode: str = "affine", quant_predicate: str | None = None,
            dtype: str | None = None, keep_dtype: bool = False) -> Path:
    """`original` converted into `out` (see the module docstring); returns `out`."""
    from mlx_lm.convert import convert as mlx_lm_convert

    from ..engine.drafters.mtp import MtpError

    if out.exists():
        raise ConvertError(f"--mlx-path {str(out)!r} exists; remove it or choose another")
    if not (original / "config.json").exists():
        raise ConvertError(f"--hf-path {str(original)!r} is not a checkpoint directory (no "
                           "config.json)")
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    staged = out.parent / f".{out.name}.source-{os.getpid()}"
    try:
        print(f"[tinydraft-mlx] converting the body with mlx-lm into {partial}", flush=True)
        source = _staged(original, staged)
        mlx_lm_convert(str(source), str(partial), quantize=quantize, q_group_size=q_group_size,
                       q_bits=q_bits, q_mode=q_mode, quant_predicate=quant_predicate,
                       dtype=dtype)
        try:
            add_mtp(partial, original, keep_dtype=keep_dtype, check=False)
        except MtpError as err:
            if "has no MTP tensors" not in str(err):
                raise
            print(f"[tinydraft-mlx] {original} has no MTP tensors: the body alone", flush=True)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    print(f"[tinydraft-mlx] wrote {out}", flush=True)
    return out


def _staged(original: Path, staged: Path) -> Path:
    """`original` as mlx-lm reads it: itself, or where its config needs the keys mlx-lm reads
    at the top level (`loading.config_overrides`: transformers 5's forms), a directory of links
    to its files with that config (the conversion then carries it, and loads in mlx-lm)."""
    from ..generation.loading import config_overrides

    config = json.loads((original / "config.json").read_text())
    overrides = config_overrides(config)
    if not overrides:
        return original
    staged.mkdir()
    for item in original.iterdir():
        if item.name != "config.json":
            (staged / item.name).symlink_to(item.resolve())
    (staged / "config.json").write_text(json.dumps({**config, **overrides}, indent=2))
    return staged


def add_mtp(body: Path, original: Path, *, keep_dtype: bool = False, check: bool = True) -> Path:
    """Write the MTP layer of `original` beside the conversion in `body` (`mtp.safetensors`),
    quantized as the body is unless `keep_dtype`; `check`: first refuse a layer that does not
    belong to this body (the module docstring's fingerprint). Returns the file."""
    from mlx_lm.utils import load_model

    from ..engine import hidden
    from ..engine.drafters.mtp import build_head, read_tensors

    target, config = load_model(body, lazy=True)
    layers = getattr(hidden.text_model(target).args, "num_hidden_layers", -1)
    weights = read_tensors(original, layers)
    if not weights:
        from ..engine.drafters.mtp import MtpError

        raise MtpError(f"{str(original)!r} has no MTP tensors (looked for 'mtp.*' and "
                       f"'model.layers.{layers}.*')")
    if check:
        check_belongs(target, original)
    print(f"[tinydraft-mlx] building the MTP layer ({len(weights)} tensors)", flush=True)
    head = build_head(target, weights, alike=False)
    quantization = None if keep_dtype else config.get("quantization")
    if quantization:
        quantization = {k: quantization[k] for k in ("group_size", "bits", "mode")
                        if k in quantization}
        size = quantization["group_size"]
        nn.quantize(head, size, quantization["bits"], mode=quantization.get("mode", "affine"),
                    class_predicate=lambda _, m: hasattr(m, "to_quantized")
                    and m.weight.shape[-1] % size == 0)
    params = {f"mtp.{name}": value for name, value in tree_flatten(head.parameters())}
    path = body / FILE
    temporary = body / f".mtp.partial-{os.getpid()}.safetensors"  # MLX keeps the suffix
    try:
        mx.save_safetensors(str(temporary), params, metadata={
            "format": "mlx", "tinydraft_mtp": FORMAT,
            "quantization": json.dumps(quantization or {})})
        temporary.rename(path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    kind = (f"{quantization['bits']}-bit, group {quantization['group_size']}" if quantization
            else str(next(iter(params.values())).dtype))
    print(f"[tinydraft-mlx] wrote the MTP layer ({kind}) to {FILE}", flush=True)
    return path


def check_belongs(target: nn.Module, original: Path) -> None:
    """ConvertError unless `original`'s token embeddings, quantized or cast as the body's are,
    equal the body's (to FINGERPRINT_TOLERANCE of their scale)."""
    from ..engine import hidden

    mine = hidden.embeddings(target)
    theirs = _original_embeddings(original)
    if theirs is None:
        raise ConvertError(f"--mtp-from {str(original)!r} has no token embeddings to check "
                           "against the body")
    if isinstance(mine, nn.QuantizedEmbedding):
        size, bits, mode = mine.group_size, mine.bits, getattr(mine, "mode", "affine")
        packed = mx.quantize(theirs.astype(mx.float32), size, bits, mode=mode)
        theirs = mx.dequantize(*packed, group_size=size, bits=bits, mode=mode)
        body = mx.dequantize(mine.weight, mine.scales, getattr(mine, "biases", None),
                             group_size=size, bits=bits, mode=mode)
    else:
        body = mine.weight
    if theirs.shape != body.shape:
        raise ConvertError(f"--mtp-from {str(original)!r} does not belong to this body: its "
                           f"embeddings are {tuple(theirs.shape)}, the body's "
                           f"{tuple(body.shape)}")
    scale = float(mx.abs(body.astype(mx.float32)).max()) or 1.0
    gap = float(mx.abs(theirs.astype(mx.float32) - body.astype(mx.float32)).max())
    if gap > FINGERPRINT_TOLERANCE * scale:
        raise ConvertError(f"--mtp-from {str(original)!r} does not belong to this body: its "
                           f"embeddings differ from the body's by {gap:.3g} (scale "
                           f"{scale:.3g})")


def _original_embeddings(original: Path) -> mx.array | None:
    """The original checkpoint's token embeddings (`...embed_tokens.weight`), or None."""
    from ..engine.drafters.mtp import tensor_names

    for file in sorted(original.glob("*.safetensors")):
        names = [n for n in tensor_names(file) if n.endswith("embed_tokens.weight")
                 and not n.startswith("mtp.")]
        if names:
            return mx.load(str(file))[sorted(names, key=len)[0]]
    return None

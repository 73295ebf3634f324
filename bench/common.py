"""What every benchmark records about the machine it ran on. Import this module before anything
that imports mlx.core: importing tinydraft_mlx first lets its BLAS preload take effect."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import tinydraft_mlx  # isort: skip  (before mlx.core, for the BLAS preload)
import mlx.core as mx
import mlx_lm


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.machine(),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "tinydraft_mlx": tinydraft_mlx.__version__,
        "blas": tinydraft_mlx.active_blas(),
    }


ROOT = Path(__file__).resolve().parents[1]


def model_dtype(model) -> str:
    """The dtype the model really computes in, read from its weights: e.g. "float32", or
    "bfloat16, 4-bit quantized" (never assumed from the device)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    floats = sorted({str(w.dtype).removeprefix("mlx.core.") for _, w in
                     tree_flatten(model.parameters()) if mx.issubdtype(w.dtype, mx.floating)})
    bits = sorted({m.bits for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)})
    return "/".join(floats) + (f", {'/'.join(map(str, bits))}-bit quantized" if bits else "")


def module_of(script: str | Path) -> str:
    """The module a script of this repository runs as (`python -m <module>` from its root):
    bench/batch.py -> bench.batch."""
    path = Path(script).resolve()
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def command(script: str | Path, settings: dict) -> str:
    """The command line of `script` (its path, or its module) that gives `settings` (argparse
    destinations, in order): a list as its values, True as the bare flag, False left out."""
    module = module_of(script) if str(script).endswith(".py") else str(script)
    parts = [f"python -m {module}"]
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parts += [flag] if value else []
        else:
            values = value if isinstance(value, (list, tuple)) else [value]
            parts.append(" ".join([flag, *map(str, values)]))
    return " ".join(parts)


def save(report: dict, name: str, plot) -> Path:
    """Write results/<name>.json and, through `plot(report, path)`, results/<name>.png."""
    out = ROOT / "results" / f"{name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    return out


def finish_figure(plt, fig, path: Path, report: dict, what: str, detail: str,
                  fontsize: int = 12) -> None:
    """Title a figure with what it shows, the report's dtype, device and BLAS, and `detail`;
    write it to `path`."""
    m = report["machine"]
    fig.suptitle(f"{what}, {report['settings']['dtype']}, {m['device']}, BLAS "
                 f"{m['blas'].split(' ')[0]}; {detail}", fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pair_parser(description: str, *, prompts: int, max_tokens: int) -> argparse.ArgumentParser:
    """A parser with the flags the pair benchmarks share: --target and --draft (default: the demo
    pair), --ks, --prompts, --max-tokens."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    return ap


def in_fresh_process(script: str, *args: object, timeout: float = 900) -> dict:
    """Run `python -m <script's module> --worker ARGS...` offline in a process of its own (one
    generation stream per process: two in one slow both) and return the JSON its last line of
    output holds."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", module_of(script), "--worker",
                           *map(str, args)], env=env, cwd=ROOT, check=True,
                          capture_output=True, text=True, timeout=timeout)
    return json.loads(done.stdout.strip().splitlines()[-1])

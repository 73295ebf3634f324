"""What `k="auto"` has learned about a pair, kept across processes: a JSON file in the user's cache
directory, so that a new process (every CLI run) starts from the round costs and acceptance its
predecessors measured instead of learning them again.

An entry is keyed by everything its numbers depend on: the target's and the draft's fingerprints
(their class, configuration, parameter shapes and dtypes, and a sample of their weights), the
device, the target's dtype, this machine and MLX's version. An entry from another machine,
device, dtype or model is never used (its key differs); a file that cannot be read, from another
version or not ours, is ignored (and replaced at the next save), never trusted in part.

`TINYDRAFT_POLICY_FILE`: the file's path; "off" (or "0", "") turns persistence off. Default:
$XDG_CACHE_HOME/tinydraft-mlx/policies.json (~/.cache when unset).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import weakref
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

VERSION = 3  # 3: acceptance as decayed accepted / reached counts, costs per batch size bucket
ENV = "TINYDRAFT_POLICY_FILE"
MAX_ENTRIES = 64  # pairs kept in the file; the least recently saved go first
SAMPLE = 256  # weight values per sampled tensor in a fingerprint

log = logging.getLogger("tinydraft_mlx.policy")
# id(model) -> (a weak reference to it, its fingerprint): by id, since an MLX module is a dict
# (unhashable), so a WeakKeyDictionary never kept one and every call hashed the model again
_FINGERPRINTS: dict[int, tuple[weakref.ref, str]] = {}


def policy_path() -> Path | None:
    """The policy file, or None when persistence is off."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "none") else Path(value)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "tinydraft-mlx" / "policies.json"


def fingerprint(model: object) -> str:
    """A short hash that tells models apart: class, configuration, every parameter's name,
    shape and dtype, and the first SAMPLE values of the first, middle and last parameters.
    Computed once per model object."""
    held = _FINGERPRINTS.get(id(model))
    if held is not None and held[0]() is model:
        return held[1]
    h = hashlib.sha256(type(model).__name__.encode())
    args = getattr(model, "args", None)
    if args is not None:
        h.update(repr(sorted(vars(args).items()) if hasattr(args, "__dict__") else args).encode())
    params = tree_flatten(model.parameters()) if hasattr(model, "parameters") else []
    for name, value in params:
        h.update(f"{name}:{tuple(value.shape)}:{value.dtype}".encode())
    picks = [params[i][1] for i in sorted({0, len(params) // 2, len(params) - 1})] if params \
        else []
    for value in picks:
        flat = value.reshape(-1)[:SAMPLE]
        if mx.issubdtype(flat.dtype, mx.floating):
            flat = flat.astype(mx.float32)
        h.update(np.asarray(flat).tobytes())
    out = h.hexdigest()[:16]
    try:
        ref = weakref.ref(model, _forget)
    except TypeError:  # not weak-referenceable: computed again next time
        return out
    _FINGERPRINTS[id(model)] = (ref, out)
    return out


def forget_fingerprints() -> None:
    """Drop every fingerprint computed in this process (computed again when next needed)."""
    _FINGERPRINTS.clear()


def _forget(ref: weakref.ref) -> None:
    """A fingerprinted model is gone: its id may be another's next."""
    for i, (held, _) in list(_FINGERPRINTS.items()):
        if held is ref:
            del _FINGERPRINTS[i]


def float_dtypes(model: object) -> str:
    """The floating dtypes of a model's parameters, e.g. "float32" or "bfloat16"."""
    params = tree_flatten(model.parameters()) if hasattr(model, "parameters") else []
    return "/".join(sorted({str(v.dtype).removeprefix("mlx.core.") for _, v in params
                            if mx.issubdtype(v.dtype, mx.floating)}))


def pair_key(target: object, draft: object) -> str:
    """The key of a (target, draft) pair on this machine and device: `draft` is the draft model
    or the string a model-free drafter goes by."""
    parts = {
        "target": fingerprint(target),
        "draft": draft if isinstance(draft, str) else fingerprint(draft),
        "device": str(mx.default_device()),
        "dtype": float_dtypes(target),
        "machine": [platform.node(), platform.machine(), platform.system(), _device_name()],
        "mlx": mx.__version__,
    }
    return json.dumps(parts, sort_keys=True)


def _device_name() -> str:
    """The default device's name as MLX reports it (the chip on Apple silicon, the GPU under
    CUDA, the CPU's family otherwise). Not `platform.processor()`: it runs `uname -p` in a
    subprocess, 4.8 ms at a process's first k="auto" generation, before its first token."""
    info = getattr(mx, "device_info", None)
    try:
        return str(info().get("device_name", "")) if info is not None else ""
    except Exception:  # noqa: BLE001 (a backend without the query: the rest of the key stands)
        return ""


def load_entry(key: str, path: Path | None = None) -> dict[str, Any] | None:
    """The entry saved under `key`, or None (no file, no entry, persistence off, a file that
    cannot be read as ours)."""
    path = policy_path() if path is None else path
    if path is None:
        return None
    entries = _read(path)
    entry = entries.get(key)
    return entry if isinstance(entry, dict) else None


def save_entry(key: str, entry: dict[str, Any], path: Path | None = None) -> None:
    """Write `entry` under `key` (atomically: a reader never sees half a file). Failing to write
    (a read-only home) is logged once and otherwise ignored: persistence is an optimisation."""
    path = policy_path() if path is None else path
    if path is None:
        return
    try:
        entries = _read(path)
        entries.pop(key, None)
        entries[key] = entry
        while len(entries) > MAX_ENTRIES:
            entries.pop(next(iter(entries)))
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False,
                                         suffix=".tmp") as f:
            json.dump({"version": VERSION, "entries": entries}, f)
        os.replace(f.name, path)
    except OSError as err:
        warn_once(f"k='auto' could not save what it learned to {path}: {err}")


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        warn_once(f"ignoring the k='auto' policy file {path}: {err}")
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(
            data.get("entries"), dict):
        warn_once(f"ignoring the k='auto' policy file {path}: not version {VERSION} of ours")
        return {}
    return data["entries"]


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)

"""The package's shape: imports flow one way (no module imports, directly or through others,
a module that imports it, counting imports inside functions too), every module is under 600
lines, and no code outside the drafters' own modules tests a drafter's type."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tinydraft_mlx

ROOT = Path(tinydraft_mlx.__file__).parent
PACKAGE = "tinydraft_mlx"
MAX_LINES = 600
# the drafters' own modules (engine/drafters/, and the target's states a head reads): the only
# ones that may ask what kind of drafter an object is
DRAFTERS = ("engine.drafters", "engine.hidden")
DRAFTER_TYPES = ("StateHead", "MtpHead", "Eagle3Head", "HeadCache", "HeadChain", "ModelChain",
                 "ModelDraft", "HeadDraft", "LookupDraft", "HybridDraft", "NoDraft", "Hybrid",
                 "PromptLookup")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports, anywhere in its file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith(PACKAGE):
                module = node.module[len(PACKAGE) + 1:]
            else:
                continue
            for alias in node.names:  # `from . import forward` names a module
                sub = f"{module}.{alias.name}" if module else alias.name
                found.add(sub if sub in known else module)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name[len(PACKAGE) + 1:])
    return {m for m in found if m in known and m != name}


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    # package __init__ files re-export their modules: an edge into an __init__ is one into it
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt == "" or (node.startswith(nxt + ".") or nxt == ""):
                continue  # a module importing its own package's __init__
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(
                    stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_every_module_is_under_600_lines():
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_drafter_type_is_tested_outside_the_drafters_modules():
    pattern = re.compile(r"isinstance\([^)]*\b(" + "|".join(DRAFTER_TYPES) + r")\b")
    found = [f"{name}:{i}" for name, path in _modules().items() if not name.startswith(DRAFTERS)
             for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found

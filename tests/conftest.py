from __future__ import annotations

import pytest

import tinydraft_mlx  # noqa: F401  (first: its BLAS preload must precede any `import mlx.core`)
from tests.fixtures import build_other_tokenizer, build_pair, build_unrelated


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Directories of the tiny target/draft pair and two incompatible drafts."""
    root = tmp_path_factory.mktemp("checkpoints")
    target, draft = build_pair(root)
    return {
        "target": target,
        "draft": draft,
        "unrelated": build_unrelated(root),
        "other_tokenizer": build_other_tokenizer(root),
    }


@pytest.fixture(scope="session")
def pair(checkpoints):
    """(target, draft, tokenizer) loaded through tinydraft_mlx.load_models."""
    from tinydraft_mlx import load_models

    return load_models(str(checkpoints["target"]), str(checkpoints["draft"]))


@pytest.fixture(scope="session")
def oracle(checkpoints):
    from tests.oracle import Oracle

    return Oracle(checkpoints["target"])

"""Shared fixtures, and which device each test runs on.

- `TINYDRAFT_TEST_DEVICE=cpu|gpu` sets MLX's default device for the whole run; unset, MLX's own
  default is used (the GPU on a Mac, the CPU on Linux). The pytest header says which.
- Oracle and exactness tests compare against transformers on the CPU in float32, so they pin
  CPU + float32: modules that need it say `pytestmark = pytest.mark.usefixtures("cpu_fp32")`,
  and the models they use are loaded with dtype="float32".
- CPU-only tests (the skinny matmul, the BLAS preload) carry `@pytest.mark.cpu_only` and skip
  with the reason when the run's device is not the CPU.
- Every other test runs on the run's default device.

Each checkpoint is loaded once per session through `load` (several tests share a pair).
"""

from __future__ import annotations

import os
import sys

import pytest

import tinydraft_mlx  # noqa: F401  (first: its BLAS preload must precede any `import mlx.core`)
from tests.fixtures import (
    build_other_tokenizer,
    build_pair,
    build_unrelated,
    build_wide_draft,
)

DEVICE_ENV = "TINYDRAFT_TEST_DEVICE"


def _own_kernel_directory() -> None:
    """A pytest-xdist worker compiles MLX's CPU kernels into a temp directory of its own: MLX
    keeps them under the temp directory by name, and two processes compiling the same kernel
    at once could load each other's half-written library."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        import tempfile

        path = os.path.join(tempfile.gettempdir(), f"tinydraft-tests-{worker}")
        os.makedirs(path, exist_ok=True)
        os.environ["TMPDIR"] = path
        tempfile.tempdir = None


_own_kernel_directory()


def _run_device():
    import mlx.core as mx

    choice = os.environ.get(DEVICE_ENV, "").strip().lower()
    if not choice:
        return mx.default_device()
    if choice not in ("cpu", "gpu"):
        raise pytest.UsageError(f"{DEVICE_ENV} must be 'cpu' or 'gpu' (got {choice!r})")
    if choice == "gpu" and not mx.is_available(mx.gpu):
        raise pytest.UsageError(f"{DEVICE_ENV}=gpu but this MLX build has no GPU backend")
    return mx.gpu if choice == "gpu" else mx.cpu


def pytest_configure(config):
    import mlx.core as mx

    # k="auto"'s policy file is off unless a test turns it on (with its own path): a user's file
    # must neither shape the tests nor be written by them (subprocesses inherit this)
    os.environ["TINYDRAFT_POLICY_FILE"] = "off"
    mx.set_default_device(_run_device())
    config.addinivalue_line("markers", "cpu_only: needs MLX's CPU backend (skipped elsewhere)")


def pytest_report_header(config):
    import mlx.core as mx

    return (f"tinydraft-mlx: default device {mx.default_device()}, "
            f"BLAS {tinydraft_mlx.active_blas()}")


_exit_status: dict[str, int] = {}


def pytest_sessionfinish(session, exitstatus):
    _exit_status["code"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with the session's status, without the interpreter's teardown: MLX 0.32.4 aborts
    now and then in its C++ teardown at exit when compiled steps ran on a thread other than the
    main one (the in-process servers' generation threads; ~1 exit in 10-20, "terminate called
    without an active exception"), which would fail a green run. `python -m
    tinydraft_mlx.server` leaves the same way after its clean shutdown."""
    if "code" in _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status["code"])


def pytest_collection_modifyitems(config, items):
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return
    skip = pytest.mark.skip(reason=f"CPU-only (skinny matmul / BLAS); this run's device is "
                                   f"{mx.default_device()}")
    for item in items:
        if item.get_closest_marker("cpu_only"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_auto_policy():
    """Every test starts from a clean k="auto" state: what one test's generations taught a
    pair's policy (held per process) must not shape the next test's rounds."""
    from tinydraft_mlx.engine.policy import forget_pairs

    forget_pairs()
    yield


@pytest.fixture
def cpu_fp32():
    """Run the test on MLX's CPU backend (the oracle's device and precision)."""
    import mlx.core as mx

    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Directories of the tiny target/draft pair, two incompatible drafts and a draft whose
    vocabulary is wider than the target's."""
    root = tmp_path_factory.mktemp("checkpoints")
    target, draft = build_pair(root)
    return {
        "target": target,
        "draft": draft,
        "unrelated": build_unrelated(root),
        "other_tokenizer": build_other_tokenizer(root),
        "wide_draft": build_wide_draft(root),
    }


@pytest.fixture(scope="session")
def load(checkpoints):
    """load(target, draft="none", dtype="float32") -> (target, draft, tokenizer), loaded once
    per session through tinydraft_mlx.load_models. Names are keys of `checkpoints` or paths."""
    from tinydraft_mlx import load_models

    loaded = {}

    def _load(target: str, draft: str = "none", dtype: str | None = "float32"):
        key = (str(target), str(draft), dtype)
        if key not in loaded:
            paths = [str(checkpoints.get(name, name)) for name in (target, draft)]
            loaded[key] = load_models(*paths, dtype=dtype)
        return loaded[key]

    return _load


@pytest.fixture(scope="session")
def pair(load):
    """(target, draft, tokenizer): the fixture pair in float32."""
    return load("target", "draft")


@pytest.fixture(scope="session")
def oracle(checkpoints):
    from tests.oracle import Oracle

    return Oracle(checkpoints["target"])


@pytest.fixture(scope="session")
def demo():
    """The bundled demo pair, float32."""
    from tinydraft_mlx import load_models

    return load_models(dtype="float32")


@pytest.fixture(scope="session")
def demo_oracle():
    from tests.oracle import Oracle
    from tinydraft_mlx.generation.loading import DEMO_DIR

    return Oracle(DEMO_DIR / "target")


@pytest.fixture(scope="session")
def eagle(tmp_path_factory):
    """A tiny Qwen3 target with every kind of drafter (tests/fixtures.py): (target dir, eagle
    dir, (target, EAGLE-3 head, tokenizer), draft model (64 ids narrower), [(ids, oracle
    greedy)] of the heads' prompts, oracle); the target's MTP layer is attached too."""
    from tests.fixtures import HEAD_PROMPTS, build_family_pair, write_eagle3, write_mtp
    from tests.oracle import Oracle
    from tinydraft_mlx import load_head, load_models

    root = tmp_path_factory.mktemp("eagle")
    target_dir, draft_dir = build_family_pair(root, "qwen3")
    write_mtp(target_dir, "qwen3")
    eagle_dir = write_eagle3(target_dir, root / "eagle3")
    target, head, tok = load_models(str(target_dir), str(eagle_dir), dtype="float32")
    load_head(target, target_dir)  # the MTP layer beside it
    _, draft, _ = load_models(str(target_dir), str(draft_dir), dtype="float32")
    oracle = Oracle(target_dir)
    refs = oracle.references(tok, HEAD_PROMPTS, 24, 1e-3, "eagle")
    return target_dir, eagle_dir, (target, head, tok), draft, refs, oracle


@pytest.fixture(scope="session")
def dflash(eagle, tmp_path_factory):
    """A DFlash block drafter (block 16, one layer, trained a little: tests/fixtures.py's
    `write_dflash`) over the `eagle` fixture's target."""
    from tests.fixtures import write_dflash
    from tinydraft_mlx.engine.drafters.dflash import load_dflash

    target_dir, target = eagle[0], eagle[2][0]
    return load_dflash(target, write_dflash(target_dir, tmp_path_factory.mktemp("dflash")))

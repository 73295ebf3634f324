"""The target tensor-parallel over 2 ranks of MLX's ring backend on 127.0.0.1 (`mlx.launch`), the
draft on each: greedy output equals the single-process output (k=4, k="auto", prompt lookup,
plain, a bounded cache), sampling without a seed completes with the ranks agreeing, a
deliberately desynchronised rank is caught by the end-of-generation checksum (not a hang), a
rank that dies ends the run, and the CLI prints once. Skipped, with the reason, only where
`mlx.launch` cannot start local ranks. Runs on the CPU in float32 (the ranks' device).

Bound on time: a collective over the local ring costs tens of ms on a 2-core machine, so each
generation is 8 tokens; the whole module takes about a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed_worker import LOOKUP, PROMPT, N
from tinydraft_mlx import generate
from tinydraft_mlx.engine.distributed import free_ports

pytestmark = pytest.mark.usefixtures("cpu_fp32")

WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def _launcher() -> str | None:
    found = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
    return found if Path(found).exists() else None


BIND_FAILED = "Couldn't bind socket"


def launch(*args: str, timeout: float = 240,
           port: int | None = None) -> subprocess.CompletedProcess:
    """`mlx.launch --backend ring --hosts 127.0.0.1 -n 2 python ARGS` on free ports (`port`: the
    starting port, else one found free). A run whose ring could not bind its port (taken between
    the check and the bind) is started again on other ports, up to three times in all: that is the
    machine's, never the product's failure."""
    for _attempt in range(1 if port is not None else 3):
        cmd = [_launcher(), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
               "--starting-port", str(port if port is not None else free_ports(2)),
               "--env", "MKL_NUM_THREADS=1", "--env", "OMP_NUM_THREADS=1", sys.executable,
               *args]  # ranks share the cores: 1 BLAS thread
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                                env=env)
        if BIND_FAILED not in result.stdout + result.stderr:
            break
    return result


@pytest.fixture(scope="module")
def ranks_work(tmp_path_factory):
    """Skip the module, with the reason, where mlx.launch cannot start two local ranks."""
    if _launcher() is None:
        pytest.skip("mlx.launch is not installed")
    probe = tmp_path_factory.mktemp("probe") / "probe.py"
    # one write per rank: with unbuffered output (PYTHONUNBUFFERED), print's pieces from the two
    # ranks interleaved ("size size 2 2") and the module was skipped on a machine where it runs
    probe.write_text("import sys\nimport mlx.core as mx\ng = mx.distributed.init()\n"
                     "total = mx.distributed.all_sum(mx.array(1), stream=mx.cpu).item()\n"
                     "sys.stdout.write(f'size {g.size()} {total}\\n')\n")
    try:
        result = launch(str(probe), timeout=60)
    except subprocess.TimeoutExpired:
        pytest.skip("mlx.launch could not start two ring ranks on 127.0.0.1 within 60 s")
    if result.stdout.count("size 2 2") != 2:
        pytest.skip(f"mlx.launch could not start two ring ranks on 127.0.0.1: "
                    f"{(result.stdout + result.stderr).strip()[-300:]}")


def run_worker(mode: str, out: Path) -> tuple[subprocess.CompletedProcess, dict]:
    result = launch(str(WORKER), str(out), mode)
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    return result, ranks


def test_two_ranks_generate_what_one_process_does(ranks_work, demo, tmp_path):
    target, draft, tok = demo
    result, ranks = run_worker("scenarios", tmp_path)
    assert set(ranks) == {0, 1}, result.stdout + result.stderr
    assert ranks[0]["size"] == 2
    expected = {
        "k4": generate(target, draft, tok, PROMPT, k=4, max_tokens=N)[0],
        "auto": generate(target, None, tok, PROMPT, max_tokens=N)[0],
        "lookup": generate(target, None, tok, LOOKUP, max_tokens=N)[0],
        "plain": generate(target, None, tok, PROMPT, max_tokens=N)[0],
        "bounded": generate(target, None, tok, PROMPT, max_tokens=N, max_kv_size=12)[0],
    }
    for name, tokens in expected.items():
        assert ranks[0][name]["tokens"] == tokens, name
        assert ranks[1][name] == ranks[0][name], name  # tokens and the rounds' k: in step
    assert sum(ranks[0]["k4"]["k_histogram"].values()) < N  # drafts were accepted
    assert ranks[0]["lookup"]["k_histogram"].get("0", 0) < N  # prompt lookup did draft
    # sampling without a seed: rank 0 chose the seed and shared it; the checksum passed
    assert ranks[0]["sampled"]["tokens"] == ranks[1]["sampled"]["tokens"]
    assert len(ranks[0]["sampled"]["tokens"]) == N


def test_a_desynchronised_rank_is_caught_by_the_checksum(ranks_work, tmp_path):
    """Each rank samples with its own seed: the forward passes still line up (plain decoding, no
    EOS), so nothing hangs, but the tokens differ: both ranks raise DesyncError."""
    result, ranks = run_worker("desync", tmp_path)
    assert set(ranks) == {0, 1}, result.stdout + result.stderr
    for r in (0, 1):
        assert "the ranks generated different tokens" in ranks[r]["desync"]


def test_a_rank_that_dies_ends_the_run(ranks_work, tmp_path):
    """Rank 1 exits after 3 tokens of a 40-token generation: rank 0 does not hang (mlx.launch
    ends it; MLX's collectives themselves have no timeout) and never completes."""
    start = time.monotonic()
    result, ranks = run_worker("die", tmp_path)
    assert time.monotonic() - start < 120
    assert ranks == {}  # neither rank completed
    log = result.stdout + result.stderr
    assert "rank 1 exited with code 3" in log and "rank 0 exited with code" in log


def test_cli_distributed_prints_once(ranks_work, demo):
    target, draft, tok = demo
    expected = tok.decode(generate(target, draft, tok, "def parse_args(", max_tokens=N)[0])
    result = launch("-m", "tinydraft_mlx.generate", "--distributed", "--prompt",
                    "def parse_args(", "--max-tokens", str(N))
    assert result.stdout.count(expected) == 1, result.stdout
    assert result.stderr.count("k=auto") == 1  # one stats line (the default k): rank 0's


def test_a_port_in_use_is_a_clear_error(ranks_work):
    """Rank 1's port is taken: the CLI says why on that rank and how to pick other ports, with no
    traceback (MLX's RuntimeError from deep inside `mx.distributed.init`), and exits with the
    CLI's status for bad input."""
    start = free_ports(2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", start + 1))
        busy.listen()
        result = launch("-m", "tinydraft_mlx.generate", "--distributed", "--prompt",
                        "def parse_args(", "--max-tokens", str(N), port=start, timeout=120)
    log = result.stdout + result.stderr
    assert "--distributed: MLX could not join the ranks' group" in log, log
    assert BIND_FAILED in log and "--starting-port" in log
    assert "Traceback" not in log
    assert "rank 1 exited with code 2" in log  # the CLI's status for bad input

"""`python -m tinydraft_mlx.generate`: a real run, and one-line errors with exit status 2."""

import re
import subprocess
import sys

import pytest

from tests.scripted import scripted
from tinydraft_mlx.programs.cli import main


def test_cli_streams_text_and_prints_summary(checkpoints, capsys):
    code = main(["--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"]),
                 "--prompt", "def parse_args(", "--max-tokens", "20", "-k", "3", "--verbose"])
    out, err = capsys.readouterr()
    assert code == 0 and out.strip()
    assert "speculative k=3: 20 tokens" in err


def test_cli_bitwise_prints_plain_decodings_text(checkpoints, capsys):
    """--bitwise: the speculative run prints the plain run's text."""
    texts = []
    for draft in (str(checkpoints["draft"]), "none"):
        code = main(["--target", str(checkpoints["target"]), "--draft", draft, "--bitwise",
                     "--prompt", "def parse_args(", "--max-tokens", "24", "-k", "3"])
        texts.append(capsys.readouterr().out)
        assert code == 0 and texts[-1].strip()
    assert texts[0] == texts[1]


EDITING = (
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n\n"
    "class Vector:\n    def __init__(self, x, y):\n"
)


def test_cli_auto_k_reaches_the_policy(checkpoints, capsys, monkeypatch):
    """`-k auto` hands every round's k to the policy (here a scripted one: the real policy's
    choices depend on this machine's timings, see test_policy): the summary's histogram shows
    the scripted k values."""
    scripted(monkeypatch, (0, 2, 1))
    code = main(["--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"]),
                 "-k", "auto", "--prompt", "def parse_args(", "--max-tokens", "40",
                 "--verbose"])
    err = capsys.readouterr().err
    assert code == 0 and "speculative k=auto: 40 tokens" in err, err
    assert re.search(r"rounds by k \{0: \d+, 1: \d+, 2: \d+\}", err), err
    # --verbose says what k="auto" has learned (its costs and acceptance: test_policy)
    assert re.search(r'k="auto" has learned: a plain round costs [\d.]+ ms and a k = 1 round '
                     r"[\d.]+ ms on this machine, the draft's first token is accepted \d+% of "
                     r"the time, so (it will draft k = \d|drafting does not pay)", err), err


def test_a_run_that_compiles_kernels_says_so(checkpoints, capsys, monkeypatch):
    """MLX's CPU backend compiles kernels on a machine's first runs (cached under the temp
    directory): `--verbose` says how many this run compiled, since its speed includes them;
    a run that compiled none says nothing of it. The count is read from the cache directory."""
    import tempfile

    import mlx.core as mx

    from tinydraft_mlx.engine import backend
    from tinydraft_mlx.programs import cli

    monkeypatch.setattr(tempfile, "tempdir", str(checkpoints["target"].parent / "tmp"))
    where = backend.kernel_cache()
    assert where == checkpoints["target"].parent / "tmp" / "mlx" / mx.__version__ / "cpu"
    where.mkdir(parents=True, exist_ok=True)
    for i in range(3):
        (where / f"libkernel{i}.so").write_bytes(b"")
        (where / f"kernel{i}.cpp").write_text("")  # its source beside it: not a second kernel
    assert backend.compiled_kernels() == 3
    counts = iter([3, 10])
    monkeypatch.setattr(cli, "compiled_kernels", lambda: next(counts))
    argv = ["--target", str(checkpoints["target"]), "--prompt", "x", "--max-tokens", "4",
            "--verbose"]
    assert main(argv) == 0
    assert "MLX compiled 7 CPU kernels during this run" in capsys.readouterr().err
    monkeypatch.setattr(cli, "compiled_kernels", lambda: 3)
    assert main(argv) == 0
    assert "compiled" not in capsys.readouterr().err


def test_cli_prompt_lookup_drafts_and_copies(capsys):
    """`--draft prompt-lookup` really drafts and gets copies accepted, on the demo target, which
    copies the repeated constructor (see test_demo)."""
    code = main(["--draft", "prompt-lookup", "-k", "4", "--prompt", EDITING,
                 "--max-tokens", "40", "--verbose"])
    err = capsys.readouterr().err
    assert code == 0 and "draft: prompt-lookup" in err and "speculative k=4: 40 tokens" in err
    accepted = int(re.search(r"acceptance [\d.]+% \((\d+)/", err).group(1))
    assert accepted >= 4, err


def test_cli_bounded_cache(checkpoints, capsys):
    code = main(["--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"]),
                 "--prompt", "def parse_args(", "--max-tokens", "40", "--max-kv-size", "16",
                 "-k", "4"])
    assert code == 0 and "speculative k=4: 40 tokens" in capsys.readouterr().err


def test_cli_plain_decoding_from_stdin(checkpoints):
    result = subprocess.run(
        [sys.executable, "-m", "tinydraft_mlx.generate", "--target", str(checkpoints["target"]),
         "--draft", "none", "--max-tokens", "5", "--temp", "0.7", "--seed", "1"],
        input="import os\n", capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "plain decoding: 5 tokens" in result.stderr


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--temp", "-1"], "--temp must be 0 (greedy) or in [1e-06, 1e+06] (got -1.0)"),
        (["--temp", "warm"], "--temp must be 0 (greedy) or in [1e-06, 1e+06] (got 'warm')"),
        (["--top-p", "0"], "--top-p must be in (0, 1] (got 0.0)"),
        (["--top-p", "1.01"], "--top-p must be in (0, 1] (got 1.01)"),
        (["--top-k", "-3"], "--top-k must be an integer >= 0 (got -3)"),
        (["--min-p", "1"], "--min-p must be in [0, 1) (got 1.0)"),
        (["-k", "0"], '--num-draft-tokens must be an integer in [1, 64] or "auto" (got 0)'),
        (["--num-draft-tokens", "65"], 'must be an integer in [1, 64] or "auto" (got 65)'),
        (["-k", "automatic"], 'must be an integer in [1, 64] or "auto" (got \'automatic\')'),
        (["--max-tokens", "0"], "--max-tokens must be an integer >= 1 (got 0)"),
        (["--max-tokens", "1.5"], "--max-tokens must be an integer >= 1 (got '1.5')"),
        (["--seed", "-2"], "--seed must be an integer in [0, 9223372036854775807] (got -2)"),
        (["--prompt", ""], "--prompt must be non-empty"),
        (["--max-kv-size", "3"], "--max-kv-size must be an integer >= 5 (got 3)"),
        (["--max-kv-size", "big"], "--max-kv-size must be an integer >= 5 (got 'big')"),
        (["--dtype", "int4"], "argument --dtype: invalid choice"),
        (["--chat"], "--chat: this tokenizer has no chat template"),
        (["--target", "/no/such/model"], "model directory '/no/such/model' does not exist"),
        (["--draft", "OTHER"], "tokenizer differs from the target's"),
        (["--bitwise", "-k", "9"], '--num-draft-tokens must be an integer in [1, 8] or "auto" '
                                   "with bitwise (got 9)"),
        (["--bitwise", "--max-kv-size", "64"], "--bitwise must be False with max_kv_size 64"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(checkpoints, capsys, args, expected):
    args = [str(checkpoints["other_tokenizer"]) if a == "OTHER" else a for a in args]
    base = ["--target", str(checkpoints["target"]), "--prompt", "x"]
    with pytest.raises(SystemExit) as exit_info:
        main(base + args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert len(err.strip().splitlines()) == 1 and expected in err, err


def test_ctrl_c_stops_cleanly(checkpoints, capsys, monkeypatch):
    """An interrupt mid-stream ends with status 130, the text so far and the stats line."""
    import tinydraft_mlx.programs.cli as cli

    real = cli._stream_text

    class Interrupting:
        """Raises KeyboardInterrupt where the sixth token would arrive."""

        def __init__(self, steps):
            self.steps, self.seen = steps, 0

        def __iter__(self):
            return self

        def __next__(self):
            if self.seen == 5:
                raise KeyboardInterrupt
            self.seen += 1
            return next(self.steps)

        def close(self):
            self.steps.close()

    def interrupted(steps, quiet=False, **kwargs):
        return real(Interrupting(steps), quiet, **kwargs)

    monkeypatch.setattr(cli, "_stream_text", interrupted)
    code = cli.main(["--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"]),
                     "--prompt", "def f(", "--max-tokens", "30"])
    err = capsys.readouterr().err
    assert code == 130 and "5 tokens" in err


def test_the_stats_line_speaks_plainly(checkpoints, capsys):
    """"1 token", not "1 tokens"; a fixed k's rounds (shortened only near max_tokens) are not
    reported "by k" as if k had been chosen."""
    base = ["--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"]),
            "--prompt", "def f(x):"]
    assert main(base + ["-m", "1", "--draft", "none"]) == 0
    assert "plain decoding: 1 token in" in capsys.readouterr().err
    assert main(base + ["-m", "10", "-k", "4"]) == 0
    err = capsys.readouterr().err
    assert "speculative k=4: 10 tokens" in err and "rounds by k" not in err
    from tinydraft_mlx.engine.stats import GenerationStats

    auto = GenerationStats(k="auto", generated=9, rounds=1, drafted=2, accepted=1)
    auto.k_histogram = {0: 3, 2: 1}
    assert "rounds by k {0: 3, 2: 1}" in auto.summary() and "over 1 round," in auto.summary()
    # a position no round reached has no estimate: shown as "-", not as 0.00 (never accepted)
    rejected_first = GenerationStats(k="auto")
    rejected_first.record_round(1, 1)
    rejected_first.record_round(3, 0)
    assert "per position [0.50 - -]" in rejected_first.summary()


def test_the_distributed_hint_is_a_command_that_runs():
    """The error outside mlx.launch shows the command to start ranks: mlx.launch runs a command
    (`python -m ...`), and `-m tinydraft_mlx.generate` alone is not one."""
    from tinydraft_mlx.engine.distributed import join

    with pytest.raises(ValueError) as err:
        join()
    assert "-n 2 python -m tinydraft_mlx.generate --distributed" in str(err.value)


def test_make_demo_passes_the_prompt_as_typed(tmp_path):
    """`make demo PROMPT='...'` hands the prompt to the CLI unchanged: quotes, `$`, backslashes
    and backticks were mangled by make's and the shell's expansion. The CLI is replaced by a
    script that prints its arguments, and the install step is taken as done (`-o`)."""
    import shutil

    from tinydraft_mlx.generation.loading import DEMO_DIR

    make = shutil.which("make")
    assert make is not None, "make runs the project's two commands"
    echo = tmp_path / "echo_args"
    echo.write_text('#!/bin/sh\nfor a in "$@"; do printf "[%s]\\n" "$a"; done\n')
    echo.chmod(0o755)
    root = DEMO_DIR.parents[1]
    prompt = 'say "hi" $HOME \\n `x` it\'s'
    result = subprocess.run([make, "-s", "-o", ".venv/.demo", "demo", f"PY={echo}",
                             f"PROMPT={prompt}"], cwd=root, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    args = result.stdout.splitlines()
    assert args[:4] == ["[-m]", "[tinydraft_mlx.generate]", "[--prompt]", f"[{prompt}]"]


def test_no_known_draft_is_said_in_one_line(checkpoints, capsys):
    """A target with no known draft (the fixture: not Qwen2.5-named, no sibling draft) decodes
    plainly and says so, with how to pass one; naming --draft none is not told."""
    base = ["--target", str(checkpoints["target"]), "--prompt", "x", "--max-tokens", "3"]
    assert main(base) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "no draft model is known" in line]
    assert len(lines) == 1 and "--draft" in lines[0] and str(checkpoints["target"]) in lines[0]
    assert main(base + ["--draft", "none"]) == 0
    assert "no draft model is known" not in capsys.readouterr().err


@pytest.mark.parametrize("distributed", [True, False])
def test_a_broken_group_mid_generation_is_one_line(checkpoints, capsys, monkeypatch, distributed):
    """A collective failing mid-generation (another rank exited: MLX raises RuntimeError
    "[ring] connection to a peer was lost") ends a distributed run with status 1 and one line
    that says what broke; outside a distributed run a RuntimeError is a bug and is not hidden."""
    import tinydraft_mlx.programs.cli as cli

    class RankZero:
        rank, size = 0, 2

    def broken(steps, quiet=False, **kwargs):
        raise RuntimeError("[ring] connection to a peer was lost")

    monkeypatch.setattr(cli, "_stream_text", broken)
    monkeypatch.setattr(cli, "ranks_of", lambda model: RankZero() if distributed else None)
    args = ["--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"]),
            "--prompt", "def f(", "--max-tokens", "4"]
    if not distributed:
        with pytest.raises(RuntimeError, match="connection to a peer"):
            cli.main(args)
        return
    assert cli.main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "the ranks' group failed during the generation" in err
    assert "connection to a peer was lost" in err


def test_an_error_from_inside_is_not_a_usage_error(checkpoints, monkeypatch):
    """Every ValueError used to be printed as a usage error (status 2, one line), which hid bugs
    (and MLX's own ValueErrors) behind "error: ..."; now only bad input is, a bug raises."""
    from tinydraft_mlx.programs import cli

    def broken(*args, **kwargs):
        raise ValueError("[matmul] shapes (1,3,64) and (32,64) cannot be multiplied")

    monkeypatch.setattr(cli, "stream_generate", broken)
    with pytest.raises(ValueError, match="matmul"):
        main(["--target", str(checkpoints["target"]), "--prompt", "x"])

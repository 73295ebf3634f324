"""Draft-vocabulary pruning: counts files, the pruned head, and exactness with a pruned draft
(greedy identity against the transformers oracle and the demo pair's plain decoding; the joint of
the first two sampled tokens at T=1 against the oracle's exact distribution)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from tests.reference import check_first_two_tokens, warp_np
from tinydraft_mlx import BatchDecoder, ParameterError, SamplingParams, generate, load_models
from tinydraft_mlx.engine.pruning import (
    DEMO_COUNTS,
    PrunedDraft,
    VocabError,
    count_tokens,
    kept_ids,
    load_counts,
    prune_draft,
    save_counts,
)
from tinydraft_mlx.programs.vocab import main as vocab_main

TEXT = ["def parse_args(self, args=None, namespace=None):\n    return args\n",
        "import os\nimport sys\n\nclass Encoder(object):\n    pass\n"]


def test_kept_ids_are_the_most_frequent():
    counts = [5, 0, 9, 9, 1]
    assert kept_ids(counts, 2, 5) == [2, 3]
    assert kept_ids(counts, 3, 5) == [0, 2, 3]
    assert kept_ids(counts, 4, 3) == [0, 1, 2]  # ids at or beyond the width are never kept
    assert kept_ids(counts, 7, 7) == [0, 1, 2, 3, 4, 5, 6]  # ids the counts never saw: last


def test_counts_file_round_trip_and_refusals(pair, load, tmp_path):
    _, _, tok = pair
    counts = count_tokens(tok, TEXT)
    ids = tok.encode(TEXT[0], add_special_tokens=False) + tok.encode(TEXT[1],
                                                                    add_special_tokens=False)
    assert sum(counts) == len(ids) and counts == np.bincount(ids, minlength=len(counts)).tolist()
    path = save_counts(tmp_path / "counts.json", tok, counts)
    assert load_counts(path, tok) == counts
    other = load("other_tokenizer")[2]
    with pytest.raises(VocabError, match="counted with another tokenizer"):
        load_counts(path, other)
    (tmp_path / "junk.json").write_text("{}")
    for bad, message in ((tmp_path / "junk.json", "is not a tinydraft-mlx token counts file"),
                         (tmp_path / "missing.json", "token counts file .* does not exist")):
        with pytest.raises(VocabError, match=message):
            load_counts(bad, tok)


def test_vocab_command_writes_counts(checkpoints, pair, tmp_path, capsys):
    _, _, tok = pair
    (tmp_path / "src").mkdir()
    for i, text in enumerate(TEXT):
        (tmp_path / "src" / f"f{i}.py").write_text(text)
    out = tmp_path / "counts.json"
    assert vocab_main([str(tmp_path / "src"), "-o", str(out), "--model",
                       str(checkpoints["target"])]) == 0
    assert load_counts(out, tok) == count_tokens(tok, TEXT)
    assert "2 files" in capsys.readouterr().err
    # a model directory holds weights too: binary files are skipped, not counted as text
    (tmp_path / "src" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00" + bytes(range(256)))
    (tmp_path / "src" / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    assert vocab_main([str(tmp_path / "src"), "-o", str(out), "--model",
                       str(checkpoints["target"])]) == 0
    assert load_counts(out, tok) == count_tokens(tok, TEXT)
    err = capsys.readouterr().err
    assert "2 files" in err and "skipped 2 binary" in err
    with pytest.raises(SystemExit) as exit_:
        vocab_main([str(tmp_path / "nope"), "-o", str(out)])
    assert exit_.value.code == 2 and "neither a file nor a directory" in capsys.readouterr().err


def test_bad_arguments(pair, demo):
    target, draft, tok = pair
    width = draft.args.vocab_size
    for n in (0, width + 1, 2.5, True):
        with pytest.raises(ParameterError, match=rf"draft_vocab must be an integer in \[1, "
                                                 rf"{width}\]"):
            prune_draft(draft, tok, n, DEMO_COUNTS)
    with pytest.raises(ParameterError, match="used with a draft model"):
        prune_draft(None, tok, 8)
    with pytest.raises(VocabError, match="needs token counts for this tokenizer"):
        prune_draft(draft, tok, 8)  # the shipped counts are the demo tokenizer's
    with pytest.raises(VocabError, match="counted with another tokenizer"):
        prune_draft(draft, tok, 8, DEMO_COUNTS)
    assert json.loads(DEMO_COUNTS.read_text())["tokens"] > 1_000_000


@pytest.mark.parametrize("quantized", [False, True])
def test_pruned_logits_are_the_drafts_on_kept_ids(demo, tmp_path, quantized):
    """Kept ids: the full draft's logits; every other id: -inf. Float and 4-bit heads."""
    _, draft, tok = demo
    if quantized:
        from mlx_lm import convert

        from tinydraft_mlx.generation.loading import DEMO_DIR

        convert(str(DEMO_DIR / "draft"), mlx_path=str(tmp_path / "q"), quantize=True, q_bits=4,
                q_group_size=64)
        draft = load_models(str(DEMO_DIR / "target"), str(tmp_path / "q"))[1]
    pruned = prune_draft(draft, tok, 300)
    assert isinstance(pruned, PrunedDraft) and len(pruned.kept) == 300
    x = mx.array(tok.encode("class Stack:\n    def push(self, item):"))[None]
    full, small = draft(x), pruned(x)
    assert small.shape == full.shape
    kept = mx.array(pruned.kept)
    assert mx.allclose(small[..., kept], full[..., kept], atol=1e-4).item()
    others = np.setdiff1d(np.arange(full.shape[-1]), np.array(pruned.kept))
    rest = np.array(small[..., mx.array(others)].astype(mx.float32))
    assert others.size == full.shape[-1] - 300 and np.all(rest == -np.inf)


@pytest.fixture(scope="module")
def pruned_pair(pair, tmp_path_factory):
    """The fixture pair's draft keeping its 40 most frequent tokens on TEXT-like code."""
    target, draft, tok = pair
    path = tmp_path_factory.mktemp("counts") / "counts.json"
    save_counts(path, tok, count_tokens(tok, TEXT * 3 + ["for line in text.splitlines():"]))
    return target, prune_draft(draft, tok, 40, path), tok


@pytest.mark.usefixtures("cpu_fp32")
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_with_a_pruned_draft_matches_the_oracle(pruned_pair, oracle, k):
    target, draft, tok = pruned_pair
    accepted = 0
    for text in ["def parse_args(self, args=None, namespace=None):",
                 "import os\nimport sys\n\nclass Encoder(object):"]:
        ids = tok.encode(text)
        ref, margin = oracle.greedy(ids, 40, eos=tok.eos_token_id)
        assert margin > 1e-3 and len(set(ref)) >= 8
        out, stats = generate(target, draft, tok, ids, k=k, max_tokens=40)
        assert out == ref
        accepted += stats.accepted
        assert stats.drafted > 0
    assert accepted > 0


@pytest.mark.parametrize("n", [64, 512])
def test_demo_pair_greedy_identity_with_a_pruned_draft(demo, n):
    target, draft, tok = demo
    pruned = prune_draft(draft, tok, n)
    for prompt in ["class Stack:\n    def push(self, item):", "def parse_args(", "import os\n"]:
        expected, _ = generate(target, None, tok, prompt, max_tokens=48)
        for k in (2, 4):
            out, stats = generate(target, pruned, tok, prompt, k=k, max_tokens=48)
            assert out == expected
            assert stats.accepted > 0


@pytest.mark.usefixtures("cpu_fp32")
def test_first_two_sampled_tokens_follow_the_oracle_with_a_pruned_draft(pruned_pair, oracle):
    """T=1, top-p 0.9: the joint of the first two tokens of `generate(k=2)` with a pruned draft
    (q zero outside 40 ids) against the oracle's exact joint. Bound: chi-square at the 1 - 3.2e-5
    quantile (tests/reference.py), as the other exactness tests; the joint without top-p must be
    rejected by the same samples, and both the accept and the resample path must occur. Sampling
    from the pruned q's support only (the mistake this guards against) would leave out every
    pair outside the 40 ids, which the exact joint gives mass."""
    target, draft, tok = pruned_pair
    ids = tok.encode("def parse_args(self, args=None):")
    warp_kw = dict(temperature=1.0, top_p=0.9)

    def joint(**kw):
        p1 = warp_np(oracle.logits(ids)[-1], **kw)
        out = {}
        for a in np.flatnonzero(p1):
            p2 = warp_np(oracle.logits(ids + [int(a)])[-1], **kw)
            for b in np.flatnonzero(p2):
                out[(int(a), int(b))] = p1[a] * p2[b]
        return out

    exact, wrong = joint(**warp_kw), joint(temperature=1.0)
    kept = set(draft.kept)
    assert sum(v for (a, _), v in exact.items() if a not in kept) > 0.01  # mass q never has
    check_first_two_tokens(lambda: BatchDecoder(target, draft), ids, "model", 1500, exact,
                           wrong, sampling=lambda seed: SamplingParams(**warp_kw, seed=seed))


def test_load_models_prunes_and_the_cli_flag(demo, capsys):
    from tinydraft_mlx.programs.cli import main

    target, draft, tok = load_models(draft_vocab=256)
    assert isinstance(draft, PrunedDraft) and len(draft.kept) == 256
    expected, _ = generate(demo[0], None, demo[2], "def main():\n", max_tokens=20)
    assert main(["--prompt", "def main():\n", "--max-tokens", "20", "--draft-vocab", "256"]) == 0
    out = capsys.readouterr()
    assert out.out.rstrip("\n") == demo[2].decode(expected)
    for argv, message in [(["--draft-vocab", "0"], "--draft-vocab must be an integer in [1, 4096]"
                           " (the draft's vocabulary) (got 0)"),
                          (["--draft-vocab", "8", "--draft", "none"], "--draft-vocab must be "
                           "used with a draft model (not prompt lookup, mtp or none) "
                           "(got 'none')"),
                          (["--draft-vocab", "8", "--draft", "prompt-lookup"], "(got "
                           "'prompt-lookup')"),
                          (["--draft-vocab-counts", "counts.json"], "--draft-vocab-counts must "
                           "be used with draft_vocab"),
                          (["--draft-vocab", "8", "--draft-vocab-counts", "/no/counts.json"],
                           "token counts file '/no/counts.json' does not exist")]:
        with pytest.raises(SystemExit) as exit_:
            main(["--prompt", "x"] + argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err

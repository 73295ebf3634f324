"""Prompt caches: multi-turn reuse (only the new suffix is prefilled, output unchanged), bounded
caches that wrapped, files, wrong models, and failures that leave the cache consistent."""

import pytest

from tinydraft_mlx import PromptCache, PromptCacheError, generate, stream_generate
from tinydraft_mlx.engine.cache import cache_length
from tinydraft_mlx.programs.cli import main

PROMPT = "def parse_args(self, args=None, namespace=None):"
MORE = "\n    parser = argparse.ArgumentParser()\n"


def _two_turns(target, draft, tok, pc, **kw):
    """Turn 1 on PROMPT, then turn 2 on turn 1's prompt + output + MORE. Returns turn 2's
    (tokens, stats, prefill progress calls) and its prompt."""
    ids = tok.encode(PROMPT)
    first, _ = generate(target, draft, tok, ids, max_tokens=16, prompt_cache=pc, **kw)
    second_prompt = ids + first + tok.encode(MORE)
    calls = []
    out, stats = generate(target, draft, tok, second_prompt, max_tokens=16, prompt_cache=pc,
                          prompt_progress_callback=lambda done, total: calls.append((done, total)),
                          **kw)
    return out, stats, calls, second_prompt


@pytest.mark.parametrize("k", [3, "auto"])
def test_second_turn_prefills_only_new_tokens(pair, k):
    target, draft, tok = pair
    pc = PromptCache(target, draft)
    out, stats, calls, prompt = _two_turns(target, draft, tok, pc, k=k)
    cached = len(tok.encode(PROMPT)) + 16 - 1  # turn 1's prompt + output, but its last token
    assert stats.cached_tokens == cached
    assert calls[-1] == (len(prompt) - 1 - cached,) * 2  # only the new suffix is prefilled
    fresh, _ = generate(target, draft, tok, prompt, k=k, max_tokens=16)
    assert out == fresh
    assert pc.tokens == prompt + out and cache_length(pc.target_cache) == len(pc.tokens) - 1
    assert "cached" in stats.summary()


def test_diverging_prompt_reuses_the_common_prefix(pair):
    target, draft, tok = pair
    pc = PromptCache(target, draft)
    ids = tok.encode(PROMPT)
    generate(target, draft, tok, ids, max_tokens=8, prompt_cache=pc)
    other = ids[:6] + tok.encode(" other, stuff):")
    out, stats = generate(target, draft, tok, other, k=3, max_tokens=12, prompt_cache=pc)
    assert stats.cached_tokens == 6
    assert out == generate(target, draft, tok, other, k=3, max_tokens=12)[0]


def test_plain_turn_in_between_keeps_the_draft_cache_consistent(pair):
    """A cache made with a draft, used once without it (the draft cache is not advanced), then
    with it again: the draft cache is trimmed to what it really holds, output stays exact."""
    target, draft, tok = pair
    pc = PromptCache(target, draft)
    ids = tok.encode(PROMPT)
    a, _ = generate(target, draft, tok, ids, max_tokens=8, prompt_cache=pc)
    b, _ = generate(target, None, tok, ids + a, max_tokens=8, prompt_cache=pc)
    prompt = ids + a + b + tok.encode(MORE)
    out, _ = generate(target, draft, tok, prompt, k=4, max_tokens=16, prompt_cache=pc)
    assert out == generate(target, draft, tok, prompt, k=4, max_tokens=16)[0]
    with pytest.raises(PromptCacheError, match="another draft model"):
        generate(target, draft, tok, ids, prompt_cache=PromptCache(target))
    with pytest.raises(PromptCacheError, match="another target model"):
        generate(draft, None, tok, ids, prompt_cache=pc)


def test_bounded_cache_continues_or_rebuilds(pair):
    """max_kv_size 16 with an 80-token turn (the ring, 16 + a 65-slot margin, wraps): continuing
    the conversation reuses the wrapped cache (nothing to trim); a prompt that diverges before
    the window cannot be trimmed back to and is rebuilt (cached 0). Both equal fresh bounded
    runs."""
    target, draft, tok = pair
    pc = PromptCache(target, draft, max_kv_size=16)
    ids = tok.encode(PROMPT)
    first, _ = generate(target, draft, tok, ids, k=3, max_tokens=80, prompt_cache=pc)
    assert pc.target_cache[0].offset > pc.target_cache[0].slots  # it wrapped
    cont = ids + first + tok.encode(MORE)
    out, stats = generate(target, draft, tok, cont, k=3, max_tokens=20, prompt_cache=pc)
    assert stats.cached_tokens == len(ids) + 80 - 1
    assert out == generate(target, draft, tok, cont, k=3, max_tokens=20, max_kv_size=16)[0]
    early = ids[:5] + tok.encode(" x):")
    out, stats = generate(target, draft, tok, early, k=3, max_tokens=20, prompt_cache=pc)
    assert stats.cached_tokens == 0
    assert out == generate(target, draft, tok, early, k=3, max_tokens=20, max_kv_size=16)[0]


@pytest.mark.parametrize("bounded", [False, True])
def test_file_round_trip(pair, tmp_path, bounded):
    target, draft, tok = pair
    kw = dict(max_kv_size=24) if bounded else {}
    pc = PromptCache(target, draft, **kw)
    ids = tok.encode(PROMPT)
    first, _ = generate(target, draft, tok, ids, max_tokens=16, prompt_cache=pc)
    path = tmp_path / "cache.safetensors"
    pc.save(path, metadata={"conversation": "test"})
    loaded = PromptCache.load(path, target, draft)
    assert loaded.tokens == pc.tokens and loaded.metadata == {"conversation": "test"}
    assert loaded.max_kv_size == pc.max_kv_size
    prompt = ids + first + tok.encode(MORE)
    out, stats = generate(target, draft, tok, prompt, max_tokens=16, prompt_cache=loaded)
    again, stats_again = generate(target, draft, tok, prompt, max_tokens=16, prompt_cache=pc)
    assert out == again and stats.cached_tokens == stats_again.cached_tokens > 0


def test_file_refuses_other_models_and_foreign_files(pair, load, tmp_path):
    target, draft, tok = pair
    pc = PromptCache(target, draft)
    generate(target, draft, tok, PROMPT, max_tokens=4, prompt_cache=pc)
    path = tmp_path / "cache.safetensors"
    pc.save(path)
    other_target, unrelated, _ = load("unrelated", "unrelated")
    cases = [
        (lambda: PromptCache.load(path, other_target, draft), "made with another target model"),
        (lambda: PromptCache.load(path, target, unrelated), "made with another draft model"),
        (lambda: PromptCache.load(path, target), "made with another draft model"),
    ]
    junk = tmp_path / "junk.safetensors"
    junk.write_text("not a cache")
    cases.append((lambda: PromptCache.load(junk, target, draft), "is not a tinydraft-mlx"))
    cases.append((lambda: PromptCache.load(tmp_path / "missing", target), "does not exist"))
    for call, message in cases:
        with pytest.raises(PromptCacheError) as err:
            call()
        assert message in str(err.value) and "\n" not in str(err.value)
        assert err.value.__cause__ is None


def test_a_failure_mid_generation_leaves_the_cache_consistent(pair):
    """A logits processor that fails in the 4th round: the error reaches the caller, and the
    prompt cache holds exactly prompt + the tokens emitted before it, ready for the next turn."""
    target, draft, tok = pair
    calls = []

    def failing(tokens, logits):
        calls.append(1)
        if len(calls) > 3 * 4:  # 4 verify positions per round at k=3 (draft calls too)
            raise RuntimeError("processor failed")
        return logits

    pc = PromptCache(target, draft)
    ids = tok.encode(PROMPT)
    emitted = []
    with pytest.raises(RuntimeError, match="processor failed"):
        for r in stream_generate(target, draft, tok, ids, k=3, max_tokens=40,
                                 logits_processors=[failing], prompt_cache=pc):
            emitted.append(r.token)
    assert emitted and pc.tokens == ids + emitted
    assert cache_length(pc.target_cache) == len(pc.tokens) - 1
    assert cache_length(pc.draft_cache) <= len(pc.tokens) - 1
    prompt = pc.tokens + tok.encode(MORE)
    out, stats = generate(target, draft, tok, prompt, k=3, max_tokens=12, prompt_cache=pc)
    assert stats.cached_tokens == len(ids) + len(emitted) - 1
    assert out == generate(target, draft, tok, prompt, k=3, max_tokens=12)[0]


def test_bad_prompt_cache_arguments(pair):
    target, draft, tok = pair
    with pytest.raises(PromptCacheError, match=r"max_kv_size must be an integer > 5 \(got 3\)"):
        PromptCache(target, draft, max_kv_size=3)
    pc = PromptCache(target, draft, max_kv_size=32)
    with pytest.raises(ValueError, match="max_kv_size must be None or the prompt cache's 32"):
        generate(target, draft, tok, PROMPT, prompt_cache=pc, max_kv_size=64)


def test_cli_prompt_cache_file_and_progress(checkpoints, tmp_path, capsys):
    """The second run with the same file reuses the first run's prompt; a prompt longer than one
    prefill chunk (512 tokens) shows a progress bar on stderr."""
    path = tmp_path / "chat"  # saved under exactly that name, found again there
    long_prompt = "def parse_args(self, args=None):\n" * 60  # > 512 tokens
    base = ["--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"]),
            "--max-tokens", "8", "--prompt-cache-file", str(path)]
    assert main(base + ["--prompt", long_prompt]) == 0
    first = capsys.readouterr()
    assert path.exists() and not (tmp_path / "chat.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["chat"]  # no partial file left behind
    assert "prompt:" in first.err and "cached" not in first.err
    assert main(base + ["--prompt", long_prompt]) == 0
    second = capsys.readouterr()
    assert second.out == first.out
    assert " cached)" in second.err, second.err
    with pytest.raises(SystemExit):
        main(["--target", str(checkpoints["draft"]), "--draft", "none", "--prompt", "x",
              "--prompt-cache-file", str(path)])
    assert "made with another target model" in capsys.readouterr().err


def test_two_live_generations_on_one_cache_are_refused(pair):
    """A second generation on a cache that a live one holds would corrupt both silently: it is
    refused with a clear error; once the first is done (or closed) the cache is free again, and
    a generation that was made but never started holds nothing."""
    target, draft, tok = pair
    pc = PromptCache(target, draft)
    first = stream_generate(target, draft, tok, PROMPT, max_tokens=8, prompt_cache=pc)
    never_started = stream_generate(target, draft, tok, PROMPT, max_tokens=8, prompt_cache=pc)
    del never_started
    made_before = stream_generate(target, draft, tok, PROMPT, max_tokens=8, prompt_cache=pc)
    next(first)
    with pytest.raises(PromptCacheError, match="in use by a generation that has not"):
        stream_generate(target, draft, tok, PROMPT + "x", max_tokens=8, prompt_cache=pc)
    with pytest.raises(PromptCacheError, match="in use"):
        next(made_before)  # made while free, started while the other runs: refused at start
    first.close()
    second = stream_generate(target, draft, tok, PROMPT, max_tokens=8, prompt_cache=pc)
    next(second)
    out = [next(second).token for _ in range(3)]
    second.close()
    fresh, _ = generate(target, draft, tok, PROMPT, max_tokens=4)
    assert out == fresh[1:4]
    assert cache_length(pc.target_cache) == len(pc.tokens) - 1


@pytest.mark.parametrize("where", ["callback", "layer"])
def test_an_interrupted_prefill_leaves_the_cache_consistent(pair, where):
    """A prefill interrupted after its first 512-token chunk, by a progress callback that raises
    or by Ctrl-C between two layers' updates (a KeyboardInterrupt in layer 3): every layer holds
    the same tokens, the cache records them, and the next generation on it is exact."""
    target, draft, tok = pair
    ids = (tok.encode(PROMPT + MORE) * 40)[:1200]
    pc = PromptCache(target, draft)
    layer = pc.target_cache[3]
    calls = {"n": 0}

    def progress(done, total):
        calls["n"] += 1
        if where == "callback" and done >= 512:
            raise RuntimeError("progress bar exploded")

    if where == "layer":
        update = layer.update_and_fetch

        def interrupted(keys, values):
            calls["layer"] = calls.get("layer", 0) + 1
            if calls["layer"] == 2:  # the second chunk
                raise KeyboardInterrupt
            return update(keys, values)

        layer.update_and_fetch = interrupted
    with pytest.raises((RuntimeError, KeyboardInterrupt)):
        generate(target, draft, tok, ids, max_tokens=8, prompt_cache=pc,
                 prompt_progress_callback=progress)
    if where == "layer":
        del layer.update_and_fetch
    offsets = {layer.offset for layer in pc.target_cache}
    assert offsets == {512}  # layers 0-2 had taken the second chunk too
    assert pc.tokens == ids[:513] and not pc.in_use
    out, stats = generate(target, draft, tok, ids, max_tokens=8, prompt_cache=pc)
    fresh, _ = generate(target, draft, tok, ids, max_tokens=8)
    assert out == fresh and stats.cached_tokens == 512


def test_prompt_cache_files_say_what_is_wrong(pair, checkpoints, tmp_path, capsys):
    """A cache file in a directory that does not exist is refused before the generation (it used
    to run the whole generation, then a traceback); a missing file to load says so."""
    target, draft, tok = pair
    with pytest.raises(SystemExit) as exit_:
        main(["--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"]),
              "--prompt", "x", "--prompt-cache-file", str(tmp_path / "no" / "such" / "c")])
    err = capsys.readouterr()
    assert exit_.value.code == 2 and err.out == ""
    assert f"directory {str(tmp_path / 'no' / 'such')!r} does not exist" in err.err
    with pytest.raises(PromptCacheError, match="prompt cache file .* does not exist"):
        PromptCache.load(tmp_path / "missing.safetensors", target, draft)
    pc = PromptCache(target, draft)
    generate(target, draft, tok, PROMPT, max_tokens=4, prompt_cache=pc)
    with pytest.raises(PromptCacheError, match="directory .* does not exist"):
        pc.save(tmp_path / "gone" / "c.bin")
    pc.save(tmp_path / "c.bin")  # any suffix: the file is exactly there
    assert PromptCache.load(tmp_path / "c.bin", target, draft).tokens == pc.tokens

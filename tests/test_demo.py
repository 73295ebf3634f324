"""The bundled demo pair: loads with no arguments, is lossless against the oracle with realistic
(trained) logit margins, and its draft really imitates the target. Oracle comparisons: CPU,
float32."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from tinydraft_mlx import generate
from tinydraft_mlx.programs.cli import main

PROMPTS = [
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def pop(self):",
    "import os\n\n\ndef read_lines(path):\n    with open(path) as f:",
    "    for key, value in sorted(mapping.items()):\n        if",
]
NEW_TOKENS = 48


def _n_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def test_loads_with_no_arguments():
    """The default load: the bundled pair, in the device's default dtype: float32 on the CPU, on
    a GPU the checkpoint's own (the demo weights are stored in float16)."""
    from tinydraft_mlx import load_models
    from tinydraft_mlx.generation.loading import DEMO_DIR

    stored = {w.dtype for w in mx.load(str(DEMO_DIR / "target" / "model.safetensors")).values()}
    assert stored == {mx.float16}
    target, draft, tok = load_models()
    assert draft is not None and tok.eos_token_id is not None
    assert _n_params(target) >= 4 * _n_params(draft)
    expected = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    assert target.model.embed_tokens.weight.dtype == expected
    assert draft.model.layers[0].mlp.up_proj.weight.dtype == expected


@pytest.mark.usefixtures("cpu_fp32")
def test_demo_pair_is_lossless_against_oracle(demo, demo_oracle):
    target, draft, tok = demo
    oracle = demo_oracle
    accepted = drafted = 0
    for text in PROMPTS:
        ids = tok.encode(text)
        ref, margin = oracle.greedy(ids, NEW_TOKENS, eos=tok.eos_token_id)
        assert len(set(ref)) >= 8, f"degenerate reference for {text!r}"
        assert margin > 1e-3, f"near-tie on the path ({margin:.2e}): choose another prompt"
        for k in (2, 4):
            out, stats = generate(target, draft, tok, ids, k=k, max_tokens=NEW_TOKENS)
            assert out == ref
            accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
    assert accepted / drafted > 0.4  # a trained, distilled draft (unrelated drafts: < 0.05)


# an editing request in the demo template's ChatML (the pair was retrained on such exchanges):
# the answer copies the snippet back with the change
EDITING = (
    "<|im_start|>user\nRename `x` to `left` in this code:\n```python\ndef add(x, y):\n"
    '    """Return x plus y."""\n    return x + y\n```<|im_end|>\n<|im_start|>assistant\n'
)


@pytest.mark.usefixtures("cpu_fp32")
@pytest.mark.parametrize("k", [4, "auto"])
def test_prompt_lookup_copies_and_stays_lossless(demo, demo_oracle, k):
    """On a prompt that invites repetition the trained target copies, and lookup drafts get
    accepted; the output still equals the oracle's greedy continuation."""
    target, _, tok = demo
    oracle = demo_oracle
    ids = tok.encode(EDITING)
    ref, margin = oracle.greedy(ids, NEW_TOKENS, eos=tok.eos_token_id)
    assert len(set(ref)) >= 8 and margin > 1e-3
    out, stats = generate(target, "prompt-lookup", tok, ids, k=k, max_tokens=NEW_TOKENS)
    assert out == ref
    if k == 4:
        assert stats.accepted >= 8 and stats.acceptance_rate > 0.3, stats.summary()


@pytest.mark.usefixtures("cpu_fp32")
def test_hybrid_drafts_from_both_sources_on_the_demo_pair(demo, demo_oracle):
    """The editing prompt: a hybrid's rounds come from the lookup and the model, and the output
    is the oracle's greedy continuation."""
    from tinydraft_mlx import Hybrid
    from tinydraft_mlx.engine.drafters import HybridDraft

    target, draft, tok = demo
    ids = tok.encode(EDITING)
    ref, _ = demo_oracle.greedy(ids, NEW_TOKENS, eos=tok.eos_token_id)
    drafter = HybridDraft(Hybrid(draft))
    out, stats = generate(target, drafter, tok, ids, k=4, max_tokens=NEW_TOKENS)
    assert out == ref
    assert drafter.recent["prompt-lookup"].rounds > 0 and drafter.recent["model"].rounds > 0
    assert stats.acceptance_rate > 0.3, stats.summary()


def test_cli_runs_on_the_demo_pair_by_default(capsys):
    assert main(["--prompt", "def parse_args(", "--max-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "24 tokens" in err and "k=auto" in err  # the default k


@pytest.mark.parametrize("name", ["target", "draft"])
def test_mlx_lms_own_loader_reads_the_demo_pair_as_ours_does(demo, name):
    """The shipped configs carry the top-level `rope_theta` that mlx-lm's qwen2 reads (it
    ignores transformers 5's `rope_parameters` and falls back to 1e6): `mlx_lm.load`, as
    `mlx_lm.generate` and `mlx_lm.server` use it, gives the logits our loader gives."""
    import json

    from mlx_lm import load

    from tinydraft_mlx.generation.loading import DEMO_DIR

    config = json.loads((DEMO_DIR / name / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10000.0
    theirs, _ = load(str(DEMO_DIR / name))
    theirs.set_dtype(mx.float32)
    ours = demo[0] if name == "target" else demo[1]
    assert theirs.args.rope_theta == ours.args.rope_theta == 10000.0
    x = mx.array([list(range(5, 200, 3))])
    diff = mx.abs(theirs(x) - ours(x)).max().item()
    assert diff < 1e-4, diff


CHATML_TURN = "<|im_start|>user\nWrite a loop.<|im_end|>\n<|im_start|>assistant\n"


def test_the_demo_tokenizer_chats_offline_in_chatml(demo):
    """The bundled pair ships a ChatML template (Qwen2.5's format): chat messages work as
    written in the README, and the prompt is the ChatML text the template should give."""
    from tinydraft_mlx.generation.text import chat_text

    target, draft, tok = demo
    messages = [{"role": "user", "content": "Write a loop."}]
    assert chat_text(tok, messages) == CHATML_TURN
    ids, _ = generate(target, draft, tok, messages, max_tokens=12)
    assert ids == generate(target, draft, tok, tok.encode(CHATML_TURN), max_tokens=12)[0]


def test_chat_template_argument_and_flag(pair, checkpoints, capsys, tmp_path):
    """A tokenizer without a template (the fixture's): `chat_template=` in the API and
    `--chat-template` (text or a file) in the CLI apply one; misuse is a ParameterError."""
    from tinydraft_mlx import ParameterError
    from tinydraft_mlx.programs.cli import main

    target, draft, tok = pair
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>"
    messages = [{"role": "user", "content": "def f(x):"}]
    ids, _ = generate(target, draft, tok, messages, chat_template=template, max_tokens=8)
    assert ids == generate(target, draft, tok, "[user] def f(x):\n>", max_tokens=8)[0]
    with pytest.raises(ParameterError, match="chat_template must be given only with chat"):
        generate(target, draft, tok, "def f(x):", chat_template=template, max_tokens=2)
    with pytest.raises(ParameterError, match="chat_template must be a non-empty Jinja"):
        generate(target, draft, tok, messages, chat_template=3, max_tokens=2)
    with pytest.raises(ValueError, match="pass chat_template="):
        generate(target, draft, tok, messages, max_tokens=2)
    path = tmp_path / "template.jinja"
    path.write_text(template)
    base = ["--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"]),
            "--max-tokens", "8"]
    outs = []
    for args in (["--prompt", "def f(x):", "--chat-template", template],
                 ["--prompt", "def f(x):", "--chat-template", str(path)],
                 ["--prompt", "[user] def f(x):\n>"]):  # the text the template gives
        assert main(base + args) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] and outs[0].strip()


# the share of drafted tokens accepted, over k in {1, 3, 6, auto}; the demo's DFlash drafter is
# weaker than its heads (0.27 here; an untrained one of its shape 0.00)
FLOOR = {"mtp": 0.4, "eagle3": 0.4, "dflash": 0.15}


@pytest.mark.usefixtures("cpu_fp32")
@pytest.mark.parametrize("kind", ["mtp", "eagle3", "dflash"])
def test_the_demo_targets_heads_are_lossless_and_accepted(demo, demo_oracle, kind):
    """The drafters shipped with the demo target that read its states (its MTP layer, its
    EAGLE-3 head: training/train_heads.py; its DFlash drafter: training/train_dflash.py): greedy
    output == the oracle's, k in {1, 3, 6, auto}, one sequence and a batch of 3; trained, so
    accepted often (an untrained one of the same shape: < 0.05)."""
    from tinydraft_mlx import batch_generate, load_head
    from tinydraft_mlx.generation.loading import DEMO_DIR, load_eagle

    target, _, tok = demo
    head = (load_head(target, DEMO_DIR / "target") if kind == "mtp"
            else load_eagle(target, DEMO_DIR / kind))
    refs = [(tok.encode(t), demo_oracle.greedy(tok.encode(t), 32, eos=tok.eos_token_id)[0])
            for t in PROMPTS[:3]]
    accepted = drafted = 0
    for k in (1, 3, 6, "auto"):
        for ids, ref in refs:
            out, stats = generate(target, head, tok, ids, k=k, max_tokens=32)
            assert out == ref, (kind, k)
            accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
    outs = batch_generate(target, head, tok, [ids for ids, _ in refs], k=3, max_tokens=32)
    assert [o for o, _ in outs] == [ref for _, ref in refs]
    assert accepted / drafted > FLOOR[kind], accepted / drafted

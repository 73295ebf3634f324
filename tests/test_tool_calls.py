"""The tool-call splitter (tinydraft_mlx/tool_calls.py) on mlx-lm's own formats: text released as
it streams, calls parsed once complete, malformed calls given back as text."""

from __future__ import annotations

import importlib

import pytest

from tinydraft_mlx.serving.tool_calls import ToolCall, ToolCallSplitter, ToolFormat, tool_format

QWEN = ToolFormat("json_tools", "<tool_call>", "</tool_call>",
                  importlib.import_module("mlx_lm.tool_parsers.json_tools").parse_tool_call)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "",
                     importlib.import_module("mlx_lm.tool_parsers.mistral").parse_tool_call)
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
TEXT = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}'
        '\n</tool_call>')


def split(fmt, text, step, tools=TOOLS):
    splitter = ToolCallSplitter(fmt, tools)
    out = []
    for i in range(0, len(text), step):
        out.extend(splitter.feed(text[i:i + step]))
    return out + splitter.finish()


def joined(parts):
    """Adjacent strings joined: the same reply however it was cut into pieces."""
    out = []
    for part in parts:
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        else:
            out.append(part)
    return [(p.name, p.arguments) if isinstance(p, ToolCall) else p for p in out]


@pytest.mark.parametrize("step", [1, 3, 7, len(TEXT)])
def test_calls_are_parsed_however_the_text_is_streamed(step):
    assert joined(split(QWEN, TEXT, step)) == [
        "Sure.\n", ("get_weather", {"city": "Paris"}), "\n", ("get_weather", {"city": "Lyon"})]


def test_text_that_could_begin_a_marker_is_held_back_until_it_cannot():
    splitter = ToolCallSplitter(QWEN, TOOLS)
    assert splitter.feed("a <tool") == ["a "]
    assert splitter.feed("box>") == ["<toolbox>"]
    assert splitter.feed("<tool_call>{") == []
    assert splitter.finish() == ["<tool_call>{"]  # unfinished: text


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
    '<tool_call>\nnot json\n</tool_call>',
    '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
])
def test_a_malformed_call_is_its_text(text):
    assert joined(split(QWEN, text, 2)) == [text]


def test_a_format_without_an_end_marker_runs_to_the_end():
    text = 'ok[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert joined(split(MISTRAL, text, 4)) == ["ok", ("get_weather", {"city": "Oslo"})]


def test_the_format_is_found_from_the_chat_template(demo):
    assert tool_format(demo[2]).start == "<tool_call>"  # the demo's template renders tools

    class Plain:
        chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        tool_call_start = None
        tool_parser = None

        def get_vocab(self):
            return {}

    assert tool_format(Plain()) is None

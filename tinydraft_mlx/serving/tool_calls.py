"""Tool calls in generated text: the format a tokenizer's chat template uses, and a streaming
splitter that turns generated text into plain text and parsed calls.

The formats are mlx-lm's own registry (`mlx_lm.tool_parsers`: Qwen2.5's `<tool_call>{json}
</tool_call>`, Mistral's `[TOOL_CALLS]`, Qwen3-Coder's XML and the others it knows), found the way
mlx-lm finds them: a tokenizer loaded by mlx-lm names its parser and markers; a template set later
(`--chat-template`) is matched with mlx-lm's own rules. This module adds what a server streaming
tokens needs: text outside the markers is released as it comes (except a tail that could still
begin a start marker), text between them is held until the end marker and then parsed. A call that
does not parse, names a tool that was not offered, or is cut off by the end of generation comes
back as plain text, never an error. Knows nothing about HTTP or the decode loop.
"""

from __future__ import annotations

import importlib
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Parse = Callable[[str, Any], Any]


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes tool calls: the markers around one call (`end` may be empty:
    the call runs to the end of the text) and mlx-lm's parser of the text between them."""

    name: str
    start: str
    end: str
    parse: Parse


def tool_format(tokenizer: Any) -> ToolFormat | None:
    """The tool-call format of `tokenizer`'s chat template, or None when it has none (its template
    cannot take tools, or mlx-lm knows no parser for it)."""
    start = getattr(tokenizer, "tool_call_start", None)
    parse = getattr(tokenizer, "tool_parser", None)
    if start and parse is not None:
        return ToolFormat(getattr(parse, "__module__", "mlx-lm").rsplit(".", 1)[-1], start,
                          getattr(tokenizer, "tool_call_end", None) or "", parse)
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    try:  # a template set after loading: mlx-lm's rules for naming its parser
        from mlx_lm.tokenizer_utils import _infer_tool_parser

        name = _infer_tool_parser(tokenizer)
    except Exception:  # an mlx-lm without these rules, or a tokenizer they cannot read
        return None
    if name is None:
        return None
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return ToolFormat(name, module.tool_call_start, module.tool_call_end or "",
                      module.parse_tool_call)


@dataclass
class ToolCall:
    """One parsed call: the function's name, its arguments (a JSON object) and an id."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


class ToolCallSplitter:
    """Splits streamed text into plain text and tool calls.

    `feed(text)` returns what can be released now: a list of strings (plain text) and
    `ToolCall`s, in order; `finish()` returns the rest at the end of generation (an unfinished
    call as text). `names`: the functions offered (a call naming another is text); `calls`: the
    calls parsed so far.
    """

    def __init__(self, fmt: ToolFormat, tools: Sequence[dict[str, Any]] | None = None) -> None:
        self.fmt = fmt
        self.tools = list(tools or [])
        self.names = {function_spec(t).get("name") for t in self.tools}
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not released yet
        self._inside = False  # after a start marker

    def feed(self, text: str) -> list[str | ToolCall]:
        self._pending += text
        out: list[str | ToolCall] = []
        while True:
            if not self._inside:
                at = self._pending.find(self.fmt.start)
                if at < 0:
                    keep = _partial_tail(self._pending, self.fmt.start)
                    _text(out, self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    return out
                _text(out, self._pending[:at])
                self._pending = self._pending[at:]
                self._inside = True
            if not self.fmt.end:  # the call runs to the end of the text
                return out
            at = self._pending.find(self.fmt.end, len(self.fmt.start))
            if at < 0:
                return out
            whole = self._pending[: at + len(self.fmt.end)]
            self._pending = self._pending[at + len(self.fmt.end):]
            self._inside = False
            out.extend(self._parse(whole))

    def finish(self) -> list[str | ToolCall]:
        """The rest: a call without its end marker is parsed when the format needs none, and
        otherwise released as text."""
        rest, self._pending = self._pending, ""
        if self._inside and not self.fmt.end:
            self._inside = False
            return self._parse(rest)
        self._inside = False
        return [rest] if rest else []

    def _parse(self, whole: str) -> list[str | ToolCall]:
        body = whole[len(self.fmt.start): len(whole) - len(self.fmt.end)]
        try:
            parsed = self.fmt.parse(body, self.tools or None)
        except Exception:  # malformed: the model's text, as it wrote it
            return [whole]
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = []
        for item in items:
            name = item.get("name") if isinstance(item, dict) else None
            args = item.get("arguments", {}) if isinstance(item, dict) else None
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return [whole]
            if not isinstance(name, str) or not isinstance(args, dict) or (
                    self.names and name not in self.names):
                return [whole]
            calls.append(ToolCall(name, args))
        self.calls.extend(calls)
        return list(calls)


def function_spec(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's function spec, from OpenAI's {"type": "function", "function": {...}} shape or a
    bare {"name": ...}."""
    inner = tool.get("function")
    return inner if isinstance(inner, dict) else tool


def _text(out: list[str | ToolCall], text: str) -> None:
    if text:
        out.append(text)


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0

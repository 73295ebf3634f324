"""A reply's text and tool calls as its pieces arrive (both APIs' streams and whole replies
read them through `Reply`)."""

from __future__ import annotations

from typing import Any

from .tool_calls import ToolCall, ToolCallSplitter
from .worker import Piece


class Reply:
    """A reply's text and tool calls as its pieces arrive: `feed(piece)` returns what can be
    sent now, strings (text) and `ToolCall`s in order; with no tool format, the text as it
    comes."""

    def __init__(self, plan: Any) -> None:  # a service.Plan: its tool format, tools, forced start
        self.splitter = (ToolCallSplitter(plan.tool_format, plan.tools)
                         if plan.tool_format is not None else None)
        if self.splitter is not None and plan.forced:
            self.splitter.feed(plan.forced)  # inside the call: nothing to send yet

    @property
    def calls(self) -> list[ToolCall]:
        return self.splitter.calls if self.splitter is not None else []

    def feed(self, piece: Piece) -> list[str | ToolCall]:
        if self.splitter is None:
            return [piece.text] if piece.text else []
        out = self.splitter.feed(piece.text)
        if piece.finish_reason is not None:
            out += self.splitter.finish()
        return out

    def parts(self, pieces: list[Piece]) -> list[str | ToolCall]:
        """The text and tool calls of a whole reply, in order."""
        parts = [part for piece in pieces for part in self.feed(piece)]
        if pieces and pieces[-1].finish_reason is None and self.splitter is not None:
            parts += self.splitter.finish()  # cut short: what is held back is text
        return parts

    def whole(self, pieces: list[Piece]) -> tuple[str, list[ToolCall]]:
        """(text, tool calls) of a whole reply."""
        parts = self.parts(pieces)
        text = "".join(p for p in parts if isinstance(p, str))
        return text, [p for p in parts if isinstance(p, ToolCall)]

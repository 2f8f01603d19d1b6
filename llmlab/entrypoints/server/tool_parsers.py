"""Tool-call parsers: the ``tool_parser`` component kind, which finds the tool calls a model
wrote in its own text (``tool_choice="auto"``, served with ``--enable-auto-tool-choice
--tool-call-parser NAME``).

A parser is one method, ``extract(text, tools) -> (content, calls)``: the whole output in,
the message's ``content`` (None for none) and its calls out, each a :class:`ParsedCall`
``(name, arguments)`` (``arguments`` the JSON text of the arguments; a plain 2-tuple does
too). ``tools`` are the request's tools in OpenAI's shape. A parser that can also stream has
``feed(delta, tools, *, final=False) -> (content, call_deltas)``: each text delta in, the
content to send now and the :class:`CallDelta` items ``(index, name, arguments)``, where a
call's first delta carries its ``name`` and later ones (``name`` None) more ``arguments``
text; ``final`` marks the last delta, after which nothing may stay held back. The server
makes a fresh parser for each choice of each request (a registered name is a factory, as
for every component), so ``feed`` may keep state on ``self``. A parser without ``feed``
still serves streamed requests: its content and calls come with the last chunk.

A parser for another tag pair, registered by name::

    from llmlab import register
    from llmlab.entrypoints.server.tool_parsers import HermesToolParser

    @register("tool_parser", "functionary_tags")
    class FunctionTags(HermesToolParser):
        \"\"\"``<function>{"name": ..., "arguments": {...}}</function>`` blocks.\"\"\"
        start_tag, end_tag = "<function>", "</function>"

Built-in: ``hermes`` (:class:`HermesToolParser`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import NamedTuple, Protocol

from llmlab.registry import Method, check, register, resolve


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD: JSON escapes such as
    ``"\\ud800"`` decode to one, and no response can carry it (UTF-8 has no encoding for
    it), so a parser's text that holds one would fail the response."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


class ParsedCall(NamedTuple):
    """One tool call of a finished output: the function's ``name`` and its ``arguments``
    as JSON text."""

    name: str
    arguments: str


class CallDelta(NamedTuple):
    """A piece of one streamed call: ``index`` counts the output's calls from 0; the
    call's first piece has its ``name``, the rest ``name=None`` and more ``arguments``."""

    index: int
    name: str | None = None
    arguments: str = ""


class ToolParser(Protocol):
    """Finds tool calls in a finished output (see the module docstring)."""

    def extract(self, text: str, tools: list[dict]) -> tuple[str | None, list[ParsedCall]]:
        ...


class StreamingToolParser(ToolParser, Protocol):
    """A :class:`ToolParser` that also parses a stream of deltas, one instance per stream."""

    def feed(self, delta: str, tools: list[dict], *,
             final: bool = False) -> tuple[str, list[CallDelta]]:
        ...


@register("tool_parser", "hermes")
class HermesToolParser:
    """Hermes-style calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    The format of NousResearch's Hermes 2 Pro and 3 and of the Qwen2.5 and Qwen3 chat
    templates (vLLM's ``hermes`` parser). Several blocks give several calls; text outside
    them is the content, without the whitespace that separates it from a call (an output of
    calls alone has ``content`` None). A block is a call once its JSON object has named the
    function (``"name": "..."``, valid Unicode once decoded: ``"\\ud800"`` names nothing);
    its ``arguments`` are the text the model wrote for the ``"arguments"`` value (``"{}"``
    when there is none), which, as OpenAI warns of its own models, a model that breaks off
    may leave invalid. A block that names no function (not
    JSON, no name) stays in the content as written, tags included. A last block the output
    never closes counts as closed at the end. Unlike vLLM, which drops the text after the
    first call and makes the whole output content when one block fails to parse, every
    block is judged on its own, the same way streamed or not.

    Subclasses change ``start_tag`` and ``end_tag`` for another tag pair.
    """

    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self) -> None:
        self._stream: _TaggedStream | None = None

    def extract(self, text: str, tools: list[dict]) -> tuple[str | None, list[ParsedCall]]:
        content, deltas = _TaggedStream(self.start_tag, self.end_tag).feed(text, final=True)
        return (content or None), join_deltas(deltas)

    def feed(self, delta: str, tools: list[dict], *,
             final: bool = False) -> tuple[str, list[CallDelta]]:
        if self._stream is None:
            self._stream = _TaggedStream(self.start_tag, self.end_tag)
        return self._stream.feed(delta, final=final)


def join_deltas(deltas: list[CallDelta]) -> list[ParsedCall]:
    """The calls a stream of :class:`CallDelta` pieces adds up to."""
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for d in deltas:
        if d.name is not None:
            names[d.index] = d.name
        arguments.setdefault(d.index, []).append(d.arguments)
    return [ParsedCall(names[i], "".join(arguments[i])) for i in sorted(names)]


class _TaggedStream:
    """One output's text, parsed as it comes: outside text is content (whitespace next to
    a call held back until it is known not to be next to one), a block between the tags is
    held back until it names a function (a call: its arguments then stream as written) or
    cannot (its text goes to the content)."""

    def __init__(self, start_tag: str, end_tag: str) -> None:
        self.start_tag, self.end_tag = start_tag, end_tag
        self.pending = ""  # text not yet looked at (a partial tag, or all of it)
        self.held_space = ""  # outside whitespace that may turn out to precede a call
        self.after_call = False  # drop the whitespace that follows a call
        self.block: _CallScanner | None = None  # the open block, if any
        self.num_calls = 0

    def feed(self, delta: str, *, final: bool = False) -> tuple[str, list[CallDelta]]:
        self.pending += delta
        content: list[str] = []
        deltas: list[CallDelta] = []
        while True:
            if self.block is None:
                i = self.pending.find(self.start_tag)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self.pending, self.start_tag)
                    self._outside(self.pending[:len(self.pending) - keep], content)
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                self._outside(self.pending[:i], content)
                self.pending = self.pending[i + len(self.start_tag):]
                self.block = _CallScanner()
                continue
            j = self.pending.find(self.end_tag)
            closed = j >= 0 or final
            if j < 0:
                j = len(self.pending) - (0 if final else _partial_suffix(self.pending,
                                                                         self.end_tag))
            self.block.scan(self.pending[:j])
            self.pending = self.pending[j:]
            if self.block.name is None and (self.block.bad or closed):
                # not a call: the tag is content, and its body is read again as outside
                # text (it may hold the next block's start)
                self.pending = self.block.text + self.pending
                self.block = None
                self._outside(self.start_tag, content)
                continue
            if self.block.name is not None:
                self._stream_call(deltas, closed)
            if not closed:
                break
            self.pending = self.pending[len(self.end_tag):]
            self.block = None
            self.num_calls += 1
            self.after_call = True
        if final:
            content.append(self.held_space)
            self.held_space = ""
        return "".join(content), deltas

    def _outside(self, text: str, content: list[str]) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        body = text.rstrip()
        if body:
            content.append(self.held_space + body)
            self.held_space = text[len(body):]
        else:
            self.held_space += text

    def _stream_call(self, deltas: list[CallDelta], closed: bool) -> None:
        block = self.block
        if not block.opened:
            block.opened = True
            self.held_space = ""  # the whitespace before a call is not content
            self.after_call = False
            deltas.append(CallDelta(self.num_calls, block.name, ""))
        arguments = block.arguments(closed)
        if len(arguments) > block.sent:
            deltas.append(CallDelta(self.num_calls, None, arguments[block.sent:]))
            block.sent = len(arguments)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (to hold back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _CallScanner:
    """The body of one block, scanned a piece at a time as a JSON object, for the string
    value of its ``"name"`` key and the span of its ``"arguments"`` value (as written)."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.started = False  # the object's "{" was seen
        self.bad = False  # the body does not begin with "{": not a call
        self.in_string = self.escaped = False
        self.string_start = 0
        self.key: str | None = None
        self.expecting_value = False  # between a top-level key's ":" and its value
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_bare = False  # the arguments are a number or literal (ends at , } space)
        self.opened = False  # the call's first delta was sent
        self.sent = 0  # characters of arguments sent

    def arguments(self, closed: bool) -> str:
        if self.args_start is None:
            return "{}" if closed else ""
        end = self.args_end if self.args_end is not None else len(self.text)
        return self.text[self.args_start:end]

    def scan(self, piece: str) -> None:
        offset = len(self.text)
        self.text += piece
        for k, ch in enumerate(piece):
            if self.bad:
                return
            self._char(offset + k, ch)

    def _char(self, i: int, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 1:
                    self._top_level_string(self.text[self.string_start:i + 1], i)
            return
        if self.args_bare and self.args_end is None and (ch in ",}" or ch.isspace()):
            self.args_end = i
        if not self.started:
            if ch == "{":
                self.started, self.depth = True, 1
            elif not ch.isspace():
                self.bad = True
            return
        if self.depth == 0:
            return  # after the object: ignored
        opens_args = self.depth == 1 and self.expecting_value and self.key == "arguments" \
            and self.args_start is None
        if ch == '"':
            self.in_string, self.string_start = True, i
            if opens_args:
                self.args_start = i
        elif ch in "{[":
            if opens_args:
                self.args_start = i
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1 and self.args_start is not None and self.args_end is None:
                self.args_end = i + 1
            self.expecting_value = False
        elif self.depth == 1:
            if ch == ":":
                self.expecting_value = True
            elif ch == ",":
                self.expecting_value = False
            elif opens_args and not ch.isspace():
                self.args_start, self.args_bare = i, True

    def _top_level_string(self, literal: str, i: int) -> None:
        try:
            value = json.loads(literal)
        except json.JSONDecodeError:
            value = None
        if not self.expecting_value:
            self.key = value
            return
        self.expecting_value = False
        if self.key == "name" and self.name is None and isinstance(value, str) and value \
                and valid_text(value) is value:  # a name with a lone surrogate names nothing
            self.name = value
        elif self.key == "arguments" and self.args_end is None and self.args_start is not None:
            self.args_end = i + 1


_FEED = Method("feed", ("delta", "tools"), keywords=("final",),
               returns="tuple[str, list[CallDelta]]")


def parser_factory(parser) -> Callable[[], ToolParser]:
    """What makes a fresh parser per choice: from a registered name or a
    ``"module:Class"`` path, or a class (a factory called with no arguments). The parser it
    makes is checked against the contract here, naming what is wrong. An instance is
    refused: a streaming parser keeps one stream's state, so each stream needs its own."""
    if isinstance(parser, str):
        factory = resolve("tool_parser", parser)
    elif isinstance(parser, type) or (callable(parser) and not hasattr(parser, "extract")):
        factory = parser
    else:
        raise TypeError(
            f"tool_call_parser must be a registered name, an import path or a class (each "
            f"request gets a fresh parser), got the instance {parser!r}")
    sample = factory()
    check("tool_parser", sample)
    if hasattr(sample, "feed"):
        check("tool_parser", sample, (_FEED,))
    return factory

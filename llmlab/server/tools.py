"""Tool (function) calling on ``/v1/chat/completions``, as vLLM does it (docs/tool_calling.md).

``tools`` are checked (a 400 names the malformed field) and handed to the chat template
(``apply_chat_template(tools=...)``). ``tool_choice`` decides what the model may write:

* ``"none"``: nothing changes (the tools are still shown to the template, as vLLM does by
  default); the answer is plain content.
* ``"auto"`` (the default with tools, as in vLLM): the model writes freely and the server's
  tool-call parser (a ``tool_parser`` component, :mod:`llmlab.server.tool_parsers`) finds
  the calls in its text; the rest is content. Only with ``--enable-auto-tool-choice
  --tool-call-parser NAME`` (``build_app(enable_auto_tool_choice=True,
  tool_call_parser=...)``); without them a 400 naming the flags. ``finish_reason`` is
  ``"tool_calls"`` when the output made calls (as in vLLM).
* a named function (``{"type": "function", "function": {"name": ...}}``): the output is
  constrained to the function's ``parameters`` schema and returned as one tool call whose
  ``arguments`` is exactly the generated text. As in vLLM, ``finish_reason`` stays the
  engine's (``"stop"``), not ``"tool_calls"``.
* ``"required"``: the output is constrained to a JSON array of ``{"name": ..., "parameters":
  ...}`` objects (vLLM's ``anyOf`` schema), one tool call per element; its ``arguments``
  are the element's ``parameters`` text as generated. ``finish_reason`` is ``"tool_calls"``
  when generation stopped (as in vLLM).

Streamed (:class:`ToolStreamer`, one per choice), a call opens with a delta holding its id,
type, name and empty arguments; the argument text follows in fragments, which join into the
non-streamed ``arguments``. With ``"auto"`` the content streams as content until a call
starts (the parser holds back what may be the start of one, such as half a tag).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import attrs

from llmlab.sampling.params import StructuredOutputsParams
from llmlab.server import protocol as p
from llmlab.server.errors import APIError
from llmlab.server.tool_parsers import CallDelta, ParsedCall, ToolParser

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@attrs.define
class ToolMode:
    """What a chat request's tools ask of the run: ``kind`` is ``"named"``, ``"required"``
    or ``"auto"``; ``name`` the named function; for ``"auto"``, ``tools`` (as the template
    got them) and ``parser``, which makes a fresh tool-call parser per choice."""

    kind: str
    name: str | None = None
    tools: list[dict] = attrs.field(factory=list)
    parser: Callable[[], ToolParser] | None = None


def check_tools(request: p.ChatCompletionRequest, parser: Callable[[], ToolParser] | None = None,
                ) -> tuple[list[dict] | None, ToolMode | None]:
    """The request's tools in OpenAI's shape (for the template), and the mode (None: plain
    content). ``parser``: the server's tool-call parser factory (None: ``"auto"`` is not
    enabled). Every malformed piece is a 400 naming its field."""
    tools = _parse_tools(request.tools)
    choice = request.tool_choice
    if choice is None:
        # OpenAI's default: "auto" with tools, "none" without.
        choice = "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(
                f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                f'"function": {{"name": ...}}}}, got {choice!r}', param="tool_choice")
        if choice == "none":
            return (tools or None), None
        if not tools:
            if choice == "auto":
                return None, None
            raise APIError('tool_choice "required" needs tools', param="tool_choice")
        if choice == "auto":
            if parser is None:
                raise APIError(
                    'tool_choice "auto" (the default with tools) needs a tool-call parser: '
                    "start the server with --enable-auto-tool-choice and --tool-call-parser "
                    'NAME; or use "none", "required" or a named function', param="tool_choice")
            return tools, ToolMode("auto", tools=tools, parser=parser)
        return tools, ToolMode("required")
    name = _named_choice(choice)
    if not tools:
        raise APIError("a named tool_choice needs tools", param="tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise APIError(f"tool_choice names the function {name!r}, which is not in tools",
                       param="tool_choice.function.name")
    return tools, ToolMode("named", name)


def _parse_tools(tools: list[dict] | None) -> list[dict]:
    out = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise APIError(f"{where}.type must be \"function\", got {tool.get('type')!r}",
                           param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(f"{where}.function must be an object with a name",
                           param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(f"{where}.function.name must be a non-empty string, got {name!r}",
                           param=f"{where}.function.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise APIError(f"{where}.function.description must be a string",
                           param=f"{where}.function.description")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = dict(_EMPTY_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise APIError(
                f"{where}.function.parameters must be a JSON schema of type \"object\", got "
                f"{json.dumps(parameters)[:200]}", param=f"{where}.function.parameters")
        if any(t["function"]["name"] == name for t in out):
            raise APIError(f"{where}.function.name {name!r} is given twice",
                           param=f"{where}.function.name")
        out.append({"type": "function", "function": {
            **function, "name": name, "parameters": parameters}})
    return out


def _named_choice(choice: dict[str, Any]) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise APIError('a named tool_choice is {"type": "function", "function": {"name": ...}}, '
                       f"got {json.dumps(choice)[:200]}", param="tool_choice")
    return name


def tool_constraint(tools: list[dict], mode: ToolMode) -> StructuredOutputsParams:
    """The json schema the output must follow (vLLM's): the named function's parameters,
    or an array of at least one ``{"name", "parameters"}`` object of any tool."""
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if mode.kind == "named":
        schema = by_name[mode.name]
    else:
        schema = {
            "type": "array", "minItems": 1,
            "items": {"type": "object", "anyOf": [
                {"properties": {"name": {"type": "string", "enum": [name]},
                                "parameters": parameters},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, parameters in by_name.items()
            ]},
        }
    try:
        return StructuredOutputsParams(json=schema)
    except (ValueError, TypeError) as err:
        raise APIError(f"tools: {err}", param="tools") from err


def scan_calls(text: str) -> list[dict]:
    """The calls of a (possibly unfinished) ``[{"name": ..., "parameters": {...}}, ...]``
    text, as far as it goes: ``{"name", "start", "end"}`` each, ``start``/``end`` the span
    of the ``parameters`` value (None while not yet begun / finished)."""
    calls: list[dict] = []
    depth = 0
    in_str = escaped = False
    str_start = 0
    key = pending = None
    expecting = False  # after "key": inside an element, before its value
    for i, ch in enumerate(text):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
                if depth == 2 and calls:
                    value = json.loads(text[str_start:i + 1])
                    if expecting and key == "name":
                        calls[-1]["name"] = value
                        expecting = False
                    elif not expecting:
                        pending = value
            continue
        if ch == '"':
            in_str, str_start = True, i
        elif ch in "{[":
            if depth == 1 and ch == "{":
                calls.append({"name": None, "start": None, "end": None})
                expecting, key = False, None
            elif depth == 2 and calls and expecting and key == "parameters":
                calls[-1]["start"] = i
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 2 and calls and calls[-1]["start"] is not None \
                    and calls[-1]["end"] is None:
                calls[-1]["end"] = i + 1
                expecting = False
        elif ch == ":" and depth == 2:
            key, expecting = pending, True
        elif ch == "," and depth == 2:
            expecting = False
    return calls


def final_calls(mode: ToolMode, text: str) -> list[p.ToolCall] | None:
    """The tool calls of a finished named or required output (None: the text is not a
    complete call, as when generation ran out of tokens; it is then returned as content)."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return None
    if mode.kind == "named":
        return [p.ToolCall(id=tool_call_id(),
                           function=p.FunctionCall(name=mode.name, arguments=text))]
    if not isinstance(parsed, list):
        return None
    calls = scan_calls(text)
    if len(calls) != len(parsed) or any(c["name"] is None or c["end"] is None for c in calls):
        return None
    return [p.ToolCall(id=tool_call_id(), function=p.FunctionCall(
        name=c["name"], arguments=text[c["start"]:c["end"]])) for c in calls]


def final_message(mode: ToolMode | None, text: str) -> tuple[str | None, list[p.ToolCall] | None]:
    """A finished output's ``content`` and ``tool_calls`` (None: no calls)."""
    if mode is None:
        return text, None
    if mode.kind != "auto":
        calls = final_calls(mode, text)
        return (text, None) if calls is None else (None, calls)
    parser = mode.parser()
    content, parsed = _checked_extract(parser, parser.extract(text, mode.tools))
    if not parsed:
        return content or "", None
    return content, [p.ToolCall(id=tool_call_id(), function=p.FunctionCall(
        name=c.name, arguments=c.arguments)) for c in parsed]


def finish_reason(mode: ToolMode | None, reason: str | None, called: bool) -> str | None:
    """vLLM's: ``"tool_calls"`` when an auto choice made calls (whatever stopped it) or a
    required one stopped; a named one keeps the engine's reason."""
    if mode is None or reason is None:
        return reason
    if (mode.kind == "auto" and called) or (mode.kind == "required" and reason == "stop"):
        return "tool_calls"
    return reason


def _checked_extract(parser, result) -> tuple[str | None, list[ParsedCall]]:
    """A parser's ``extract`` answer, held to its contract (a broken user parser is named)."""
    try:
        content, calls = result
        calls = [ParsedCall(*c) for c in calls]
    except (TypeError, ValueError):
        calls = None
    if calls is None or not (content is None or isinstance(content, str)) or not all(
            isinstance(c.name, str) and c.name and isinstance(c.arguments, str)
            for c in calls):
        raise TypeError(f"tool parser {type(parser).__name__}.extract must return (content: "
                        f"str | None, [(name, arguments JSON text), ...]), got {result!r:.200}")
    return content, calls


@attrs.define
class ToolStreamer:
    """One choice's streamed tool calls: :meth:`feed` takes each text delta (``final``: the
    last) and returns the content and the ``delta.tool_calls`` it makes (either may be
    empty). ``called``: whether a call was opened."""

    mode: ToolMode
    text: str = ""
    sent: list[list] = attrs.field(factory=list)  # per call: [id, chars of arguments sent]
    parser: Any = None  # auto: this choice's parser

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[p.DeltaToolCall]]:
        if self.mode.kind == "auto":
            return self._feed_auto(delta, final)
        self.text += delta
        out: list[p.DeltaToolCall] = []
        if self.mode.kind == "named":
            if not self.sent:
                self.sent.append([tool_call_id(), 0])
                out.append(self._open(0, self.mode.name))
            if delta:
                out.append(p.DeltaToolCall(index=0, function=p.DeltaFunctionCall(
                    arguments=delta)))
            return "", out
        for index, call in enumerate(scan_calls(self.text)):
            if call["name"] is None or call["start"] is None:
                break
            if index == len(self.sent):
                self.sent.append([tool_call_id(), 0])
                out.append(self._open(index, call["name"]))
            end = call["end"] if call["end"] is not None else len(self.text)
            fragment = self.text[call["start"]:end][self.sent[index][1]:]
            if fragment:
                self.sent[index][1] += len(fragment)
                out.append(p.DeltaToolCall(index=index, function=p.DeltaFunctionCall(
                    arguments=fragment)))
        return "", out

    def _feed_auto(self, delta: str, final: bool) -> tuple[str, list[p.DeltaToolCall]]:
        if self.parser is None:
            self.parser = self.mode.parser()
        if hasattr(self.parser, "feed"):
            content, pieces = self.parser.feed(delta, self.mode.tools, final=final)
            if not isinstance(content, str):
                raise TypeError(f"tool parser {type(self.parser).__name__}.feed must return "
                                f"(content: str, [CallDelta, ...]), got content {content!r:.200}")
            return content, [d for piece in pieces for d in self._piece(CallDelta(*piece))]
        # a parser that cannot stream: everything comes with the last delta
        self.text += delta
        if not final:
            return "", []
        content, calls = _checked_extract(self.parser,
                                          self.parser.extract(self.text, self.mode.tools))
        out = []
        for index, call in enumerate(calls):
            out += self._piece(CallDelta(index, call.name, call.arguments))
        return content or "", out

    def _piece(self, piece: CallDelta) -> list[p.DeltaToolCall]:
        """A parser's call piece as ``delta.tool_calls`` entries (the opening one with the
        call's id, type and name and empty arguments, then the arguments)."""
        out = []
        if piece.name is not None:
            if piece.index != len(self.sent):
                raise TypeError(f"tool parser {type(self.parser).__name__} opened call "
                                f"{piece.index} after {len(self.sent)} calls")
            self.sent.append([tool_call_id(), 0])
            out.append(self._open(piece.index, piece.name))
        elif not 0 <= piece.index < len(self.sent):
            raise TypeError(f"tool parser {type(self.parser).__name__} sent arguments for "
                            f"call {piece.index}, which it never opened with a name")
        if piece.arguments:
            self.sent[piece.index][1] += len(piece.arguments)
            out.append(p.DeltaToolCall(index=piece.index, function=p.DeltaFunctionCall(
                arguments=piece.arguments)))
        return out

    def _open(self, index: int, name: str) -> p.DeltaToolCall:
        return p.DeltaToolCall(index=index, id=self.sent[index][0], type="function",
                               function=p.DeltaFunctionCall(name=name, arguments=""))


def template_tools(request) -> list[dict] | None:
    """A request's tools as the chat template gets them (None: no tools)."""
    return _parse_tools(getattr(request, "tools", None)) or None

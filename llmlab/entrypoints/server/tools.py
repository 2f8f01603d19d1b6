"""Tool (function) calling on ``/v1/chat/completions``, as vLLM does it (docs/tool_calling.md).

``tools`` are checked (a 400 names the malformed field; every key and string in a tool must
be valid Unicode and every value nest at most ``MAX_JSON_DEPTH`` deep) and handed to the
chat template (``apply_chat_template(tools=...)``). ``tool_choice`` decides what the model
may write:

* ``"none"``: nothing changes (the tools are still shown to the template, as vLLM does by
  default); the answer is plain content.
* ``"auto"`` (the default with tools, as in vLLM): the model writes freely and the server's
  tool-call parser (a ``tool_parser`` component, :mod:`llmlab.entrypoints.server.tool_parsers`) finds
  the calls in its text; the rest is content. Only with ``--enable-auto-tool-choice
  --tool-call-parser NAME`` (``build_app(enable_auto_tool_choice=True,
  tool_call_parser=...)``); without them a 400 naming the flags. ``finish_reason`` is
  ``"tool_calls"`` when the output made calls and stopped on its own.
* a named function (``{"type": "function", "function": {"name": ...}}``): the output is
  constrained to the function's ``parameters`` schema and returned as one tool call whose
  ``arguments`` is exactly the generated text. As in vLLM, ``finish_reason`` stays the
  engine's (``"stop"``), not ``"tool_calls"``.
* ``"required"``: the output is constrained to a JSON array of ``{"name": ..., "parameters":
  ...}`` objects (vLLM's ``anyOf`` schema), one tool call per element that has begun its
  ``parameters``; its ``arguments`` are the element's ``parameters`` text as generated.
  ``finish_reason`` is ``"tool_calls"`` when generation stopped on its own (as in vLLM).

Cut off by ``max_tokens``, a call that has begun is still a call, its ``arguments`` the text
written so far, and ``finish_reason`` is ``"length"`` (as OpenAI answers): the client can
tell it is unfinished. An output cut off before any call began is content.

Streamed (:class:`ToolStreamer`, one per choice), a call opens with a delta holding its id,
type, name and empty arguments; the argument text follows in fragments, which join into the
non-streamed ``arguments``. With ``"auto"`` the content streams as content until a call
starts (the parser holds back what may be the start of one, such as half a tag). The
non-streamed answer is what the stream adds up to, wherever the output was cut; text no
response can carry (a lone surrogate, from a parser's JSON escape) is made valid
(:func:`~llmlab.entrypoints.server.tool_parsers.valid_text`) on both paths.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import attrs

from llmlab.sampling.params import StructuredOutputsParams
from llmlab.entrypoints.server import protocol as p
from llmlab.entrypoints.server.errors import APIError
from llmlab.entrypoints.server.tool_parsers import CallDelta, ParsedCall, ToolParser, valid_text
from llmlab.validation import check_json, json_field

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
    _check_members("tool_choice", choice)
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
        # every key and string valid text, every value nested at most MAX_JSON_DEPTH deep
        _check_members(where, tool, skip="function")
        if tool.get("type", "function") != "function":
            raise APIError(f"{where}.type must be \"function\", got {tool.get('type')!r}",
                           param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(f"{where}.function must be an object with a name",
                           param=f"{where}.function")
        _check_members(f"{where}.function", function)
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


def _check_members(where: str, obj: dict[str, Any], skip: str | None = None) -> None:
    """Each member of the request object ``where`` as a JSON value of its own (its key and
    every string in it valid Unicode, nested at most ``MAX_JSON_DEPTH`` deep): a 400 naming
    the member otherwise (the message says where inside it). ``skip``: a member checked on
    its own."""
    for key, value in obj.items():
        field = json_field(where, key)
        try:
            check_json(field, key)
            if key != skip:
                check_json(field, value)
        except ValueError as err:
            raise APIError(str(err), param=field) from None


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
                    try:
                        value = json.loads(text[str_start:i + 1])
                    except json.JSONDecodeError:  # a bad escape (unconstrained text)
                        value = None
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
    """The tool calls of a finished named or required output, exactly as streaming it
    gives them (None: no call began, the text is then the content). A call cut off by
    ``max_tokens`` is still a call, with the ``arguments`` written so far: the choice's
    ``finish_reason`` ``"length"`` says it is unfinished (as OpenAI and vLLM answer)."""
    return final_message(mode, text)[1]


def final_message(mode: ToolMode | None, text: str) -> tuple[str | None, list[p.ToolCall] | None]:
    """A finished output's ``content`` and ``tool_calls`` (None: no calls): what its
    stream adds up to, however it was cut."""
    if mode is None:
        return text, None
    if mode.kind != "auto":
        content, deltas = ToolStreamer(mode).feed(text, final=True)
        calls = _joined(deltas)
        return (content, None) if not calls else (content or None, calls)
    parser = mode.parser()
    content, parsed = _checked_extract(parser, parser.extract(text, mode.tools))
    if not parsed:
        return content or "", None
    return content, [p.ToolCall(id=tool_call_id(), function=p.FunctionCall(
        name=c.name, arguments=c.arguments)) for c in parsed]


def _joined(deltas: list[p.DeltaToolCall]) -> list[p.ToolCall]:
    """The calls a list of ``delta.tool_calls`` entries adds up to."""
    calls: dict[int, p.ToolCall] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = p.ToolCall(id=d.id, function=p.FunctionCall(
                name=d.function.name, arguments=d.function.arguments or ""))
        else:
            calls[d.index].function.arguments += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def finish_reason(mode: ToolMode | None, reason: str | None, called: bool) -> str | None:
    """``"tool_calls"`` when an auto or required choice made calls and generation stopped
    on its own (``"stop"``); otherwise the engine's reason, so a call cut off by
    ``max_tokens`` says ``"length"`` (as OpenAI does; vLLM answers ``"tool_calls"`` for a
    cut-off auto call, which hides the cut). A named choice keeps the engine's reason, as
    in vLLM."""
    if mode is None or reason is None:
        return reason
    if reason == "stop" and called and mode.kind in ("auto", "required"):
        return "tool_calls"
    return reason


def _checked_extract(parser, result) -> tuple[str | None, list[ParsedCall]]:
    """A parser's ``extract`` answer, held to its contract (a broken user parser is named),
    with text no response can carry (a lone surrogate, which a JSON escape such as
    ``"\\ud800"`` decodes to) made valid (:func:`valid_text`)."""
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
    return (None if content is None else valid_text(content)), [
        ParsedCall(valid_text(c.name), valid_text(c.arguments)) for c in calls]


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
                out.append(self._open(index, valid_text(call["name"])))
            end = call["end"] if call["end"] is not None else len(self.text)
            fragment = self.text[call["start"]:end][self.sent[index][1]:]
            if fragment:
                self.sent[index][1] += len(fragment)
                out.append(p.DeltaToolCall(index=index, function=p.DeltaFunctionCall(
                    arguments=fragment)))
        if final and not self.sent:
            return self.text, out  # no call began (cut off early): the text is content
        return "", out

    def _feed_auto(self, delta: str, final: bool) -> tuple[str, list[p.DeltaToolCall]]:
        if self.parser is None:
            self.parser = self.mode.parser()
        if hasattr(self.parser, "feed"):
            content, pieces = self.parser.feed(delta, self.mode.tools, final=final)
            if not isinstance(content, str):
                raise TypeError(f"tool parser {type(self.parser).__name__}.feed must return "
                                f"(content: str, [CallDelta, ...]), got content {content!r:.200}")
            return valid_text(content), [
                d for piece in pieces for d in self._piece(CallDelta(*piece))]
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
            out.append(self._open(piece.index, valid_text(piece.name)))
        elif not 0 <= piece.index < len(self.sent):
            raise TypeError(f"tool parser {type(self.parser).__name__} sent arguments for "
                            f"call {piece.index}, which it never opened with a name")
        if piece.arguments:
            self.sent[piece.index][1] += len(piece.arguments)
            out.append(p.DeltaToolCall(index=piece.index, function=p.DeltaFunctionCall(
                arguments=valid_text(piece.arguments))))
        return out

    def _open(self, index: int, name: str) -> p.DeltaToolCall:
        return p.DeltaToolCall(index=index, id=self.sent[index][0], type="function",
                               function=p.DeltaFunctionCall(name=name, arguments=""))


def template_tools(request) -> list[dict] | None:
    """A request's tools as the chat template gets them (None: no tools)."""
    return _parse_tools(getattr(request, "tools", None)) or None

"""The ``tool_parser`` component kind and the built-in ``hermes`` parser: calls and content
from a whole output, the same from any split of it into streamed deltas (a tag split across
deltas included), malformed blocks left as content, and the contract checks."""

from __future__ import annotations

import pytest

from llmlab import registry
from llmlab.entrypoints.server.tool_parsers import (
    CallDelta,
    HermesToolParser,
    ParsedCall,
    join_deltas,
    parser_factory,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

CASES = [
    # text, content, calls
    ("Hello there.", "Hello there.", []),
    ("", None, []),
    (CALL, None, [("get_weather", '{"city": "Paris"}')]),
    ("Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\n",
     "Let me check.", [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]),
    # text after and between calls stays content (vLLM's drops it)
    (CALL + "\nDone.", "Done.", [("get_weather", '{"city": "Paris"}')]),
    # nested values and tags or braces inside strings
    ('<tool_call>{"name": "f", "arguments": {"q": "a}\\"</x>", "n": [1, {"b": []}]}}</tool_call>',
     None, [("f", '{"q": "a}\\"</x>", "n": [1, {"b": []}]}')]),
    # arguments first, no arguments, an escaped name
    ('<tool_call>{"arguments": {"z": 2}, "name": "h"}</tool_call>', None, [("h", '{"z": 2}')]),
    ('<tool_call>{"name": "h"}</tool_call>', None, [("h", "{}")]),
    ('<tool_call>{"name": "\\u00e9t\\u00e9", "arguments": {}}</tool_call>', None,
     [("\u00e9t\u00e9", "{}")]),
    # malformed blocks stay content as written; a later good one is still a call
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ('<tool_call>{"x": 1}</tool_call>', '<tool_call>{"x": 1}</tool_call>', []),
    ('<tool_call>oops <tool_call>{"name": "g", "arguments": {}}</tool_call>',
     "<tool_call>oops", [("g", "{}")]),
    # once named, a call: arguments as written, even when the model breaks off
    ('<tool_call>{"name": "f", "arguments": {"a": 1', None, [("f", '{"a": 1')]),
    ("Checking <tool_call>", "Checking <tool_call>", []),
    ("half a tag <tool_c", "half a tag <tool_c", []),
    ("an end tag alone </tool_call>", "an end tag alone </tool_call>", []),
    # a name that decodes to a lone surrogate names nothing (no response could carry it):
    # the block stays content as written; an escaped pair is one whole character
    ('<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "a\\udfffb", "arguments": {"x": "\\ud800"}}</tool_call> then '
     '<tool_call>{"name": "\\ud83d\\ude00", "arguments": {"x": "\\ud800"}}</tool_call>',
     '<tool_call>{"name": "a\\udfffb", "arguments": {"x": "\\ud800"}}</tool_call> then',
     [("\U0001f600", '{"x": "\\ud800"}')]),
]


def _streamed(text: str, step: int) -> tuple[str | None, list[ParsedCall]]:
    parser = HermesToolParser()
    content, deltas = "", []
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        c, d = parser.feed(piece, [], final=i == len(pieces) - 1)
        content += c
        deltas += d
    return content or None, join_deltas(deltas)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_hermes_extract_and_every_streamed_split_agree(text, content, calls):
    got = HermesToolParser().extract(text, [])
    assert got == (content, [ParsedCall(*c) for c in calls])
    for step in (1, 2, 3, 4, 7, 11):
        assert _streamed(text, step) == got, step


def test_every_parsed_name_and_content_is_valid_unicode():
    """What the parser hands on can always be encoded (issue 39: a lone surrogate from a
    JSON escape answered 500)."""
    from llmlab.entrypoints.server.tool_parsers import valid_text

    for text, _, _ in CASES:
        content, calls = HermesToolParser().extract(text, [])
        for piece in [content or "", *(x for c in calls for x in c)]:
            piece.encode("utf-8")
    assert valid_text("ok \u00e9") == "ok \u00e9"
    assert valid_text("a\ud800b\udfff") == "a\ufffdb\ufffd"


def test_a_split_tag_is_held_back_not_streamed_as_content():
    parser = HermesToolParser()
    out = [parser.feed(piece, []) for piece in ["Hi <to", "ol_", "call>", '{"name": "f"',
                                                 ', "arguments": {"a"', ": 1}}</tool", "_call>"]]
    assert [c for c, _ in out] == ["Hi", "", "", "", "", "", ""]
    deltas = [d for _, ds in out for d in ds]
    # the call opens once its name is known, then its arguments stream as they come
    assert deltas == [CallDelta(0, "f", ""), CallDelta(0, None, '{"a"'),
                      CallDelta(0, None, ": 1}")]
    assert parser.feed("", [], final=True) == ("", [])


def test_hermes_is_a_registered_component_that_keeps_its_contract():
    assert "hermes" in registry.available("tool_parser")
    assert registry.resolve("tool_parser", "hermes") is HermesToolParser
    registry.check("tool_parser", HermesToolParser())
    assert repr(registry.CONTRACTS["tool_parser"][0]) == (
        "extract(self, text, tools) -> tuple[str | None, list[ParsedCall]]")
    assert parser_factory("hermes") is HermesToolParser
    assert parser_factory("llmlab.entrypoints.server.tool_parsers:HermesToolParser") is HermesToolParser


def test_a_parser_with_the_wrong_call_shape_is_refused():
    class OneArgument:
        def extract(self, text): ...

    with pytest.raises(TypeError, match=r"extract.*expected extract\(self, text, tools\)"):
        parser_factory(OneArgument)

    class BadFeed:
        def extract(self, text, tools): ...
        def feed(self, delta): ...

    with pytest.raises(TypeError, match=r"feed.*expected feed\(self, delta, tools, \*, final\)"):
        parser_factory(BadFeed)


def test_the_parser_examples_in_docs_tool_calling_run(capsys):
    import pathlib
    import re

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "tool_calling.md").read_text()
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "register(" in b]
    exec(compile(example, "docs/tool_calling.md", "exec"), {})
    assert capsys.readouterr().out.splitlines() == [
        "('Sure.', [ParsedCall(name='f', arguments='{\"x\": 1}')])",
        "('Sure.', [('f', '{\"x\": 1}')])"]
    assert {"function_tags", "call_lines"} <= set(registry.available("tool_parser"))
    for name in ("function_tags", "call_lines"):
        parser_factory(name)  # both keep the contract

"""Client JSON that must not reach a 500 (issue 39): a schema, a tool or template arguments
nested ~500 deep (``RecursionError`` in ``freeze_json`` answered 500 and closed the
connection), and lone surrogates in tool names, descriptions and parameters, in template
arguments and earlier tool calls. Each is a 400 naming the field (and, for depth, the
limit), nothing is queued, and the server goes on."""

from __future__ import annotations

import json

import httpx
import pytest

from llmlab.validation import MAX_JSON_DEPTH

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
S = "\ud800"  # a lone surrogate: valid in JSON text (as an escape), not in UTF-8


def _schema_text(wraps: int) -> str:
    """An object schema ``1 + 2 * wraps`` levels deep, as JSON text (built without
    recursion: json.dumps itself fails a little past 500 levels)."""
    return '{"type":"object","properties":{"a":' * wraps + '{"type":"object"}' + "}}" * wraps


DEEP = _schema_text(250)  # 501 levels


def _post(url: str, route: str, body: dict, **raw: str) -> httpx.Response:
    """POST ``body`` as ASCII JSON (a lone surrogate travels as ``\\ud800``, as a client in
    another language sends it); each ``raw`` value is JSON text put in at the path its
    name gives (``"tools.0.function.parameters"``), in place of the ``"@name"`` string."""
    text = json.dumps(body)
    for name, value in raw.items():
        text = text.replace(json.dumps(f"@{name}"), value)
    return httpx.post(url + route, content=text.encode("ascii"),
                      headers={"Content-Type": "application/json"}, timeout=60)


def _ok(url: str) -> None:
    r = httpx.post(url + CHAT, json={"model": "tiny", "messages": MSG, "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200, r.text


def _tool(**function) -> dict:
    return {"type": "function", "function": {"name": "f", **function}}


DEEP_CASES = [
    # (route, body, raw JSON put in at "@x", the param the 400 names)
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": "@x"}}}, "response_format.json_schema.schema"),
    (COMP, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": "@x"}}}, "response_format.json_schema.schema"),
    (CHAT, {"guided_json": "@x"}, "guided_json"),
    (COMP, {"guided_json": "@x"}, "guided_json"),
    (CHAT, {"structured_outputs": {"json": "@x"}}, "structured_outputs.json"),
    (CHAT, {"tools": [_tool(parameters="@x")], "tool_choice": "required"},
     "tools[0].function.parameters"),
    (CHAT, {"tools": [_tool(parameters="@x")],
            "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
    (CHAT, {"tools": [_tool(parameters="@x")], "tool_choice": "none"},
     "tools[0].function.parameters"),
    (CHAT, {"tools": [_tool(parameters="@x")]}, "tools[0].function.parameters"),  # auto
    (CHAT, {"tools": [_tool(), _tool(name="g", strict="@x")], "tool_choice": "none"},
     "tools[1].function.strict"),
    (CHAT, {"tools": [_tool()], "tool_choice": {"type": "function", "function": {
        "name": "f", "x": "@x"}}}, "tool_choice.function"),
    (CHAT, {"chat_template_kwargs": {"deep": "@x"}}, "chat_template_kwargs"),
    (CHAT, {"messages": [{"role": "assistant", "content": "", "tool_calls": ["@x"]}, *MSG]},
     "messages.0.tool_calls"),
    (CHAT, {"vllm_xargs": {"deep": "@x"}}, "vllm_xargs"),
    ("/tokenize", {"messages": MSG, "tools": [_tool(parameters="@x")]},
     "tools[0].function.parameters"),
]


# the schema as JSON text (a string holding the schema), which these fields also take
DEEP_CASES += [(route, {**body, "as_text": True}, param) for route, body, param in DEEP_CASES
               if param in ("guided_json", "structured_outputs.json")]


@pytest.mark.parametrize(("route", "body", "param"), DEEP_CASES,
                         ids=[f"{c[0]}:{c[2]}{':text' * ('as_text' in c[1])}"
                              for c in DEEP_CASES])
def test_json_nested_500_deep_is_a_400_naming_the_field_and_the_limit(
        served, route, body, param):
    url, app = served
    body = dict(body)
    deep = json.dumps(DEEP) if body.pop("as_text", False) else DEEP
    base = {"prompt": "hi"} if route == COMP else {"messages": MSG}
    r = _post(url, route, {"model": "tiny", "max_tokens": 2, **base, **body}, x=deep)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert f"at most {MAX_JSON_DEPTH} levels" in error["message"]
    assert app.state.engine.num_open_requests == 0  # nothing was queued
    _ok(url)


def test_a_schema_at_the_depth_limit_is_served(served):
    url, _ = served
    at_limit = _schema_text((MAX_JSON_DEPTH - 2) // 2)  # 63 levels
    for body in ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "r", "schema": "@x"}}},
            {"tools": [_tool(parameters="@x")], "tool_choice": "required"}):
        r = _post(url, CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 2, **body},
                  x=at_limit)
        assert r.status_code == 200, r.text


SURROGATE_CASES = [
    # (route, body, the param the 400 names)
    # a named choice of a tool so named answered 500 (the call could not be serialized)
    (CHAT, {"tools": [_tool(name=S)], "tool_choice": {"type": "function",
                                                       "function": {"name": S}}},
     "tools[0].function.name"),
    (CHAT, {"tools": [_tool(name=S)], "tool_choice": "none"}, "tools[0].function.name"),
    (CHAT, {"tools": [_tool(name="a" + S)], "tool_choice": "required"},
     "tools[0].function.name"),
    (CHAT, {"tools": [_tool(name=S)]}, "tools[0].function.name"),  # auto
    (CHAT, {"tools": [_tool(description="x" + S)], "tool_choice": "none"},
     "tools[0].function.description"),
    (CHAT, {"tools": [_tool(parameters={"type": "object", "properties": {
        "city": {"type": "string", "description": S}}})], "tool_choice": "none"},
     "tools[0].function.parameters"),
    (CHAT, {"tools": [_tool(parameters={"type": "object", "properties": {S: {}}})],
            "tool_choice": "required"}, "tools[0].function.parameters"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}, S: 1}],
            "tool_choice": "none"}, "tools[0]['\\ud800']"),
    (CHAT, {"tools": [_tool()], "tool_choice": {"type": "function",
                                                "function": {"name": S}}},
     "tool_choice.function"),
    (CHAT, {"chat_template_kwargs": {"x": [S]}}, "chat_template_kwargs"),
    (CHAT, {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": S, "arguments": "{}"}}]}, *MSG]},
     "messages.0.tool_calls"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": S, "schema": {"type": "object"}}}}, "response_format.json_schema.name"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "description": S}}}},
     "response_format.json_schema.schema"),
    (CHAT, {"guided_json": json.dumps({"type": "string", "description": S})}, "guided_json"),
    (CHAT, {"structured_outputs": {"json": {"enum": [S]}}}, "structured_outputs.json"),
    ("/tokenize", {"tools": [_tool(description=S)]}, "tools[0].function.description"),
    ("/tokenize", {"chat_template_kwargs": {"x": S}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize(("route", "body", "param"), SURROGATE_CASES,
                         ids=[f"{c[0]}:{c[2]}" for c in SURROGATE_CASES])
def test_a_lone_surrogate_in_tools_and_json_fields_is_a_400_naming_the_field(
        served, route, body, param):
    url, app = served
    r = _post(url, route, {"model": "tiny", "messages": MSG, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert "is not valid Unicode text" in error["message"]
    assert "lone surrogate" in error["message"]
    assert app.state.engine.num_open_requests == 0
    _ok(url)


def test_a_template_that_renders_the_tools_never_sees_a_surrogate(served):
    """With a template that shows the tools (as real ones do), the tokenizer used to fail
    on the rendered text with a message naming no field."""
    url, app = served
    serving = app.state.serving
    old = serving.chat_template
    serving.chat_template = ("{% for t in tools or [] %}{{ t.function.description }}"
                             "{% endfor %}{{ x }}{% for m in messages %}{{ m.content }}"
                             "{% endfor %}")
    try:
        for body, param in (({"tools": [_tool(description=S)], "tool_choice": "none"},
                             "tools[0].function.description"),
                            ({"chat_template_kwargs": {"x": S}}, "chat_template_kwargs")):
            for route in (CHAT, "/tokenize"):
                r = _post(url, route, {"model": "tiny", "messages": MSG, "max_tokens": 2,
                                       **body})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == param
    finally:
        serving.chat_template = old

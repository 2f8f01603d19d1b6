"""Tool calling on ``/v1/chat/completions`` with the official ``openai`` client: named and
required tool choices constrained to the tools' schemas, streamed calls that reassemble
into the non-streamed ones, and malformed tools refused naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("openai")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}
DAYS = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 0,
                                                  "maximum": 9}},
        "required": ["days"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": CITY}},
    {"type": "function", "function": {"name": "forecast", "parameters": DAYS}},
]
SCHEMAS = {"get_weather": CITY, "forecast": DAYS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _create(client, **kwargs):
    kwargs.setdefault("max_tokens", 48)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                          **kwargs)


def _reassemble(chunks) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content  # tool calls only (the opening "" aside)
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:  # a call opens with its id, type and name
                    assert d.id.startswith("call_") and d.type == "function"
                    assert d.function.name and d.function.arguments == ""
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)], finish


def test_named_tool_choice_follows_the_schema(client):
    for seed in range(4):
        got = _create(client, tool_choice=NAMED, temperature=1.0, seed=seed)
        choice = got.choices[0]
        assert choice.message.content is None
        assert choice.finish_reason == "stop"  # vLLM's, for a named tool_choice
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), CITY)


def test_required_tool_choice_gives_calls_of_known_tools(client):
    finished = 0
    for seed in range(4):
        got = _create(client, tool_choice="required", temperature=1.0, seed=seed,
                      max_tokens=120)
        choice = got.choices[0]
        if choice.finish_reason == "length":  # random weights: an array may run long
            continue
        finished += 1
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert finished  # not every seed ran out of tokens


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_streamed_calls_reassemble_into_the_full_call(client, tool_choice):
    compared = 0
    for seed in range(3):
        full = _create(client, tool_choice=tool_choice, temperature=1.0, seed=seed,
                       max_tokens=120)
        if full.choices[0].finish_reason == "length":
            continue
        streamed, finish = _reassemble(_create(client, tool_choice=tool_choice, temperature=1.0,
                                               seed=seed, max_tokens=120, stream=True))
        want = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in full.choices[0].message.tool_calls]
        assert streamed == want
        assert finish == full.choices[0].finish_reason
        compared += 1
    assert compared


def test_tool_choice_none_is_plain_content(client):
    got = _create(client, tool_choice="none", temperature=0.0, max_tokens=6)
    assert got.choices[0].message.tool_calls is None
    assert isinstance(got.choices[0].message.content, str)


def test_tools_reach_the_chat_template(served):
    url, app = served
    serving = app.state.serving
    old = serving.chat_template
    serving.chat_template = ("{% for t in tools or [] %}<{{ t.function.name }}>{% endfor %}"
                             "{% for m in messages %}{{ m.content }}{% endfor %}")
    try:
        r = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": MESSAGES,
                                                "tools": TOOLS, "add_special_tokens": False})
        assert r.status_code == 200, r.text
        text = httpx.post(f"{url}/detokenize",
                          json={"model": "tiny", "tokens": r.json()["tokens"]}).json()["prompt"]
    finally:
        serving.chat_template = old
    assert "<get_weather><forecast>" in text


@pytest.mark.parametrize(("tools", "tool_choice", "param"), [
    ([{"type": "function", "function": {"parameters": CITY}}], NAMED,
     "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "required", "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}],
     "required", "tools[0].function.parameters"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, "auto", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_malformed_tools_are_400s_naming_the_field(served, tools, tool_choice, param):
    url, _ = served
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "tool_choice": tool_choice}
    if tools is not None:
        body["tools"] = tools
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_auto_without_a_parser_says_so(served):
    url, _ = served
    r = httpx.post(f"{url}/v1/chat/completions",
                   json={"model": "tiny", "messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 400
    assert "tool-call parser" in r.json()["error"]["message"]


def test_tool_choice_excludes_other_constraints(served):
    url, _ = served
    r = httpx.post(f"{url}/v1/chat/completions",
                   json={"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                         "tool_choice": NAMED, "guided_choice": ["a"]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tool_choice"


def test_required_calls_stream_char_by_char():
    from llmlab.server.tools import ToolMode, ToolStreamer, final_calls

    text = ('[{"name":"get_weather","parameters":{"city":"a}\\"[,"}},'
            '{"name":"forecast","parameters":{"days":3,"x":{"y":[1,{}]}}}]')
    mode = ToolMode("required")
    want = [(c.function.name, c.function.arguments) for c in final_calls(mode, text)]
    assert want == [("get_weather", '{"city":"a}\\"[,"}'),
                    ("forecast", '{"days":3,"x":{"y":[1,{}]}}')]
    streamer = ToolStreamer(mode)
    got: dict[int, list] = {}
    for ch in text:
        for d in streamer.feed(ch):
            if d.function.name is not None:
                got[d.index] = [d.function.name, ""]
            got[d.index][1] += d.function.arguments
    assert [tuple(v) for _, v in sorted(got.items())] == want
    assert final_calls(mode, text[:-3]) is None  # unfinished: returned as content

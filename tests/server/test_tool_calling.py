"""Tool calling on ``/v1/chat/completions`` with the official ``openai`` client: named and
required tool choices constrained to the tools' schemas, ``auto`` with a tool-call parser
(the model made to write a given text by a ``guided_regex``, which ``auto`` allows), streamed
calls that reassemble into the non-streamed ones, malformed tools refused naming the field,
and ``LLM.chat(tools=...)``."""

from __future__ import annotations

import json
import re

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
    for seed in range(20):
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
    for seed in range(20):
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
    assert finished >= 10  # most seeds finish their array within the tokens


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
    (TOOLS, "auto", "tool_choice"),  # this server has no --enable-auto-tool-choice
    (None, "required", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "none",
     "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function",
                                                       "function": {"name": "f"}}],
     "none", "tools[1].function.name"),
    ([{"type": "retrieval"}], "none", "tools[0].type"),
])
def test_malformed_tools_are_400s_naming_the_field(served, tools, tool_choice, param):
    url, _ = served
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "tool_choice": tool_choice}
    if tools is not None:
        body["tools"] = tools
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_auto_without_enabling_it_names_the_flags(served):
    url, _ = served
    for body in ({}, {"tool_choice": "auto"}):  # "auto" is the default with tools, as in vLLM
        r = httpx.post(f"{url}/v1/chat/completions",
                       json={"model": "tiny", "messages": MESSAGES, "tools": TOOLS, **body})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in error["message"]
        assert "--tool-call-parser" in error["message"]


def test_tool_choice_excludes_other_constraints(served):
    url, _ = served
    r = httpx.post(f"{url}/v1/chat/completions",
                   json={"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                         "tool_choice": NAMED, "guided_choice": ["a"]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tool_choice"


def test_required_calls_stream_char_by_char():
    from llmlab.entrypoints.server.tools import ToolMode, ToolStreamer, final_calls, final_message

    text = ('[{"name":"get_weather","parameters":{"city":"a}\\"[,"}},'
            '{"name":"forecast","parameters":{"days":3,"x":{"y":[1,{}]}}}]')
    mode = ToolMode("required")
    want = [(c.function.name, c.function.arguments) for c in final_calls(mode, text)]
    assert want == [("get_weather", '{"city":"a}\\"[,"}'),
                    ("forecast", '{"days":3,"x":{"y":[1,{}]}}')]
    streamer = ToolStreamer(mode)
    got: dict[int, list] = {}
    for ch in text:
        content, deltas = streamer.feed(ch)
        assert content == ""
        for d in deltas:
            if d.function.name is not None:
                got[d.index] = [d.function.name, ""]
            got[d.index][1] += d.function.arguments
    assert [tuple(v) for _, v in sorted(got.items())] == want
    # cut off (max_tokens): the calls as far as written; before any call began: content
    cut = [(c.function.name, c.function.arguments) for c in final_calls(mode, text[:-3])]
    assert cut == [want[0], ("forecast", '{"days":3,"x":{"y":[1,{}]}')]
    assert final_calls(mode, text[:20]) is None
    assert final_message(mode, text[:20]) == (text[:20], None)


# -- truncation: the streamed answer and the full one say the same ----------------------

TRUNCATED = {
    "named": '{"city": "Par\\"is", "x": [1, {"y": "}"}]}',
    "required": ('[{"name": "get_weather", "parameters": {"city": "a}\\"[,"}}, '
                 '{"name": "forecast", "parameters": {"days": 3}}]'),
    # content before, between and after the calls
    "auto": ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": '
             '"Paris"}}\n</tool_call> and <tool_call>{"name": "forecast", "arguments": '
             '{"days": 3}}</tool_call> done'),
}


def _mode(kind):
    from llmlab.entrypoints.server.tool_parsers import HermesToolParser
    from llmlab.entrypoints.server.tools import ToolMode

    return ToolMode(kind, name="get_weather" if kind == "named" else None, tools=TOOLS,
                    parser=HermesToolParser)


def _assembled(mode, text: str, step: int, reason: str):
    """What a client assembles from the stream of ``text`` in deltas of ``step``
    characters: (content, [(name, arguments)], finish_reason)."""
    from llmlab.entrypoints.server.tools import ToolStreamer, finish_reason

    streamer = ToolStreamer(mode)
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        got, deltas = streamer.feed(piece, final=i == len(pieces) - 1)
        content += got
        for d in deltas:
            if d.function.name is not None:
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments
    return (content or None, [tuple(calls[i]) for i in sorted(calls)],
            finish_reason(mode, reason, streamer.called))


def _whole(mode, text: str, reason: str):
    """The non-streamed answer in the same shape."""
    from llmlab.entrypoints.server.tools import final_message, finish_reason

    content, calls = final_message(mode, text)
    calls = [(c.function.name, c.function.arguments) for c in calls or []]
    return content or None, calls, finish_reason(mode, reason, bool(calls))


@pytest.mark.parametrize("kind", ["named", "required", "auto"])
def test_a_cut_off_output_streams_what_the_full_answer_says(kind):
    """Issue 39: cut by max_tokens anywhere (every character here), the streamed deltas
    add up to the non-streamed message: the same content, the same calls with the same
    arguments, the same finish_reason ("length": a call that began is reported, unfinished)."""
    mode, text = _mode(kind), TRUNCATED[kind]
    for cut in range(len(text) + 1):
        reason = "stop" if cut == len(text) else "length"
        whole = _whole(mode, text[:cut], reason)
        for step in (1, 2, 5, len(text)):
            assert _assembled(mode, text[:cut], step, reason) == whole, (cut, step)
        content, calls, finish = whole
        if calls:
            assert finish == ("length" if reason == "length" else
                              "stop" if kind == "named" else "tool_calls")
        elif kind != "auto":  # cut before any call began: the text is content
            assert content == (text[:cut] or None) and finish == reason
    assert _whole(mode, text, "stop")[1]  # the whole text makes calls


def test_a_parser_that_decodes_a_lone_surrogate_cannot_break_the_response():
    from llmlab.entrypoints.server.tools import ToolMode, ToolStreamer, final_message

    class Decoding:
        """A user parser that hands back decoded JSON text (a lone surrogate)."""

        def extract(self, text, tools):
            return "a\ud800", [("f\udfff", '{"q": "\ud800"}')]

    mode = ToolMode("auto", tools=TOOLS, parser=Decoding)
    content, calls = final_message(mode, "x")
    assert content == "a\ufffd"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("f\ufffd", '{"q": "\ufffd"}')]
    streamer = ToolStreamer(mode)
    assert streamer.feed("x") == ("", [])
    content, deltas = streamer.feed("", final=True)
    assert content == "a\ufffd"
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        ("f\ufffd", ""), (None, '{"q": "\ufffd"}')]
    for d in deltas:
        d.model_dump_json()  # serializable


# -- tool_choice "auto": a tool-call parser reads the model's text -----------------------

HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "forecast", "arguments": '
               '{"days": 3}}\n</tool_call>')
HERMES_CALLS = [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                {"name": "forecast", "arguments": '{"days": 3}'}]


@pytest.fixture(scope="module")
def auto_url(served):
    """A second app on the session's engine, with auto tool choice and the hermes parser."""
    from llmlab.entrypoints.server.app import build_app
    from tests.server.conftest import running

    app = build_app(served[1].state.engine, served_model_names=["tiny"], shutdown_engine=False,
                    enable_auto_tool_choice=True, tool_call_parser="hermes")
    with running(app) as url:
        yield url


def _openai(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _forced(client, text, stream=False, **kwargs):
    """A chat completion whose output is exactly ``text`` (a guided_regex of it): the real
    engine and model, made to write what a tool-calling model would."""
    return client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0.0,
        stream=stream, extra_body={"guided_regex": re.escape(text)}, **kwargs)


def _reassemble_auto(chunks) -> tuple[str, list[dict], str | None, int]:
    """Streamed content, calls, finish_reason and the number of chunks with content."""
    content, calls, finish, pieces = "", {}, None, 0
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            if choice.delta.content:
                content += choice.delta.content
                pieces += 1
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id.startswith("call_") and d.type == "function"
                    assert d.function.name and d.function.arguments == ""
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments
    return content, [calls[i] for i in sorted(calls)], finish, pieces


def test_auto_finds_hermes_calls_in_the_text(auto_url):
    client = _openai(auto_url)
    for tool_choice in ("auto", None):  # None: auto is the default with tools
        extra = {} if tool_choice is None else {"tool_choice": tool_choice}
        got = _forced(client, HERMES_TEXT, **extra)
        choice = got.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me look."
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls]
        assert calls == HERMES_CALLS
        assert all(c.id.startswith("call_") and c.type == "function"
                   for c in choice.message.tool_calls)
        assert len({c.id for c in choice.message.tool_calls}) == 2


def test_auto_streamed_deltas_reassemble_into_the_full_response(auto_url, served):
    # the tags come in several tokens, so in several deltas: the parser holds half a tag back
    tokenizer = served[1].state.serving.tokenizer
    assert len(tokenizer.encode("<tool_call>", add_special_tokens=False)) > 1
    client = _openai(auto_url)
    full = _forced(client, HERMES_TEXT).choices[0]
    content, calls, finish, pieces = _reassemble_auto(_forced(client, HERMES_TEXT, stream=True))
    assert content == full.message.content == "Let me look."
    assert pieces > 1  # the content streamed as it came, token by token
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in full.message.tool_calls] == HERMES_CALLS
    assert finish == full.finish_reason == "tool_calls"


def test_auto_parses_each_choice_on_its_own(auto_url):
    client = _openai(auto_url)
    full = _forced(client, HERMES_TEXT, n=2)
    assert [len(c.message.tool_calls) for c in full.choices] == [2, 2]
    chunks = list(_forced(client, HERMES_TEXT, stream=True, n=2))
    for index in range(2):
        mine = [ch.model_copy(update={"choices": [c for c in ch.choices if c.index == index]})
                for ch in chunks]
        content, calls, finish, _ = _reassemble_auto(mine)
        assert (content, calls, finish) == ("Let me look.", HERMES_CALLS, "tool_calls")


def test_auto_without_a_call_is_plain_content(auto_url):
    client = _openai(auto_url)
    text = "No tool needed <tool_call>not json</tool_call>, thanks."
    full = _forced(client, text).choices[0]
    assert full.message.content == text and full.message.tool_calls is None
    assert full.finish_reason == "stop"
    content, calls, finish, _ = _reassemble_auto(_forced(client, text, stream=True))
    assert (content, calls, finish) == (text, [], "stop")


def test_a_parser_registered_by_the_user_is_used_by_name(served):
    from llmlab import register
    from llmlab.entrypoints.server.app import build_app
    from llmlab.entrypoints.server.tool_parsers import HermesToolParser
    from tests.server.conftest import running

    @register("tool_parser", "test_call_tags")
    class CallTags(HermesToolParser):
        """``<call>{...}</call>`` blocks."""

        start_tag, end_tag = "<call>", "</call>"

    @register("tool_parser", "test_lines")
    class Lines:
        """One call per ``CALL name {json}`` line; cannot stream."""

        def extract(self, text, tools):
            calls = [tuple(line[5:].split(" ", 1)) for line in text.splitlines()
                     if line.startswith("CALL ")]
            rest = "\n".join(line for line in text.splitlines() if not line.startswith("CALL "))
            return rest or None, calls

    cases = {"test_call_tags": 'Hi <call>{"name": "forecast", "arguments": {"days": 2}}</call>',
             "test_lines": 'Hi\nCALL forecast {"days": 2}'}
    for name, text in cases.items():
        app = build_app(served[1].state.engine, served_model_names=["tiny"],
                        shutdown_engine=False, enable_auto_tool_choice=True,
                        tool_call_parser=name)
        with running(app) as url:
            client = _openai(url)
            full = _forced(client, text).choices[0]
            assert full.message.content == "Hi"
            (call,) = full.message.tool_calls
            assert (call.function.name, call.function.arguments) == ("forecast", '{"days": 2}')
            content, calls, finish, _ = _reassemble_auto(_forced(client, text, stream=True))
            assert (content, finish) == ("Hi", "tool_calls")
            assert calls == [{"name": "forecast", "arguments": '{"days": 2}'}]


def test_auto_tool_choice_settings_are_checked_when_the_app_is_built(served):
    from llmlab.entrypoints.server.app import build_app
    from llmlab.entrypoints.server.tool_parsers import HermesToolParser

    engine = served[1].state.engine
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        build_app(engine, shutdown_engine=False, enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown tool_parser 'nope'; available: .*hermes"):
        build_app(engine, shutdown_engine=False, enable_auto_tool_choice=True,
                  tool_call_parser="nope")
    with pytest.raises(TypeError, match="each request gets a fresh parser"):
        build_app(engine, shutdown_engine=False, enable_auto_tool_choice=True,
                  tool_call_parser=HermesToolParser())

    class NoExtract:
        def parse(self, text): ...

    with pytest.raises(TypeError, match=r"missing method 'extract'; expected "
                                        r"extract\(self, text, tools\)"):
        build_app(engine, shutdown_engine=False, enable_auto_tool_choice=True,
                  tool_call_parser=NoExtract)


def test_llm_chat_passes_tools_to_the_template(reference):
    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    params = __import__("llmlab").SamplingParams(max_tokens=1)
    with_tools = reference.chat(MESSAGES, params, chat_template=template, tools=TOOLS,
                                use_tqdm=False)[0]
    without = reference.chat(MESSAGES, params, chat_template=template, use_tqdm=False)[0]
    tokenizer = reference.get_tokenizer()
    want = tokenizer.encode("[get_weather][forecast]Weather in Paris?")
    assert with_tools.prompt_token_ids == want
    assert without.prompt_token_ids == tokenizer.encode("Weather in Paris?")


def test_serve_flags_enable_auto_tool_choice(tiny_llama):
    import signal

    from tests.server.test_serve_cli import start_server

    proc, url = start_server([tiny_llama, "--served-model-name", "tiny", "--dtype", "float32",
                              "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    try:
        got = _forced(_openai(url), HERMES_TEXT).choices[0]
        assert got.finish_reason == "tool_calls"
        assert [{"name": c.function.name, "arguments": c.function.arguments}
                for c in got.message.tool_calls] == HERMES_CALLS
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 0


@pytest.mark.parametrize(("flags", "message"), [
    (["--tool-call-parser", "nope"], "unknown tool_parser 'nope'; available: hermes"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
])
def test_serve_refuses_bad_tool_flags_before_loading_the_model(tmp_path, capsys, flags, message):
    from llmlab.entrypoints.cli import main

    assert main(["serve", str(tmp_path / "no-model"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def _answers(url, body: dict) -> tuple:
    """The non-streamed and the streamed answer to ``body`` (a chat request), each as
    (content, [(name, arguments)], finish_reason); the stream must be well formed."""
    full = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert full.status_code == 200, full.text
    choice = full.json()["choices"][0]
    message = choice["message"]
    whole = (message["content"] or None,
             [(c["function"]["name"], c["function"]["arguments"])
              for c in message["tool_calls"] or []], choice["finish_reason"])
    content, calls, finish = "", {}, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            finish = c["finish_reason"] or finish
            content += c["delta"]["content"] or ""
            for d in c["delta"]["tool_calls"] or []:
                if d["function"]["name"] is not None:
                    calls[d["index"]] = [d["function"]["name"], ""]
                calls[d["index"]][1] += d["function"]["arguments"]
    streamed = (content or None, [tuple(calls[i]) for i in sorted(calls)], finish)
    return whole, streamed, full.json()["usage"]["completion_tokens"]


@pytest.mark.parametrize("kind", ["named", "required", "auto"])
def test_cut_off_calls_stream_what_the_full_answer_says_on_the_real_model(auto_url, kind):
    """Issue 39 (18 of 36 choices differed): for max_tokens from 1 to past the whole
    output, the streamed deltas add up to the non-streamed message exactly."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "temperature": 0.0}
    if kind == "auto":
        body["guided_regex"] = re.escape(HERMES_TEXT)
    else:
        body["tool_choice"] = NAMED if kind == "named" else "required"
    _, _, length = _answers(auto_url, {**body, "max_tokens": 200})
    assert length < 200  # the whole output fits: every cut below is a real cut
    cuts = sorted({*range(1, min(length, 12) + 1), *range(1, length + 2, max(1, length // 12))})
    with ThreadPoolExecutor(8) as pool:  # concurrent: the engine batches them
        results = list(pool.map(lambda k: _answers(auto_url, {**body, "max_tokens": k}), cuts))
    for k, (whole, streamed, _) in zip(cuts, results):
        assert streamed == whole, k
        if k < length:
            assert whole[2] == "length", k  # cut: a call it began is reported, unfinished
    assert results[-1][0][1]  # the whole output made calls


def test_a_call_whose_name_decodes_to_a_lone_surrogate_is_content_not_a_500(auto_url):
    """Issue 39: the model wrote ``"name": "\\ud800"`` (a JSON escape of a lone surrogate)
    in a block: the non-streamed answer was a 500, the stream an error event. The block is
    no call (no response can carry that name): it stays content, streamed or not; a
    surrogate escape inside the arguments is valid JSON text and stays as written."""
    bad = '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>'
    good = '<tool_call>{"name": "forecast", "arguments": {"q": "\\udfff"}}</tool_call>'
    text = f"{bad} then {good}"
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "temperature": 0.0,
            "max_tokens": 200, "guided_regex": re.escape(text)}
    whole, streamed, _ = _answers(auto_url, body)
    assert whole == streamed == (f"{bad} then", [("forecast", '{"q": "\\udfff"}')],
                                 "tool_calls")
    r = httpx.post(f"{auto_url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 2, "tool_choice": "none"})
    assert r.status_code == 200  # and the server goes on

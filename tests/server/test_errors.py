"""Bad input gets an OpenAI-style 4xx naming the problem; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import running

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

# (route, body, status, words the message must contain, param)
BAD = [
    (COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -1}, 400, "max_completion_tokens",
     "max_completion_tokens"),
    (COMP, {"prompt": "x", "temperature": -0.5}, 400, "temperature", "temperature"),
    (CHAT, {"messages": MSG, "temperature": -1.0}, 400, "temperature", "temperature"),
    (COMP, {"prompt": "x", "n": 0}, 400, "n", "n"),
    (CHAT, {"messages": MSG, "n": -2}, 400, "n", "n"),
    (COMP, {"prompt": "x", "max_tokens": 600}, 400, "maximum context length", "max_tokens"),
    (COMP, {"prompt": "hello " * 300, "max_tokens": 300}, 400, "maximum context length",
     "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi " * 600}]}, 400, "no room", "messages"),
    (COMP, {"prompt": "x", "model": "gpt-4"}, 404, "does not exist", "model"),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "does not exist", "model"),
    (COMP, {"prompt": ""}, 400, "empty", "prompt"),
    (COMP, {"prompt": []}, 400, "empty", "prompt"),
    (COMP, {"prompt": [[]]}, 400, "empty", "prompt"),
    (COMP, {"prompt": [1, 2, 99999]}, 400, "vocabulary", "prompt"),
    (COMP, {"max_tokens": 4}, 400, "prompt", "prompt"),
    (CHAT, {"model": "tiny"}, 400, "messages", "messages"),
    (CHAT, {"messages": []}, 400, "messages", "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages", "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "role", "messages.0.role"),
    (COMP, {"prompt": "x", "max_tokens": "16"}, 400, "max_tokens", "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", "max_tokens"),
    (COMP, {"prompt": "x", "temperature": "hot"}, 400, "temperature", "temperature"),
    (COMP, {"prompt": "x", "stream": "yes"}, 400, "stream", "stream"),
    (COMP, {"prompt": 42}, 400, "prompt", "prompt"),
    (COMP, {"prompt": "x", "stop": 7}, 400, "stop", "stop"),
    (COMP, {"prompt": "x", "logit_bias": {"abc": 1.0}}, 400, "logit_bias", "logit_bias"),
    (COMP, {"prompt": "x", "logit_bias": {"99999": 1.0}}, 400, "logit_bias", "logit_bias"),
    (COMP, {"prompt": "x", "top_p": 0.0}, 400, "top_p", "top_p"),
    (COMP, {"prompt": "x", "logprobs": 100}, 400, "max_logprobs", "logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "logprobs", "top_logprobs"),
    (COMP, {"prompt": "x", "guided_regex": "[a-"}, 400, "regular expression", None),
    (COMP, {"prompt": "x", "guided_json": "{not json"}, 400, "JSON", "guided_json"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "x",
                                                                 "schema": {"type": "nonsense"}}}},
     400, "schema", None),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format",
     "response_format.type"),
    (COMP, {"prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]}, 400, "one",
     "guided_choice"),
    (COMP, {"prompt": "x", "suffix": "end"}, 400, "suffix", "suffix"),
    (COMP, {"prompt": "x", "use_beam_search": True}, 400, "beam", "use_beam_search"),
    # tools default to tool_choice "auto", which needs a tool-call parser (not enabled here)
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tool-call parser", "tool_choice"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {}}]}, 400,
     "name", "tools[0].function.name"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "text content", "messages"),
    (COMP, {"prompt": "x", "stop_token_ids": [123456]}, 400, "vocabulary", "stop_token_ids"),
    (COMP, {"prompt": "x", "best_of": 1, "n": 2}, 400, "best_of", "best_of"),
    (CHAT, {"messages": MSG, "chat_template": "{% for %}"}, 400, "template", "chat_template"),
]


@pytest.mark.parametrize(("route", "body", "status", "words", "param"), BAD,
                         ids=[f"{i}-{b[0].split('/')[-1]}" for i, b in enumerate(BAD)])
def test_bad_input_is_an_openai_error(served, route, body, status, words, param):
    url, _ = served
    response = httpx.post(url + route, json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words.lower() in error["message"].lower(), error
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    assert error["code"] in (status, "model_not_found")


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b"null", b'{"prompt": NaN}',
                                 b"\xff\xfe"])
def test_malformed_bodies(served, raw):
    url, _ = served
    for route in (COMP, CHAT, "/tokenize", "/detokenize"):
        response = httpx.post(url + route, content=raw,
                              headers={"content-type": "application/json"}, timeout=30)
        assert response.status_code == 400, (route, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_and_method_are_openai_errors(served):
    url, _ = served
    missing = httpx.get(f"{url}/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = httpx.get(f"{url}{COMP}")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_the_server_still_serves_after_bad_input(served):
    url, app = served
    for _, body, *_ in BAD[:10]:
        httpx.post(url + COMP, json=body, timeout=30)
    ok = httpx.post(url + COMP, json={"prompt": "still", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1
    engine = app.state.engine
    assert engine.num_open_requests == 0
    assert engine.engine.kv_cache.usage == 0.0  # nothing rejected holds blocks


def test_api_key(tiny_llama):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    app = build_app(engine, served_model_names=["tiny"], api_key="s3cret")
    routes = [("GET", "/v1/models", None), ("POST", COMP, {"prompt": "x", "max_tokens": 2}),
              ("POST", CHAT, {"messages": MSG, "max_tokens": 2}), ("POST", COMP, None)]
    with running(app) as url:
        for method, route, body in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = httpx.request(method, url + route, json=body, headers=headers, timeout=30)
                assert r.status_code == 401, (route, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
            good = httpx.request(method, url + route, json=body,
                                 headers={"Authorization": "Bearer s3cret"}, timeout=30)
            assert good.status_code == (400 if body is None and method == "POST" else 200)
        assert httpx.get(f"{url}/health").status_code == 200  # open
        assert httpx.get(f"{url}/version").status_code == 200
        # The tokenizer endpoints, the metrics and the API docs need the key too (issue 22).
        key = {"Authorization": "Bearer s3cret"}
        for method, route, body in [("POST", "/tokenize", {"prompt": "hi"}),
                                    ("POST", "/detokenize", {"tokens": [1, 2]}),
                                    ("GET", "/metrics", None), ("GET", "/docs", None),
                                    ("GET", "/openapi.json", None), ("GET", "/redoc", None)]:
            r = httpx.request(method, url + route, json=body, timeout=30)
            assert r.status_code == 401, route
            r = httpx.request(method, url + route, json=body, headers=key, timeout=30)
            assert r.status_code == 200, (route, r.text)
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert client.models.list().data[0].id == "tiny"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_metrics_and_docs_can_be_opened_while_the_rest_keeps_the_key(tiny_llama):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    app = build_app(engine, served_model_names=["tiny"], api_key="s3cret", open_metrics=True,
                    open_docs=True)
    with running(app) as url:
        for route in ("/metrics", "/docs", "/openapi.json"):
            assert httpx.get(url + route, timeout=30).status_code == 200, route
        assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, timeout=30).status_code == 401
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401

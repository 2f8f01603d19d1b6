"""What one small request must not do to ``llmlab serve`` (issue 22): each finding of the
edge probe, refused at the edge with a 400 naming the field, while the server goes on."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from llmlab import LLM, SamplingParams
from tests.server.conftest import running

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def post(url: str, body: dict, timeout: float = 30) -> httpx.Response:
    """POST ``body`` as ASCII JSON: a lone surrogate travels as ``\\udXXX``, as a client in
    another language would send it (httpx refuses to encode one itself)."""
    return httpx.post(url, content=json.dumps(body), timeout=timeout,
                      headers={"Content-Type": "application/json"})


def _ok(url: str) -> None:
    r = httpx.post(url + COMP, json={"model": "tiny", "prompt": "still here", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200, r.text


def test_a_request_chat_template_is_refused_by_default(served):
    url, _ = served
    bomb = {"messages": MSG, "chat_template": "{{ 'x' * 4*10**7 }}"}
    for route, body in (("/tokenize", bomb), (CHAT, {**bomb, "max_tokens": 2})):
        r = httpx.post(url + route, json=body, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "chat_template" and "trust-request-chat-template" in error[
            "message"]
    _ok(url)


def test_a_trusted_template_is_bounded_in_size_and_time(tiny_llama):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    app = build_app(engine, served_model_names=["tiny"], trust_request_chat_template=True)
    app.state.serving.template_timeout_s = 0.5
    huge = {"messages": MSG, "chat_template": "{% for i in range(100000) %}xxxxx{% endfor %}"}
    # Seconds of Jinja loops, not hours: the thread it holds finishes soon after the test.
    slow = {"messages": MSG, "chat_template":
            "{% set ns = namespace(n=0) %}{% for i in range(500) %}{% for j in range(1000) %}"
            "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}hi"}
    with running(app) as url:
        r = httpx.post(f"{url}/tokenize", json=huge, timeout=30)
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
        start = time.monotonic()
        r = httpx.post(f"{url}/tokenize", json=slow, timeout=30)
        assert r.status_code == 400 and "took longer than 0.5 s" in r.text, r.text
        assert time.monotonic() - start < 5
        _ok(url)  # completions, and the engine, are not held by the template threads
        r = httpx.post(url + CHAT, json={**slow, "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_a_huge_prompt_is_refused_before_it_is_tokenized(served):
    url, _ = served
    prompt = "word " * 2_000_000  # 10 MB
    for route, body in ((COMP, {"prompt": prompt, "max_tokens": 2}),
                        ("/tokenize", {"prompt": prompt})):
        start = time.monotonic()
        r = httpx.post(url + route, json=body, timeout=60)
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
        assert time.monotonic() - start < 5  # tokenizing it took a minute
    _ok(url)


@pytest.mark.parametrize("route, body", [
    (COMP, {"prompt": "hi", "max_tokens": 2}),
    (CHAT, {"messages": MSG, "max_tokens": 2}),
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [1]}),
])
def test_a_lone_surrogate_in_model_is_a_400(served, route, body):
    url, _ = served
    r = post(url + route, {**body, "model": "\ud800"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("field, body", [
    ("bad_words", {"prompt": "hi", "bad_words": ["\ud800"]}),
    ("stop", {"prompt": "hi", "stop": ["ok", "\ud800"]}),
    ("prompt", {"prompt": "a\ud800b"}),
    ("messages", {"messages": [{"role": "user", "content": "\udfff"}]}),
])
def test_text_that_is_not_unicode_is_refused_at_the_edge(served, field, body):
    url, app = served
    route = CHAT if "messages" in body else COMP
    r = post(url + route, {**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    assert app.state.engine.num_open_requests == 0  # nothing was queued
    _ok(url)


def test_bad_words_are_tokenized_when_the_request_is_prepared(tiny_llama):
    engine = LLM(tiny_llama, dtype="float32").llm_engine

    class Refuses:
        """A tokenizer that cannot take one word (as a real one may)."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def encode(self, text, **kwargs):
            if "forbidden" in text:
                raise RuntimeError("cannot tokenize this")
            return self.inner.encode(text, **kwargs)

    engine.inputs.tokenizer = Refuses(engine.tokenizer)
    with pytest.raises(ValueError, match="bad_words could not be tokenized"):
        engine.add_request("a", "hello", SamplingParams(bad_words=["forbidden"]))
    assert not engine.has_unfinished_requests()


def test_a_finished_sample_reports_its_finish_reason_once_in_a_stream(tiny_llama):
    from llmlab.sampling.params import RequestOutputKind

    engine = LLM(tiny_llama, dtype="float32").llm_engine
    # Random samples that stop on any of many ids end at different steps.
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, min_tokens=1,
                            stop_token_ids=list(range(40, 200)),
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("r", "hello", params)
    reasons: dict[int, list[str]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                if c.finish_reason is not None:
                    reasons.setdefault(c.index, []).append(c.finish_reason)
    assert sorted(reasons) == [0, 1, 2]
    assert all(len(r) == 1 for r in reasons.values()), reasons


def test_logit_bias_keys_are_plain_integers(served):
    url, _ = served
    for key in ("5_0", " 5", "\uff15"):
        r = post(url + COMP, {"prompt": "hi", "max_tokens": 2, "logit_bias": {key: 1.0}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", (key, r.text)
    with pytest.raises((TypeError, ValueError), match="logit_bias"):
        SamplingParams(logit_bias={"5_0": 1.0})


def test_small_leaks_are_closed(served, tiny_llama):
    url, _ = served
    r = httpx.get(url + COMP, timeout=30)  # a POST route
    assert r.status_code == 405 and "POST" in r.headers.get("allow", ""), r.headers
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    assert all(tiny_llama not in str(card) for card in models)  # no filesystem path

    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    app = build_app(engine, served_model_names=["tiny"], allowed_origins=["*"])
    with running(app) as cors_url:
        r = httpx.get(cors_url + "/version", headers={"Origin": "https://evil.example"})
        assert r.headers.get("access-control-allow-credentials") != "true"


def test_a_grammar_that_compiles_too_long_is_refused_in_time(tiny_llama):
    pytest.importorskip("xgrammar")
    from llmlab import StructuredOutputsParams

    engine = LLM(tiny_llama, dtype="float32").llm_engine
    grammars = engine.inputs.grammars
    # No up-front limits: the deadline alone must hold (a 300,000-option choice compiles
    # for many seconds).
    grammars.max_choices = grammars.max_constraint_chars = None
    grammars.compile(StructuredOutputsParams(regex="(ab)+"))  # the compile process is up
    grammars.compile_timeout_s = 0.3
    slow = StructuredOutputsParams(choice=[f"option number {i}" for i in range(300_000)])
    start = time.monotonic()
    with pytest.raises(ValueError, match="took longer than 0.3 s to compile"):
        engine.add_request("a", "hi", SamplingParams(structured_outputs=slow))
    assert time.monotonic() - start < 1.2 and not engine.has_unfinished_requests()
    deadline = time.monotonic() + 10
    while grammars.compile_pool.running_pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not grammars.compile_pool.running_pids()  # abandoned, and its process killed
    engine.shutdown()


def test_limits_refuse_oversized_requests_and_a_full_server_answers_429(tiny_llama):
    import asyncio

    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    app = build_app(engine, served_model_names=["tiny"], max_request_body_bytes=100_000,
                    max_prompts_per_request=8, max_sequences_per_request=16,
                    max_queued_sequences=6)
    with running(app) as url:
        big = {"prompt": "x" * 200_000, "max_tokens": 1}
        r = httpx.post(url + COMP, json=big, timeout=30)
        assert r.status_code == 413, r.text

        def chunks():  # no Content-Length: the limit applies as the body streams in
            yield b'{"prompt": "'
            for _ in range(30):
                yield b"x" * 10_000
            yield b'", "max_tokens": 1}'

        r = httpx.post(url + COMP, content=chunks(), timeout=30,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text
        r = httpx.post(url + COMP, json={"prompt": ["a"] * 9, "max_tokens": 1}, timeout=30)
        assert r.status_code == 400 and "9 prompts" in r.text
        r = httpx.post(url + COMP, json={"prompt": ["a"] * 4, "n": 5, "max_tokens": 1},
                       timeout=30)
        assert r.status_code == 400 and "20 sequences" in r.text

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                held = [asyncio.create_task(client.post(COMP, json={
                    "prompt": f"keep busy {i}", "max_tokens": 60, "ignore_eos": True}))
                    for i in range(6)]
                while engine.num_open_requests < 6:
                    await asyncio.sleep(0.01)
                start = time.monotonic()
                refused = await client.post(COMP, json={"prompt": "one more", "max_tokens": 2})
                took = time.monotonic() - start
                return refused, took, await asyncio.gather(*held)

        refused, took, held = asyncio.run(main())
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        assert took < 0.5  # at once (the issue asks 100 ms; the VM is shared)
        assert all(r.status_code == 200 for r in held)  # nothing accepted is lost
        assert all(r.json()["usage"]["completion_tokens"] == 60 for r in held)
        _ok(url)  # room again


def test_health_is_truthful_about_a_wedged_or_saturated_server(tiny_llama):
    import threading

    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    app = build_app(engine, served_model_names=["tiny"], max_queued_sequences=2)
    release = threading.Event()
    inner = engine.engine.executor

    class Hangs:  # a step that does not end until told (a wedged kernel, say)
        def __getattr__(self, name):
            return getattr(inner, name)

        def execute(self, batch):
            release.wait(30)
            return inner.execute(batch)

    with running(app) as url:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        engine.wedged_after_s = 0.3
        engine.engine.executor = Hangs()
        client = threading.Thread(target=lambda: httpx.post(
            url + COMP, json={"prompt": "hi", "max_tokens": 2}, timeout=60))
        client.start()
        time.sleep(1.0)
        r = httpx.get(f"{url}/health", timeout=10)
        assert r.status_code == 503 and "wedged" in r.text, r.text
        release.set()
        client.join(30)
        engine.engine.executor = inner
        engine.wedged_after_s = 60.0
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200

        # Saturated: as many in flight as it takes; /health says so (new ones get a 429).
        blockers = [threading.Thread(target=lambda: httpx.post(url + COMP, json={
            "prompt": "busy", "max_tokens": 200, "ignore_eos": True}, timeout=60))
            for _ in range(2)]
        release.clear()
        engine.engine.executor = Hangs()
        for thread in blockers:
            thread.start()
        deadline = time.monotonic() + 10
        while engine.num_open_requests < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.get(f"{url}/health", timeout=10)
        assert r.status_code == 503 and "capacity" in r.text, r.text
        engine.engine.executor = inner
        release.set()
        for thread in blockers:
            thread.join(60)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_template_and_schema_bombs_do_not_hold_up_a_normal_request(tiny_llama):
    """Six template bombs and six slow grammar compiles in flight, as the server runs by
    default: a normal request still completes within 2 s of its idle latency, and /health
    stays 200. Templates are refused at once; compiles wait on threads of their own
    (neither asyncio's default pool nor the engine waits for them) and time out."""
    import threading

    pytest.importorskip("xgrammar")
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    app = build_app(engine, served_model_names=["tiny"])
    grammars = engine.engine.inputs.grammars
    grammars.compile_timeout_s = 1.0
    grammars.max_choices = grammars.max_constraint_chars = None  # the deadline must hold
    template_bomb = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                     "{% endfor %}")
    normal = {"model": "tiny", "prompt": "a normal request", "max_tokens": 8}
    with running(app) as url:
        httpx.post(url + COMP, json=normal, timeout=30)  # warm
        start = time.monotonic()
        httpx.post(url + COMP, json=normal, timeout=30)
        idle = time.monotonic() - start
        codes = []

        def bomb(body, route):
            codes.append(httpx.post(url + route, json=body, timeout=60).status_code)

        bombs = [threading.Thread(target=bomb, args=(
            {"messages": MSG, "chat_template": template_bomb, "max_tokens": 2}, CHAT))
            for _ in range(6)]
        bombs += [threading.Thread(target=bomb, args=(
            {"prompt": "x", "max_tokens": 2,
             "structured_outputs": {"choice": [f"o{i}" for i in range(300_000)]}},
            COMP)) for _ in range(6)]
        for thread in bombs:
            thread.start()
        time.sleep(0.3)  # all in flight
        start = time.monotonic()
        r = httpx.post(url + COMP, json=normal, timeout=30)
        loaded = time.monotonic() - start
        health = httpx.get(f"{url}/health", timeout=10).status_code
        for thread in bombs:
            thread.join(60)
    assert r.status_code == 200 and health == 200
    assert loaded < idle + 2.0, (idle, loaded)
    assert codes.count(400) == 12, codes  # every bomb refused, none a 5xx


@pytest.mark.slow
def test_a_trusted_request_template_cannot_starve_the_server(tiny_llama):
    """With --trust-request-chat-template, a request's template renders in a worker
    process: a loop that holds the GIL there slows nothing here, and one that runs past
    the timeout is ended (its worker terminated), not left running."""
    import threading

    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    app = build_app(engine, served_model_names=["tiny"], trust_request_chat_template=True)
    serving = app.state.serving
    serving.template_timeout_s = 2.0
    forever = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
               "{% endfor %}")
    normal = {"model": "tiny", "prompt": "a normal request", "max_tokens": 8}
    with running(app) as url:
        # A quick trusted template works (and starts the workers).
        r = httpx.post(f"{url}/tokenize", timeout=120, json={
            "messages": MSG, "chat_template": "{{ messages[0]['content'] }}!"})
        assert r.status_code == 200 and r.json()["count"] >= 1, r.text
        httpx.post(url + COMP, json=normal, timeout=30)
        start = time.monotonic()
        httpx.post(url + COMP, json=normal, timeout=30)
        idle = time.monotonic() - start
        codes = []
        bombs = [threading.Thread(target=lambda: codes.append(httpx.post(
            url + CHAT, json={"messages": MSG, "chat_template": forever, "max_tokens": 2},
            timeout=120).status_code)) for _ in range(2)]
        for thread in bombs:
            thread.start()
        time.sleep(0.5)
        start = time.monotonic()
        r = httpx.post(url + COMP, json=normal, timeout=30)
        loaded = time.monotonic() - start
        for thread in bombs:
            thread.join(120)
        pool = serving._processes
    assert r.status_code == 200 and loaded < idle + 2.0, (idle, loaded)
    assert codes == [400, 400]
    assert pool is not None and pool._pool is None  # the runaway workers were terminated


@pytest.mark.slow
def test_a_trusted_template_prints_no_memory_address(tiny_llama):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    app = build_app(engine, served_model_names=["tiny"], trust_request_chat_template=True)
    with running(app) as url:
        r = httpx.post(f"{url}/tokenize", timeout=120, json={
            "messages": MSG, "chat_template": "{{ raise_exception }}|{{ messages }}",
            "return_token_strs": True})
    assert r.status_code == 200, r.text
    text = "".join(r.json()["token_strs"])
    assert "0x" in text and not any(c in "123456789abcdef" for c in text.split("0x", 1)[1][:2])


def test_serve_keeps_idle_connections_longer_than_clients_do():
    """The probe saw requests fail on keep-alive connections reused just as uvicorn's 5 s
    idle timeout closed them (httpx keeps idle connections 5 s too); llmlab serve keeps
    them 65 s."""
    from llmlab.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.timeout_keep_alive == 65.0

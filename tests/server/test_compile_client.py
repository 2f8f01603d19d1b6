"""Grammar compiles queue per client, and the server names the client by its peer
address, not the ``user`` field a client chooses (issue 39, item 3)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import running

pytest.importorskip("xgrammar")


def clients_seen(grammars) -> list:
    """The ``client`` of every compile ``grammars`` is asked for, in order."""
    seen: list = []
    real = grammars.compile

    def spy(spec, client=None):
        seen.append(client)
        return real(spec, client=client)

    grammars.compile = spy
    return seen


def test_the_server_keys_grammar_compiles_by_the_peer_address(tiny_llama):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    app = build_app(engine, served_model_names=["tiny"])
    grammars = engine.engine.grammars
    seen = clients_seen(grammars)
    body = {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": "(ab)+"}}
    with running(app) as url:
        for local, user in (("127.0.0.2", "alice"), ("127.0.0.3", None)):
            transport = httpx.HTTPTransport(local_address=local)
            with httpx.Client(transport=transport, timeout=60) as client:
                r = client.post(url + "/v1/completions", json={**body, "user": user})
                assert r.status_code == 200, r.text
    assert seen == ["127.0.0.2", "127.0.0.3"]  # not "alice": a client cannot pick its key


def test_without_a_client_the_engine_keys_compiles_by_user(tiny_llama):
    from llmlab import LLM, SamplingParams, StructuredOutputsParams

    engine = LLM(tiny_llama, dtype="float32").llm_engine
    grammars = engine.grammars
    seen = clients_seen(grammars)
    params = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    engine.prepare_request("a", "hi", params, user="bob")
    engine.prepare_request("b", "hi", params, user="bob", client=("10.0.0.1", 5))
    assert seen == ["bob", ("10.0.0.1", 5)]

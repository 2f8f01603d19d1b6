"""The pooling endpoints on real servers: /v1/embeddings (the official openai client, float
and base64), /pooling, /score, /rerank; each refused clearly on the wrong runner."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from llmlab import LLM, PoolingParams
from llmlab.testing import build_tiny_model
from tests.server.conftest import running

openai = pytest.importorskip("openai")

TEXTS = ["Once upon a time there was a little cat", "The dog ran fast.", "Tom and Lily"]


def _serve(path, name="tiny", **settings):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(path, dtype="float32", seed=0, runner="pooling",
                                       **settings)
    return build_app(engine, served_model_names=[name], model_path=path)


@pytest.fixture(scope="module")
def embedder(tiny_llama):
    """``(url, reference LLM)``: a pooling server on tiny_llama and an LLM on the same."""
    with running(_serve(tiny_llama)) as url:
        yield url, LLM(tiny_llama, dtype="float32", runner="pooling")


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A cross-encoder (a one-label Qwen3 classifier) served, and its reference LLM."""
    path = str(build_tiny_model(tmp_path_factory.mktemp("ce"), "Qwen3ForSequenceClassification",
                                seed=2, num_labels=1))
    with running(_serve(path, name="ce")) as url:
        yield url, LLM(path, dtype="float32", runner="pooling")


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_client_embeddings_float_and_base64_equal_llm_embed(embedder):
    url, llm = embedder
    want = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    client = _client(url)
    for encoding_format in ("float", "base64"):
        response = client.embeddings.create(model="tiny", input=TEXTS,
                                            encoding_format=encoding_format)
        assert [d.index for d in response.data] == [0, 1, 2]
        tokens = sum(len(o.prompt_token_ids) for o in llm.embed(TEXTS, use_tqdm=False))
        assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
        for data, expected in zip(response.data, want, strict=True):
            got = data.embedding
            if encoding_format == "base64":  # asked for explicitly: the client leaves it
                got = np.frombuffer(base64.b64decode(got), dtype="<f4")
            np.testing.assert_allclose(np.asarray(got), expected, atol=1e-6)
    # The client's default asks for base64 and decodes it itself.
    default = client.embeddings.create(model="tiny", input=TEXTS[0])
    np.testing.assert_allclose(np.asarray(default.data[0].embedding), want[0], atol=1e-6)


def test_base64_is_little_endian_float32_as_openai_encodes_it(embedder):
    url, llm = embedder
    body = httpx.post(f"{url}/v1/embeddings", json={
        "input": TEXTS[1], "encoding_format": "base64",
    }).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    decoded = np.frombuffer(raw, dtype="<f4")
    want = llm.embed(TEXTS[1], use_tqdm=False)[0].outputs.embedding
    assert decoded.shape == (64,)
    np.testing.assert_allclose(decoded, want, atol=1e-7)


def test_dimensions_and_token_id_inputs(embedder):
    url, llm = embedder
    client = _client(url)
    cut = client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=8,
                                   encoding_format="float")
    want = llm.embed(TEXTS[0], PoolingParams(dimensions=8), use_tqdm=False)[0]
    np.testing.assert_allclose(cut.data[0].embedding, want.outputs.embedding, atol=1e-6)
    assert len(cut.data[0].embedding) == 8
    ids = want.prompt_token_ids
    for payload in (ids, [ids, ids]):
        got = client.embeddings.create(model="tiny", input=payload, encoding_format="float")
        full = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding
        for data in got.data:
            np.testing.assert_allclose(data.embedding, full, atol=1e-6)


def test_pooling_endpoint_returns_the_task_output(embedder):
    url, llm = embedder
    body = httpx.post(f"{url}/pooling", json={"model": "tiny", "input": TEXTS[:2]}).json()
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["pooling"] * 2
    want = [o.outputs.data.tolist() for o in llm.encode(TEXTS[:2], use_tqdm=False)]
    for data, expected in zip(body["data"], want, strict=True):
        np.testing.assert_allclose(data["data"], expected, atol=1e-6)


def test_score_and_rerank_of_an_embedding_model_are_cosine_similarities(embedder):
    url, llm = embedder
    want = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS, use_tqdm=False)]
    body = httpx.post(f"{url}/score", json={"text_1": TEXTS[0], "text_2": TEXTS}).json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-6)
    assert abs(want[0] - 1) < 1e-5  # a text against itself
    ranked = httpx.post(f"{url}/rerank", json={
        "query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1,
    }).json()
    best = int(np.argmax(want[1:]))
    assert [r["index"] for r in ranked["results"]] == [best]
    assert ranked["results"][0]["document"]["text"] == TEXTS[1 + best]
    assert abs(ranked["results"][0]["relevance_score"] - want[1 + best]) < 1e-6


def test_cross_encoder_score_and_rerank_equal_llm_score(reranker):
    url, llm = reranker
    query = "Where does the cat play?"
    want = [o.outputs.score for o in llm.score(query, TEXTS, use_tqdm=False)]
    body = httpx.post(f"{url}/v1/score", json={"model": "ce", "text_1": query,
                                               "text_2": TEXTS}).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-6)
    ranked = httpx.post(f"{url}/rerank", json={"query": query, "documents": TEXTS}).json()
    assert [r["index"] for r in ranked["results"]] == list(np.argsort(want)[::-1])
    assert ranked["usage"]["total_tokens"] == sum(
        len(o.prompt_token_ids) for o in llm.score(query, TEXTS, use_tqdm=False)
    )
    # A cross-encoder does not embed.
    refused = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"})
    assert refused.status_code == 400
    assert "task='embed' is not supported" in refused.json()["error"]["message"]


def test_pooling_endpoints_on_a_generating_server_are_a_clear_400(served):
    url, _ = served
    for path, payload in [
        ("/v1/embeddings", {"input": "hi"}),
        ("/pooling", {"input": "hi"}),
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
    ]:
        response = httpx.post(f"{url}{path}", json=payload)
        assert response.status_code == 400, path
        assert "does not support" in response.json()["error"]["message"]
        assert "--runner pooling" in response.json()["error"]["message"]


def test_generation_endpoints_on_a_pooling_server_are_a_clear_400(embedder):
    url, _ = embedder
    for path, payload in [
        ("/v1/completions", {"model": "tiny", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": "tiny",
                                  "messages": [{"role": "user", "content": "hi"}]}),
    ]:
        response = httpx.post(f"{url}{path}", json=payload)
        assert response.status_code == 400
        assert "pooling model (runner='pooling')" in response.json()["error"]["message"]


@pytest.mark.parametrize("payload, status, param", [
    ({"input": "hi", "dimensions": 65}, 400, "dimensions"),
    ({"input": "hi", "dimensions": 0}, 400, "dimensions"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": [10**9]}, 400, None),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "hi", "model": "other"}, 404, "model"),
])
def test_bad_embedding_requests_name_the_field(embedder, payload, status, param):
    url, llm = embedder
    response = httpx.post(f"{url}/v1/embeddings", json=payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param or param in error["message"], error
    engine = llm.llm_engine
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_pooling_paths_are_behind_the_api_key(tiny_llama):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32", runner="pooling")
    app = build_app(engine, served_model_names=["tiny"], api_key="secret")
    with running(app) as url:
        for path in ("/v1/embeddings", "/pooling", "/score", "/rerank"):
            assert httpx.post(f"{url}{path}", json={}).status_code == 401, path
        ok = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"},
                        headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200
        assert torch.tensor(ok.json()["data"][0]["embedding"]).shape == (64,)

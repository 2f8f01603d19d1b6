"""vLLM's ``POST /classify`` on a pooling server: ``LLM.classify``'s probabilities with the
checkpoint's ``id2label`` names, vLLM's response shape, the server's admission and its
pooling errors (a generating server refuses it as it refuses the other pooling routes)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from llmlab import LLM, PoolingParams
from llmlab.testing import build_tiny_model
from tests.server.conftest import running

TEXTS = ["Once upon a time there was a little cat", "The dog ran fast.", "Tom and Lily"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """``(url, app, reference LLM)``: a three-label classifier served as ``"clf"``, at most
    four sequences in flight."""
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    path = str(build_tiny_model(tmp_path_factory.mktemp("clf"),
                                "LlamaForSequenceClassification", seed=3, id2label=LABELS))
    engine = AsyncEngine.from_settings(path, dtype="float32", seed=0, runner="pooling")
    app = build_app(engine, served_model_names=["clf"], model_path=path,
                    max_queued_sequences=4)
    with running(app) as url:
        yield url, app, LLM(path, dtype="float32", runner="pooling")


def test_classify_returns_llm_classify_probs_with_id2label_labels(classifier):
    url, _, llm = classifier
    want = [o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]
    response = httpx.post(f"{url}/classify", json={"model": "clf", "input": TEXTS}, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["id"].startswith("classify-") and body["object"] == "list"
    assert body["model"] == "clf" and isinstance(body["created"], int)
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for data, expected in zip(body["data"], want, strict=True):
        assert set(data) == {"index", "label", "probs", "num_classes"}
        np.testing.assert_allclose(data["probs"], expected, atol=1e-6)
        assert data["num_classes"] == 3
        assert data["label"] == LABELS[int(np.argmax(expected))]
    tokens = sum(len(o.prompt_token_ids) for o in llm.classify(TEXTS, use_tqdm=False))
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == tokens
    assert body["usage"]["completion_tokens"] == 0


def test_one_string_v1_path_logits_and_truncation(classifier):
    url, _, llm = classifier
    one = httpx.post(f"{url}/v1/classify", json={"input": TEXTS[1]}, timeout=60).json()
    assert len(one["data"]) == 1 and abs(sum(one["data"][0]["probs"]) - 1) < 1e-5
    logits = httpx.post(f"{url}/classify", json={"input": TEXTS[1], "use_activation": False},
                        timeout=60).json()["data"][0]["probs"]
    want = llm.classify(TEXTS[1], PoolingParams(use_activation=False), use_tqdm=False)[0]
    np.testing.assert_allclose(logits, want.outputs.probs, atol=1e-5)
    cut = httpx.post(f"{url}/classify", json={"input": TEXTS[0], "truncate_prompt_tokens": 3},
                     timeout=60).json()
    assert cut["usage"]["prompt_tokens"] == 3
    want = llm.classify(TEXTS[0], truncate_prompt_tokens=3, use_tqdm=False)[0]
    np.testing.assert_allclose(cut["data"][0]["probs"], want.outputs.probs, atol=1e-6)


@pytest.mark.parametrize("payload, status, param", [
    ({"input": []}, 400, "input"),
    ({"input": "hi", "model": "other"}, 404, "model"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({}, 400, "input"),
])
def test_bad_classify_requests_name_the_field(classifier, payload, status, param):
    url, app, _ = classifier
    response = httpx.post(f"{url}/classify", json=payload, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param or param in error["message"], error
    engine = app.state.engine.engine
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_classify_goes_through_admission(classifier):
    from llmlab.entrypoints.server.admission import Weight

    url, app, _ = classifier
    admission = app.state.serving.admission
    held = admission.admit(Weight(1, 4, 0))  # the server's four sequences, all taken
    try:
        refused = httpx.post(f"{url}/classify", json={"input": TEXTS[0]}, timeout=60)
    finally:
        held.release()
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
    ok = httpx.post(f"{url}/classify", json={"input": TEXTS[:2]}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert admission.held == Weight()  # given back as each prompt finished


def test_classify_on_a_generating_server_is_the_pooling_routes_400(served):
    url, _ = served
    for path in ("/classify", "/v1/classify"):
        response = httpx.post(f"{url}{path}", json={"input": "hi"}, timeout=60)
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "does not support the Classification API" in message
        assert "--runner pooling" in message


def test_classify_on_an_embedding_model_names_the_task(tiny_llama):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32", runner="pooling")
    app = build_app(engine, served_model_names=["tiny"], api_key="secret")
    with running(app) as url:
        assert httpx.post(f"{url}/classify", json={"input": "hi"}).status_code == 401
        refused = httpx.post(f"{url}/classify", json={"input": "hi"},
                             headers={"Authorization": "Bearer secret"}, timeout=60)
    assert refused.status_code == 400
    assert "task='classify' is not supported" in refused.json()["error"]["message"]

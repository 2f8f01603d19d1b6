"""Schemathesis fuzzes every route of ``/openapi.json`` on a real server: no 5xx, and every
response (errors included) matches the schema it documents. Bounded in examples per route;
the model's length limit (64) bounds each generation."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings
from schemathesis import checks

from tests.server.conftest import running

# About a minute of fuzzing on 2 cores; CI runs it (`-m slow`). The whole module, so the health
# check after fuzzing runs after it, in the same process.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzz_url(tiny_llama):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32", max_model_len=64,
                                       max_num_seqs=8)
    app = build_app(engine, served_model_names=["tiny"])
    with running(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def api_schema(fuzz_url):
    url, _ = fuzz_url
    loaded = schemathesis.openapi.from_url(f"{url}/openapi.json")
    # valid requests and deliberately invalid ones (wrong types, missing fields, ...)
    loaded.config.generation.update(modes=list(schemathesis.GenerationMode))
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")

CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]


@schema.parametrize()
@settings(max_examples=40, deadline=None,
          suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_route_answers_5xx_or_breaks_its_schema(case, fuzz_url):
    url, _ = fuzz_url
    case.call_and_validate(base_url=url, checks=CHECKS, timeout=60)


def test_the_server_is_healthy_after_fuzzing(fuzz_url):
    import httpx

    url, _ = fuzz_url
    assert httpx.get(f"{url}/health").status_code == 200
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200

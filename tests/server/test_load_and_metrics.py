"""Disconnects free their blocks, metrics count what happened, 100 concurrent streams agree
with sequential answers. All traffic goes to 127.0.0.1, each test bounded in time and count."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import metric, running

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def fresh(tiny_llama):
    """A server of its own, so its counters start at zero."""
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32", max_num_seqs=128)
    app = build_app(engine, served_model_names=["tiny"])
    with running(app) as url:
        yield url, app


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


def finished(text: str, reason: str) -> float:
    try:
        return metric(text, "llmlab:request_success_total", finished_reason=reason)
    except KeyError:
        return 0.0


def wait_for_idle(url: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(url)
        if (metric(text, "llmlab:kv_cache_usage_perc") == 0.0
                and metric(text, "llmlab:num_requests_running") == 0.0
                and metric(text, "llmlab:num_requests_waiting") == 0.0):
            return text
        assert time.monotonic() < deadline, f"still busy:\n{text}"
        time.sleep(0.05)


def test_metrics_count_requests_tokens_and_latencies(fresh):
    url, _ = fresh
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    before = scrape(url)
    usages = []
    for prompt, n in (("one", 5), ("two two", 7), ("one", 3)):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True})
        usages.append(r.usage)
    text = wait_for_idle(url)

    def grew(name, **labels):
        try:
            old = metric(before, name, **labels)
        except KeyError:
            old = 0.0
        return metric(text, name, **labels) - old

    assert grew("llmlab:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew("llmlab:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert grew("llmlab:request_success_total", finished_reason="length") == 3
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert grew(f"llmlab:{name}_count") == 3, name
    # one gap between consecutive tokens of each request: (5-1) + (7-1) + (3-1)
    assert grew("llmlab:inter_token_latency_seconds_count") == 12
    assert grew("llmlab:prefix_cache_queries_total") >= sum(u.prompt_tokens for u in usages)
    assert grew("llmlab:prefix_cache_hits_total") >= 0
    assert metric(text, "llmlab:num_preemptions_total") == 0
    assert 'model_name="tiny"' in text


def test_a_client_that_disconnects_mid_stream_has_its_request_aborted(fresh):
    url, app = fresh
    body = {"model": "tiny", "prompt": "Go on and on", "max_tokens": 400, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        busy = scrape(url)
        assert metric(busy, "llmlab:kv_cache_usage_perc") > 0.0
        assert metric(busy, "llmlab:num_requests_running") == 1.0
    # the connection is closed here, after one chunk of 400
    text = wait_for_idle(url)
    assert finished(text, "abort") >= 1
    assert finished(text, "length") == finished(busy, "length")
    assert app.state.engine.num_open_requests == 0


def test_a_non_streaming_client_that_gives_up_has_its_request_aborted(fresh):
    url, app = fresh
    def aborted():
        return finished(scrape(url), "abort")

    before = aborted()
    body = {"model": "tiny", "prompt": "Slow", "max_tokens": 500, "ignore_eos": True}
    # An observer that slows each step makes 500 tokens take >= 2.5 s on any machine (the
    # tiny model alone can finish them inside the client's 0.5 s on a fast one).
    engine = app.state.engine.engine
    slow = engine.subscribe(lambda event: time.sleep(0.005))
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
        wait_for_idle(url)
    finally:
        engine.unsubscribe(slow)
    assert aborted() == before + 1  # aborted, not run to its 500 tokens
    assert app.state.engine.num_open_requests == 0


def test_100_concurrent_streams_match_sequential_answers(fresh):
    url, app = fresh
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    jobs = [(" ".join(words[: 1 + i % 8]) + f" {i}", 1 + (i * 7) % 24) for i in range(100)]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    sequential = [
        client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0)
        .choices[0].text
        for p, n in jobs
    ]

    async def one(aclient, prompt, n):
        stream = await aclient.completions.create(
            model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True})
        text, finishes, usage, ids = [], 0, None, set()
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text.append(choice.text)
                finishes += choice.finish_reason is not None
        return "".join(text), finishes, usage, ids

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                     timeout=120)
        async with aclient:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in jobs))

    results = asyncio.run(asyncio.wait_for(main(), timeout=240))
    assert len(results) == 100
    all_ids = set()
    for (text, finishes, usage, ids), want, (_, n) in zip(results, sequential, jobs, strict=True):
        assert text == want
        assert finishes == 1  # one finish per stream: nothing lost, nothing duplicated
        assert usage is not None and usage.completion_tokens <= n
        assert len(ids) == 1
        all_ids |= ids
    assert len(all_ids) == 100  # every response its own
    wait_for_idle(url)
    assert app.state.engine.num_open_requests == 0

"""``llmlab bench serve`` against a fake OpenAI-compatible server started inside the tests.

The fake server streams a few text chunks per request with a small sleep between them, then a
usage chunk and ``data: [DONE]``, and records what it was sent and how many requests were in
flight at once. Path prefixes pick a behaviour: ``/flaky`` answers every other request with
HTTP 400, ``/deny`` answers 401, ``/broken`` sends an error payload mid-stream, ``/nousage``
omits the usage chunk, ``/big`` sends one text chunk of 1 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import attrs
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from llmlab.loadtest import (
    BenchConfig,
    RequestResult,
    add_bench_serve_args,
    arrival_offsets_s,
    benchmark,
    load_json_requests,
    random_requests,
    run_bench_serve,
    summarize,
)

MODEL = "fake-model"
CHUNK_DELAY_S = 0.02
MAX_CHUNKS = 4
BIG_TEXT = "x" * (1 << 20)


@attrs.define
class FakeServer:
    """What the fake server saw; reset before each test."""

    base_url: str = ""
    in_flight: int = 0
    max_in_flight: int = 0
    num_calls: int = 0
    bodies: list = attrs.Factory(list)
    auth_headers: list = attrs.Factory(list)

    def reset(self) -> None:
        self.in_flight = self.max_in_flight = self.num_calls = 0
        self.bodies.clear()
        self.auth_headers.clear()


def _sse(payload: object) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _chunk(text: str, chat: bool, finish_reason: str | None = None) -> dict:
    choice = {"delta": {"content": text}} if chat else {"text": text}
    return {"choices": [{"index": 0, **choice, "finish_reason": finish_reason}]}


async def _events(state: FakeServer, body: dict, chat: bool, variant: str):
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        if chat:  # OpenAI opens a chat stream with the role and empty content
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        num_chunks = min(body["max_tokens"], MAX_CHUNKS)
        for i in range(num_chunks):
            await asyncio.sleep(CHUNK_DELAY_S)
            # /big: one SSE line far past aiohttp's default line limit (128 KiB), as a chunk
            # with many logprobs can be.
            yield _sse(_chunk(BIG_TEXT if variant == "big" and i == 0 else f" tok{i}", chat))
            if variant == "broken":
                yield _sse({"error": {"message": "engine died", "code": 500}})
                return
        yield _sse(_chunk("", chat, finish_reason="length"))
        if variant != "nousage":
            prompt = body["messages"][0]["content"] if chat else body["prompt"]
            # One more than the word count, to tell the server's count from the client's.
            prompt_tokens = len(prompt.split()) + 1
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": num_chunks,
                     "total_tokens": prompt_tokens + num_chunks}
            yield _sse({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    finally:
        state.in_flight -= 1


def _make_app(state: FakeServer) -> FastAPI:
    app = FastAPI()

    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def generate(request: Request):
        body = await request.json()
        variant = request.url.path.split("/v1/")[0].strip("/")
        state.bodies.append(body)
        state.auth_headers.append(request.headers.get("authorization"))
        call, state.num_calls = state.num_calls, state.num_calls + 1
        if variant == "deny":
            return JSONResponse({"error": {"message": "invalid api key"}}, status_code=401)
        if variant == "flaky" and call % 2 == 1:
            return JSONResponse({"error": {"message": "bad request"}}, status_code=400)
        chat = request.url.path.endswith("/chat/completions")
        events = _events(state, body, chat, variant)
        return StreamingResponse(events, media_type="text/event-stream")

    for prefix in ("", "/flaky", "/deny", "/broken", "/nousage", "/big"):
        app.add_api_route(f"{prefix}/v1/models", models, methods=["GET"])
        app.add_api_route(f"{prefix}/v1/completions", generate, methods=["POST"])
        app.add_api_route(f"{prefix}/v1/chat/completions", generate, methods=["POST"])
    return app


@pytest.fixture(scope="module")
def fake_server():
    state = FakeServer()
    config = uvicorn.Config(_make_app(state), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    state.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield state
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def server(fake_server, monkeypatch):
    fake_server.reset()
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("LLMLAB_API_KEY", raising=False)
    return fake_server


def _run(**kwargs) -> dict:
    config = BenchConfig(disable_tqdm=True, random_input_len=8, random_output_len=3, **kwargs)
    return asyncio.run(benchmark(config))


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_bench_serve_args(parser)
    return run_bench_serve(parser.parse_args(list(argv)))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- statistics -------------------------------------------------------------------------------


def _done(prompt, ttft, e2el, out, itl) -> RequestResult:
    return RequestResult(
        prompt_tokens=prompt, max_tokens=out, success=True, ttft_s=ttft, e2el_s=e2el,
        itl_s=list(itl), output_tokens=out,
    )


def test_summarize_gives_exact_statistics_on_synthetic_timings():
    results = [
        _done(10, 0.1, 1.0, 10, [0.1, 0.2]),  # tpot (1.0 - 0.1) / 9 = 0.1
        _done(20, 0.3, 2.1, 10, [0.3, 0.4]),  # tpot (2.1 - 0.3) / 9 = 0.2
        _done(30, 0.2, 0.2, 1, []),  # one token: no TPOT
        RequestResult(prompt_tokens=99, max_tokens=5, ttft_s=9.0, e2el_s=9.0, error="HTTP 500"),
    ]
    s = summarize(results, duration_s=4.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 21)
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(5.25)
    assert s["total_token_throughput"] == pytest.approx(20.25)
    expected = {  # (mean, median, p50, p99) in ms; numpy's linear interpolation for p99
        "ttft": (200, 200, 200, 298),  # [100, 300, 200]
        "tpot": (150, 150, 150, 199),  # [100, 200]
        "itl": (250, 250, 250, 397),  # [100, 200, 300, 400]
        "e2el": (1100, 1000, 1000, 2078),  # [1000, 2100, 200]
    }
    for metric, (mean, median, p50, p99) in expected.items():
        got = [s[f"{k}_{metric}_ms"] for k in ("mean", "median", "p50", "p99")]
        assert got == pytest.approx([mean, median, p50, p99]), metric


def test_summarize_names_fractional_percentiles_and_reads_zero_without_samples():
    s = summarize([_done(5, 0.5, 0.5, 1, [])], 1.0, ["tpot", "ttft"], [99.9])
    assert s["mean_tpot_ms"] == s["p99.9_tpot_ms"] == 0.0  # no request had two tokens
    assert s["p99.9_ttft_ms"] == pytest.approx(500.0)
    assert "mean_itl_ms" not in s  # only the metrics asked for


# --- arrivals and datasets --------------------------------------------------------------------


def test_arrivals_are_poisson_with_mean_gap_one_over_rate():
    offsets = arrival_offsets_s(20_001, request_rate=20.0, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: cv = 1
    np.testing.assert_array_equal(offsets, arrival_offsets_s(20_001, 20.0, seed=1))
    assert not np.array_equal(offsets, arrival_offsets_s(20_001, 20.0, seed=2))


def test_burstiness_keeps_the_rate_and_changes_the_spread():
    gaps = np.diff(arrival_offsets_s(20_001, request_rate=20.0, burstiness=4.0, seed=1))
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(0.5, rel=0.05)  # gamma: cv = 1/sqrt(k)


def test_infinite_rate_means_no_waiting():
    np.testing.assert_array_equal(arrival_offsets_s(5, float("inf")), np.zeros(5))


def test_random_prompts_are_seeded_share_the_prefix_and_stay_in_range():
    requests = random_requests(200, 20, 10, range_ratio=0.5, prefix_len=4, seed=3)
    assert requests == random_requests(200, 20, 10, range_ratio=0.5, prefix_len=4, seed=3)
    assert requests != random_requests(200, 20, 10, range_ratio=0.5, prefix_len=4, seed=4)
    assert len({tuple(r.prompt.split()[:4]) for r in requests}) == 1
    assert all(4 + 10 <= len(r.prompt.split()) == r.prompt_len <= 4 + 30 for r in requests)
    assert all(5 <= r.output_len <= 15 for r in requests)
    assert len({r.output_len for r in requests}) > 5


def test_json_dataset_formats_parse(tmp_path):
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(["one two", "three"]))
    assert [(r.prompt, r.output_len) for r in load_json_requests(plain, 3)] == [
        ("one two", 128), ("three", 128), ("one two", 128)  # cycles when the file is short
    ]
    objects = tmp_path / "objects.jsonl"
    objects.write_text('{"prompt": "a b c", "max_tokens": 7}\n\n{"prompt": "d", "output_len": 2}\n')
    assert [(r.prompt, r.output_len, r.prompt_len) for r in load_json_requests(objects, 2)] == [
        ("a b c", 7, 3), ("d", 2, 1)
    ]
    assert [r.output_len for r in load_json_requests(objects, 2, output_len=5)] == [5, 5]
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "gpt", "value": "no human turn: skipped"}]},
        {"conversations": [{"from": "human", "value": "hi there"},
                           {"from": "gpt", "value": "hello to you"}]},
        {"conversations": [{"role": "user", "content": "why"}]},
    ]))
    assert [(r.prompt, r.output_len) for r in load_json_requests(sharegpt, 2)] == [
        ("hi there", 3), ("why", 128)
    ]


@pytest.mark.parametrize("content, problem", [
    ("[1, 2", "not valid JSON"),
    ('{"prompt": "x"}', "expected a non-empty JSON list"),
    ("[]", "expected a non-empty JSON list"),
    ("[3]", "entry 0: expected a string"),
    ('["ok", {"text": "x"}]', "entry 1: expected a string"),
    ('[{"prompt": 5}]', "the prompt must be a non-empty string"),
    ('[{"prompt": "x", "max_tokens": 0}]', "max_tokens/output_len must be an int >= 1"),
    ('[{"conversations": "hi"}]', '"conversations" must be a list'),
    ('[{"conversations": [{"from": "gpt", "value": "x"}]}]', "no entry has a prompt"),
])
def test_malformed_json_dataset_names_the_file_and_the_problem(tmp_path, content, problem):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=str(path)) as info:
        load_json_requests(path, 4)
    assert problem in str(info.value)


def test_config_rejects_bad_values_naming_the_field():
    for kwargs, field in [
        ({"num_prompts": 0}, "num_prompts"), ({"request_rate": 0.0}, "request_rate"),
        ({"endpoint": "/v1/embeddings"}, "endpoint"), ({"dataset_name": "json"}, "dataset_path"),
        ({"percentile_metrics": ["ttft", "latency"]}, "percentile_metrics"),
        ({"metric_percentiles": [0]}, "metric_percentiles"),
    ]:
        with pytest.raises(ValueError, match=field):
            BenchConfig(**kwargs)


# --- against the fake server ------------------------------------------------------------------


def test_full_run_prints_every_metric_and_saves_json(server, tmp_path, capsys):
    path = tmp_path / "result.json"
    rc = _cli("--base-url", server.base_url, "--num-prompts", "6", "--random-input-len", "8",
              "--random-output-len", "3", "--ignore-eos", "--disable-tqdm",
              "--save-result", "--result-file", str(path))
    out = capsys.readouterr().out
    assert rc == 0
    labels = ["Successful requests:", "Failed requests:", "Benchmark duration (s):",
              "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
              "Output token throughput (tok/s):", "Total token throughput (tok/s):"]
    for name in ("TTFT", "TPOT", "ITL", "E2EL"):
        labels += [f"{stat} {name} (ms):" for stat in ("Mean", "Median", "P50", "P99")]
    rows = {line[:40].rstrip(): line[41:] for line in out.splitlines() if line[40:41] == " "}
    assert set(labels) <= set(rows), "a metric is missing or not aligned"
    assert rows["Successful requests:"] == "6" and rows["Total generated tokens:"] == "18"

    result = json.loads(path.read_text())
    assert result["model_id"] == MODEL and result["request_rate"] == "inf"
    assert (result["completed"], result["failed"], len(result["requests"])) == (6, 0, 6)
    assert result["total_input_tokens"] == 6 * (8 + 1)  # the server's usage, not word counts
    assert result["mean_tpot_ms"] > 0 and result["p99_e2el_ms"] >= result["median_e2el_ms"]
    assert all(len(r["itl_s"]) == 2 and r["output_tokens"] == 3 for r in result["requests"])
    body = server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == MODEL and body["max_tokens"] == 3 and body["ignore_eos"] is True
    assert len(body["prompt"].split()) == 8


def test_chat_endpoint_sends_messages_and_reads_deltas(server, capsys):
    rc = _cli("--base-url", server.base_url, "--endpoint", "/v1/chat/completions",
              "--num-prompts", "3", "--random-input-len", "5", "--random-output-len", "3")
    assert rc == 0
    assert "3/3" in capsys.readouterr().err  # the progress bar ticked once per request
    body = server.bodies[0]
    assert "prompt" not in body and body["messages"][0]["role"] == "user"
    assert len(body["messages"][0]["content"].split()) == 5
    result = _run(base_url=server.base_url, endpoint="/v1/chat/completions", num_prompts=2)
    request = result["requests"][0]
    # The opening role chunk and the closing empty chunk carry no text: 3 tokens, 2 gaps.
    assert request["generated_text"] == " tok0 tok1 tok2"
    assert request["output_tokens"] == 3 and len(request["itl_s"]) == 2


def test_infinite_rate_sends_every_request_at_once(server):
    result = _run(base_url=server.base_url, num_prompts=8)
    assert max(r["send_s"] for r in result["requests"]) < 0.5 * CHUNK_DELAY_S * MAX_CHUNKS * 8
    assert server.max_in_flight > 3


def test_max_concurrency_is_respected(server):
    result = _run(base_url=server.base_url, num_prompts=10, max_concurrency=3)
    assert result["completed"] == 10 and result["max_concurrency"] == 3
    assert server.max_in_flight == 3


def test_requests_are_sent_at_their_arrival_times(server):
    result = _run(base_url=server.base_url, num_prompts=6, request_rate=25.0, seed=5)
    sent = [r["send_s"] for r in result["requests"]]
    expected = arrival_offsets_s(6, 25.0, seed=5)
    assert sent == pytest.approx(expected, abs=0.05)


def test_failed_requests_are_counted(server, capsys):
    result = _run(base_url=f"{server.base_url}/flaky", num_prompts=6)
    assert (result["completed"], result["failed"]) == (3, 3)
    errors = [r["error"] for r in result["requests"] if not r["success"]]
    assert errors == ["HTTP 400: bad request"] * 3
    assert _cli(
        "--base-url", f"{server.base_url}/flaky", "--num-prompts", "4", "--disable-tqdm"
    ) == 0
    captured = capsys.readouterr()
    assert "warning: 2 requests failed" in captured.err
    assert "Failed requests:                         2" in captured.out


def test_an_error_payload_mid_stream_fails_the_request(server):
    result = _run(base_url=f"{server.base_url}/broken", num_prompts=2)
    assert result["failed"] == 2
    assert result["requests"][0]["error"] == "engine died"


def test_all_failing_run_prints_the_errors_and_returns_1(server, capsys):
    rc = _cli("--base-url", f"{server.base_url}/deny", "--num-prompts", "3", "--disable-tqdm")
    captured = capsys.readouterr()
    assert rc == 1
    assert "error: all 3 requests failed" in captured.err
    assert "HTTP 401: invalid api key" in captured.err
    assert "Serving Benchmark Result" not in captured.out


def test_output_tokens_fall_back_to_text_chunks_without_usage(server):
    result = _run(base_url=f"{server.base_url}/nousage", num_prompts=2)
    request = result["requests"][0]
    assert request["success"] and request["output_tokens"] == 3
    assert request["prompt_tokens"] == 8  # the prompt's word count


def test_a_chunk_of_a_mebibyte_is_read_whole(server):
    result = _run(base_url=f"{server.base_url}/big", num_prompts=2)
    assert result["completed"] == 2, [r["error"] for r in result["requests"]]
    assert result["requests"][0]["generated_text"] == BIG_TEXT + " tok1 tok2"


def test_api_key_header_is_sent(server, monkeypatch):
    _run(base_url=server.base_url, num_prompts=1)
    assert server.auth_headers == [None]
    monkeypatch.setenv("LLMLAB_API_KEY", "sk-llmlab")
    _run(base_url=server.base_url, num_prompts=1)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")  # takes precedence
    _run(base_url=server.base_url, num_prompts=1)
    assert _cli("--base-url", server.base_url, "--num-prompts", "1", "--disable-tqdm",
                "--api-key", "sk-flag") == 0
    assert server.auth_headers == [None, "Bearer sk-llmlab", "Bearer sk-openai", "Bearer sk-flag"]


def test_usage_errors_exit_2_with_one_line(server, tmp_path, capsys):
    cases = [
        (["--base-url", f"http://127.0.0.1:{_free_port()}"], "cannot reach the server"),
        (["--base-url", server.base_url, "--dataset-name", "json",
          "--dataset-path", str(tmp_path / "missing.json")], "dataset file not found"),
        (["--base-url", server.base_url, "--metric-percentiles", "p99"], "--metric-percentiles"),
        (["--base-url", server.base_url, "--extra-body", "[1]"], "--extra-body"),
    ]
    for argv, message in cases:
        assert _cli(*argv, "--disable-tqdm") == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err

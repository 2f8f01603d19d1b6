"""The server in front of two data-parallel replicas: 200 streams while one replica is
killed, health, metrics with per-replica labels, and no process left after shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.distributed.test_data_parallel import SETTINGS, replica_children, wait_gone
from tests.server.conftest import metric, running

pytest.importorskip("fastapi")

pytestmark = pytest.mark.slow  # servers over replica processes: 20-45 s a test on 2 cores

MAX_TOKENS = 24


async def stream_one(client: httpx.AsyncClient, url: str, i: int) -> dict:
    """One streaming completion: its token count, finish reason, or in-band error."""
    body = {"model": "tiny", "prompt": f"request {i} says", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    result = {"tokens": None, "finish": None, "error": None}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            result["error"] = json.loads(await response.aread())["error"]
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                result["error"] = chunk["error"]
            if chunk.get("usage"):
                result["tokens"] = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", ()):
                if choice["finish_reason"] is not None:
                    result["finish"] = choice["finish_reason"]
    return result


async def stream_all(url: str, n: int) -> list[dict]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(stream_one(client, url, i) for i in range(n)))


def test_200_streams_survive_a_killed_replica_and_the_server_reports_it(tiny_llama):
    from llmlab.distributed.data_parallel import DataParallelEngine
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    dp = DataParallelEngine.from_settings(
        tiny_llama, data_parallel_size=2, **SETTINGS)
    pids = [s.pid for s in dp.health()]
    # Which replica got each request (the front end's own routing decisions).
    routed: dict[int, set[str]] = {0: set(), 1: set()}
    round_robin = dp.router

    class Recording:
        def route(self, request, replicas):
            choice = round_robin.route(request, replicas)
            routed[replicas[choice].replica_index].add(request.request_id)
            return choice

    dp.router = Recording()
    # Kill replica 1 from its own step events, once it is well into its share of the work:
    # mid-run on any machine, however fast.
    finished_on_1: set[str] = set()
    sampled = [0]
    killed = threading.Event()

    def killer(index, event):
        if index != 1:
            return
        finished_on_1.update(rid for rid, _ in event.finished)
        sampled[0] += sum(n for _, n in event.sampled)
        if sampled[0] >= 300 and not killed.is_set():
            killed.set()
            os.kill(pids[1], signal.SIGKILL)

    dp.subscribe(killer, replica=True)
    app = build_app(AsyncEngine(dp), served_model_names=["tiny"])
    with running(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/health").content == b""
        results = asyncio.run(stream_all(url, 200))
        assert killed.is_set()
        wait_gone([pids[1]])

        done = [r for r in results if r["finish"] == "length"]
        failed = [r for r in results if r["error"] is not None]
        assert len(done) + len(failed) == 200
        assert all(r["tokens"] == MAX_TOKENS and r["error"] is None for r in done)
        # every request on the surviving replica finished; those still in flight on the
        # dead one ended with an error naming it
        assert routed[0] and routed[1]
        lost = routed[1] - finished_on_1
        assert len(failed) == len(lost) > 0
        assert len(done) == len(routed[0]) + len(routed[1] & finished_on_1)
        for r in failed:
            assert "replica 1" in r["error"]["message"], r
            assert "SIGKILL" in r["error"]["message"], r
            assert r["error"]["type"] == "server_error" and r["error"]["code"] == 503

        health = httpx.get(f"{url}/health")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "degraded"
        assert [(r["index"], r["status"]) for r in body["replicas"]] == [(0, "ok"), (1, "dead")]
        assert "SIGKILL" in body["replicas"][1]["reason"]

        # new requests are served by the live replica
        again = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "still here?", "max_tokens": 4})
        assert again.status_code == 200, again.text

        text = httpx.get(f"{url}/metrics").text
        assert metric(text, "llmlab:dp_replicas") == 2
        assert metric(text, "llmlab:dp_replicas_alive") == 1
        assert metric(text, "llmlab:dp_replica_alive", engine="1") == 0
        for engine in ("0", "1", "all"):
            assert f'engine="{engine}"' in text
        tokens = {e: metric(text, "llmlab:generation_tokens_total", engine=e)
                  for e in ("0", "1", "all")}
        assert tokens["all"] == tokens["0"] + tokens["1"] > 0
        ok = {e: metric(text, "llmlab:request_success_total", engine=e,
                        finished_reason="length") for e in ("0", "all")}
        assert ok["0"] == len(routed[0]) and ok["all"] == len(done) + 1  # + "still here?"

        # the last replica goes: the engine is dead, the server says so
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (dead := httpx.get(f"{url}/health")).status_code != 503:
            assert time.monotonic() < deadline, dead.text
            time.sleep(0.05)
        assert "every replica is dead" in dead.text
        refused = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "anyone?", "max_tokens": 4})
        assert refused.status_code == 503 and "replica" in refused.text
    # the app's shutdown stopped the engine and its replicas
    assert not {c.pid for c in replica_children()} & set(pids)


def test_serve_cli_runs_data_parallel_replicas_and_leaves_none_behind(tiny_llama):
    from tests.server.test_serve_cli import start_server

    proc, url = start_server(
        [tiny_llama, "--served-model-name", "tiny", "--max-model-len", "256", "--dtype",
         "float32", "--data-parallel-size", "2", "--router", "prefix_aware",
         "--cpu-threads", "1"],
    )
    try:
        replicas = psutil.Process(proc.pid).children(recursive=True)
        replica_pids = [
            c.pid for c in replicas if "resource_tracker" not in " ".join(c.cmdline())
        ]
        assert len(replica_pids) == 2
        done = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "Hi", "max_tokens": 4})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
        text = httpx.get(f"{url}/metrics").text
        assert metric(text, "llmlab:dp_replicas_alive") == 2
        assert metric(text, "llmlab:request_success_total", engine="all") == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        wait_gone(replica_pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

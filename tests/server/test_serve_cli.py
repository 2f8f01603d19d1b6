"""``llmlab serve`` as a user runs it (a subprocess), its shutdown, and ``llmlab bench serve``."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from llmlab.entrypoints.cli import main
from tests.helpers import CLI_KV_FLAGS, subprocess_env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, env_extra=None, timeout=120.0, memory_cap: int | None = None):
    """``llmlab serve ARGS`` in a subprocess (``memory_cap``: its address space, bytes)."""
    port = free_port()
    env = subprocess_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env_extra or {}))

    def cap() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_cap, memory_cap))

    proc = subprocess.Popen(
        [sys.executable, "-m", "llmlab", "serve", *args, *CLI_KV_FLAGS, "--port", str(port),
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=cap if memory_cap else None,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_answers_then_shuts_down_cleanly_on_a_signal(tiny_llama, sig):
    proc, url = start_server(
        [tiny_llama, "--served-model-name", "tiny", "--max-model-len", "256", "--dtype",
         "float32", "--scheduling-policy", "fair", "--no-enable-prefix-caching"],
        env_extra={"LLMLAB_API_KEY": "k"},
    )
    try:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        headers = {"Authorization": "Bearer k"}
        models = httpx.get(f"{url}/v1/models", headers=headers).json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "user": "alice"}
        done = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
        # a stream still open when the signal arrives must not keep the server up
        stream_body = {**body, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=stream_body, headers=headers,
                          timeout=60) as response:
            next(response.iter_lines())
            proc.send_signal(sig)
            proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read()


def test_serve_without_a_model_serves_the_builtin_one():
    proc, url = start_server([], timeout=240)
    try:
        models = httpx.get(f"{url}/v1/models").json()
        assert models["data"][0]["id"] == "llmlab-stories"
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
        assert chat.status_code == 200, chat.text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 0


def test_serve_rejects_a_bad_flag_value_in_one_line(tiny_llama):
    result = subprocess.run(
        [sys.executable, "-m", "llmlab", "serve", tiny_llama, "--scheduling-policy", "nope"],
        capture_output=True, text=True, timeout=120, check=False, env=subprocess_env())
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and "nope" in result.stderr
    assert "Traceback" not in result.stderr


def test_bench_serve_runs_against_the_server(served, capsys, tmp_path):
    url, _ = served
    out_file = tmp_path / "bench.json"
    code = main(["bench", "serve", "--base-url", url, "--num-prompts", "12",
                 "--random-input-len", "8", "--random-output-len", "6", "--ignore-eos",
                 "--max-concurrency", "4", "--disable-tqdm", "--result-file", str(out_file)])
    assert code == 0
    out = capsys.readouterr().out
    for words in ("Successful requests", "Request throughput", "Output token throughput",
                  "TTFT", "TPOT", "ITL", "E2E"):
        assert words in out, words
    import json

    result = json.loads(out_file.read_text())
    assert result["completed"] == 12 and result["total_output_tokens"] == 12 * 6
    chat = main(["bench", "serve", "--base-url", url, "--endpoint", "/v1/chat/completions",
                 "--num-prompts", "4", "--random-output-len", "3", "--request-rate", "50",
                 "--disable-tqdm"])
    assert chat == 0


def _client(url: str, i: int, stream: bool) -> str:
    """One request during shutdown: 'full', 'error' (in-band, ended by [DONE], or a JSON
    503), or what went wrong."""
    body = {"model": "tiny", "prompt": f"Request {i}", "max_tokens": 300, "ignore_eos": True,
            "stream": stream}
    try:
        if not stream:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            if r.status_code == 200:
                return "full" if r.json()["usage"]["completion_tokens"] == 300 else "short"
            if r.status_code == 503 and "error" in r.json():
                return "error"
            return f"status {r.status_code}: {r.text[:200]}"
        lines = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
            status = r.status_code
        if status == 503 and lines and '"error"' in lines[0]:
            return "error"  # ended before its stream began: a JSON 503
        if not lines or lines[-1] != "data: [DONE]":
            return f"no [DONE]: {lines[-2:]}"
        if any('"error"' in line for line in lines):
            return "error"
        return "full"
    except httpx.HTTPError as err:
        return f"{type(err).__name__}: {err}"


@pytest.mark.slow
@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGTERM, signal.SIGINT]])
def test_shutdown_under_load_ends_every_request_in_band_and_exits_0(tiny_llama, signals):
    """SIGTERM (then SIGINT) with 200 requests in flight: each client gets its full answer
    or an in-band error, the exit status is 0, and the log has no traceback."""
    from concurrent.futures import ThreadPoolExecutor

    proc, url = start_server([tiny_llama, "--served-model-name", "tiny", "--max-model-len",
                              "512", "--dtype", "float32", "--shutdown-grace-s", "0.5"])
    try:
        with ThreadPoolExecutor(200) as pool:  # the 200 in flight
            futures = [pool.submit(_client, url, i, i % 2 == 0) for i in range(200)]
            deadline = time.monotonic() + 30
            seen = ("llmlab:num_requests_running", "llmlab:num_requests_waiting",
                    "llmlab:request_success_total")
            while time.monotonic() < deadline:  # all in flight before the signal
                metrics = httpx.get(f"{url}/metrics", timeout=10).text
                # Every request reached the engine (running, waiting or done): on a loaded
                # machine the 200 client threads take a while to connect, and one still
                # connecting when the listener closes is refused, not answered in band.
                if sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith(seen)) >= 200:
                    break
                time.sleep(0.05)
            for sig in signals:
                proc.send_signal(sig)
                time.sleep(0.2)
            results = [f.result(timeout=60) for f in futures]
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()
    assert all(r in ("full", "error") for r in results), [r for r in results
                                                          if r not in ("full", "error")]
    assert "error" in results  # the grace period really ended some
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr


@pytest.mark.slow
def test_the_edge_probe_bombs_leave_a_memory_capped_server_serving(tiny_llama):
    """The probe's one-request attacks, against a server under an address-space cap: each
    is refused at the edge, quickly, and the server keeps answering."""
    proc, url = start_server([tiny_llama, "--served-model-name", "tiny", "--dtype", "float32"],
                             memory_cap=12 * 2**30)
    bombs = [
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                       "chat_template": "{{ 'x' * 4*10**7 }}"}),
        ("/tokenize", {"prompt": "word " * 2_000_000}),
        ("/v1/completions", {"prompt": "hi", "bad_words": ["\ud800"], "max_tokens": 2}),
        ("/v1/completions", {"prompt": ["hi"] * 100_000, "max_tokens": 1}),
        ("/v1/completions", {"prompt": ["hi"] * 200, "n": 256, "max_tokens": 1}),
    ]
    try:
        for route, body in bombs:
            start = time.monotonic()
            r = httpx.post(url + route, content=json.dumps(body), timeout=60,
                           headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (route, r.text[:300])
            assert time.monotonic() - start < 10, route
            ok = httpx.post(f"{url}/v1/completions", timeout=60,
                            json={"model": "tiny", "prompt": "still", "max_tokens": 2})
            assert ok.status_code == 200 and proc.poll() is None, route
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0

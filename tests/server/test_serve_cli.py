"""``llmlab serve`` as a user runs it (a subprocess), its shutdown, and ``llmlab bench serve``."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from llmlab.cli import main
from tests.helpers import CLI_KV_FLAGS, subprocess_env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, env_extra=None, timeout=120.0):
    port = free_port()
    env = subprocess_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env_extra or {}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmlab", "serve", *args, *CLI_KV_FLAGS, "--port", str(port),
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
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

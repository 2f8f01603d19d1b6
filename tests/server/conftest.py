"""Real uvicorn servers on 127.0.0.1 (a free port each), serving tiny models built offline."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


@contextlib.contextmanager
def running(app, timeout: float = 30.0):
    """Serve ``app`` with uvicorn in a thread; yields the base URL (``http://127.0.0.1:P``)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (summed over other labels)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"([^{\s]+)(?:\{([^}]*)\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    if not found:
        raise KeyError(f"no sample {name} {labels} in the metrics")
    return total


@pytest.fixture(scope="session")
def served(tiny_llama):
    """One server for the read-mostly tests: ``(base_url, app)`` serving ``tiny_llama`` as
    ``"tiny"`` (and ``"tiny-alias"``)."""
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32", seed=0)
    app = build_app(engine, served_model_names=["tiny", "tiny-alias"], model_path=tiny_llama)
    with running(app) as url:
        yield url, app


@pytest.fixture(scope="session")
def reference(tiny_llama):
    """``LLM`` on the same weights: what the server must reproduce."""
    from llmlab import LLM

    return LLM(tiny_llama, dtype="float32", seed=0)


@pytest.fixture
def client(served):
    openai = pytest.importorskip("openai")
    url, _ = served
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

"""Small builders shared by tests that need requests but no model."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from llmlab.request import Request
from llmlab.sampling.params import SamplingParams

_ids = itertools.count()

# `llmlab generate` / `serve` run by the CLI tests: on CUDA an explicit KV cache size, so a
# subprocess does not claim 90% of a GPU that other tests (and xdist workers) share.
CLI_KV_FLAGS = ["--kv-cache-memory-bytes", str(256 << 20)] if torch.cuda.is_available() else []
# The same for an engine built in a Python subprocess (tests/conftest.py's cap does not reach it).
SUBPROCESS_KV = {"kv_cache_memory_bytes": 256 << 20} if torch.cuda.is_available() else {}


def subprocess_env(*, drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """The environment for a process a test starts: one CPU thread (``llmlab.threads``:
    several processes spinning full thread pools on a small machine slow the whole suite
    many times over), without the variables in ``drop``, plus ``extra``."""
    from llmlab.threads import child_env

    env = child_env(1, threads=1)
    for name in drop:
        env.pop(name, None)
    env.update(extra)
    return env


def slow_after_first(values) -> list:
    """``values`` for ``parametrize``: the first runs in the default suite, the others are
    marked ``slow`` (CI runs them): one case of an expensive end-to-end check per run."""
    values = list(values)
    return values[:1] + [pytest.param(value, marks=pytest.mark.slow) for value in values[1:]]


def make_request(tokens, *, arrival=None, max_tokens=16, request_id=None, **params) -> Request:
    n = next(_ids)
    return Request(
        request_id=request_id or f"r{n}",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        arrival_time=float(n if arrival is None else arrival),
    )


def builtin_names(kind: str) -> list[str]:
    """llmlab's own registered names of ``kind`` (tests register more in the same process)."""
    from llmlab import registry

    return [
        name for name in registry.available(kind)
        if registry.resolve(kind, name).__module__.startswith("llmlab.")
    ]


def run(coro, timeout=60):
    """Run a coroutine to completion on a fresh event loop, failing after ``timeout`` s."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


"""Freezing a serving process's startup heap out of the garbage collector's full passes:
for the block only (``frozen_heap``), and in ``llmlab serve``'s app while it serves."""

from __future__ import annotations

import gc

import pytest

from llmlab.utils.gc_heap import frozen_heap


def test_frozen_heap_freezes_for_the_block_and_collects_first_when_asked():
    before = gc.get_freeze_count()
    cycle: list = []
    cycle.append(cycle)  # garbage only a collection finds
    del cycle
    with frozen_heap(collect=True):
        inside = gc.get_freeze_count()
        assert inside > before
        assert gc.collect() >= 0  # later objects are still collected
    assert gc.get_freeze_count() == 0
    with frozen_heap(enabled=False):
        assert gc.get_freeze_count() == 0


def test_the_server_freezes_its_heap_while_it_serves_only_when_asked(tiny_llama):
    pytest.importorskip("fastapi")
    import httpx

    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app
    from tests.server.conftest import running

    for freeze in (False, True):
        engine = AsyncEngine.from_settings(tiny_llama, dtype="float32", seed=0)
        app = build_app(engine, served_model_names=["tiny"], freeze_gc=freeze)
        with running(app) as url:
            frozen = gc.get_freeze_count()
            reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "Hello", "max_tokens": 3})
            assert reply.status_code == 200
        assert (frozen > 1000) is freeze
        assert gc.get_freeze_count() == 0  # the app's shutdown unfroze it

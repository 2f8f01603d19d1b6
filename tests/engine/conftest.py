"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from llmlab.entrypoints.async_engine import AsyncEngine


@pytest.fixture
def engine(tiny_llama):
    """An :class:`AsyncEngine` over tiny Llama in float32, shut down after the test (a
    module may define its own ``engine``, which takes precedence)."""
    eng = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    yield eng
    eng.shutdown()

"""``build_engine``: the engine ``LLM(model, tokenizer, **settings)`` and
``AsyncEngine.from_settings`` run, chosen by ``data_parallel_size``.

One replica (the default) is a plain :class:`~llmlab.engine.engine.Engine` from
:class:`~llmlab.engine.builder.EngineBuilder`; ``data_parallel_size > 1`` (or
``engine_core_process``, one replica) is a
:class:`~llmlab.distributed.data_parallel.DataParallelEngine` (replicas in processes of
their own, behind a router). Both are an :class:`~llmlab.engine.client.EngineClient`.
"""

from __future__ import annotations

from typing import Any

from llmlab.distributed.data_parallel import DataParallelEngine, check_data_parallel_settings
from llmlab.engine.builder import EngineBuilder
from llmlab.engine.client import EngineClient

__all__ = ["build_engine"]


def build_engine(model: str, tokenizer: str | None = None, *,
                 replica_heartbeat_timeout_s: float | None = None,
                 replica_wedged_after_s: float | None = None, **settings: Any) -> EngineClient:
    """The engine ``settings`` describe (``EngineConfig`` fields and components, as
    ``LLM`` takes them; ``ValueError``/``TypeError`` naming a bad one, before anything
    loads). ``router`` / ``router_config`` and the ``replica_*`` deadlines
    (:meth:`DataParallelEngine.from_settings`) are used with ``data_parallel_size > 1``,
    and checked (unused) with one replica, so a typo fails either way."""
    builder = EngineBuilder.from_settings(model, tokenizer, **settings)  # checks settings
    deadlines = {"replica_heartbeat_timeout_s": replica_heartbeat_timeout_s,
                 "replica_wedged_after_s": replica_wedged_after_s}
    config = builder.config
    if config.data_parallel_size > 1 or config.engine_core_process:
        return DataParallelEngine.from_settings(model, tokenizer, **deadlines, **settings)
    router = builder.router if builder.router is not None else config.router
    check_data_parallel_settings(router, **deadlines, router_config=config.router_config)
    return builder.build()

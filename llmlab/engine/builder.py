"""``EngineBuilder``: compose an engine from a config plus any components you swap in.

    engine = (EngineBuilder(EngineConfig(model="path/or/hub-id"))
              .with_scheduling_policy(MyPolicy())
              .with_eviction_policy(LFUEviction())
              .build())

Every component left unset gets its built-in default (FCFS, LRU, the ``"auto"`` attention
backend: Triton kernels on CUDA, the torch reference elsewhere; the default sampler), so
swapping one piece still yields the whole engine. Components may also be given by
registered name (``"fcfs"``, ``"priority"``, ``"fair"``, ``"lru"``, ``"s3fifo"``,
``"torch"``, ``"triton"``, ...; see :mod:`llmlab.registry` and ``llmlab components``) or import path
(``"package.module:Class"``), which is how the command line picks them. A component missing
a required method is rejected here, naming the method, before any weights load. The work
itself is :func:`llmlab.engine.assembly.assemble`.
"""

from __future__ import annotations

from typing import Any

import attrs

from llmlab.attention.backend import AttentionBackend
from llmlab.cache.eviction import EvictionPolicy
from llmlab.config import EngineConfig
from llmlab.engine.assembly import CONFIG_FIELDS, assemble, plan_engine
from llmlab.engine.engine import Engine
from llmlab.runner.build import BuildPlan
from llmlab.sampling.sampler import Sampler
from llmlab.scheduler.policy import SchedulingPolicy


@attrs.define
class EngineBuilder:
    """Holds a config and optional component instances; ``build()`` makes the engine."""

    config: EngineConfig
    scheduling_policy: SchedulingPolicy | str | None = None
    eviction_policy: EvictionPolicy | str | None = None
    attention_backend: AttentionBackend | str | None = None
    sampler: Sampler | str | None = None
    # The KV offload tier's eviction policy (kv_offloading_size); None: the config's name.
    offload_eviction_policy: EvictionPolicy | str | None = None
    # Feature plugins (llmlab.plugin): instances, registered names or "module:Class".
    plugins: tuple[Any, ...] = ()

    @classmethod
    def from_settings(
        cls,
        model: str,
        tokenizer: str | None = None,
        *,
        scheduling_policy: Any = None,
        eviction_policy: Any = None,
        attention_backend: Any = None,
        sampler: Any = None,
        plugins: Any = (),
        **settings: Any,
    ) -> EngineBuilder:
        """A builder from ``LLM``'s arguments: the components, and ``EngineConfig`` fields as
        keywords. Raises ``ValueError`` naming any keyword that is neither.
        ``disable_log_requests`` (an ``AsyncEngineArgs`` field, so that
        ``LLM(**vars(AsyncEngineArgs(...)))`` works) is accepted and changes nothing: the
        engine logs no per-request lines."""
        settings.pop("disable_log_requests", None)
        unknown = sorted(set(settings) - set(CONFIG_FIELDS))
        if unknown:
            raise ValueError(
                f"unknown LLM argument(s) {unknown}; allowed: {', '.join(CONFIG_FIELDS)}, "
                "scheduling_policy, eviction_policy, attention_backend, sampler, plugins"
            )
        return cls(
            EngineConfig(model=model, tokenizer=tokenizer, **settings),
            scheduling_policy=scheduling_policy,
            eviction_policy=eviction_policy,
            attention_backend=attention_backend,
            sampler=sampler,
            plugins=tuple(plugins or ()),
        )

    def with_scheduling_policy(self, policy: SchedulingPolicy) -> EngineBuilder:
        return attrs.evolve(self, scheduling_policy=policy)

    def with_eviction_policy(self, policy: EvictionPolicy) -> EngineBuilder:
        return attrs.evolve(self, eviction_policy=policy)

    def with_attention_backend(self, backend: AttentionBackend) -> EngineBuilder:
        return attrs.evolve(self, attention_backend=backend)

    def with_sampler(self, sampler: Sampler) -> EngineBuilder:
        return attrs.evolve(self, sampler=sampler)

    def with_offload_eviction_policy(self, policy: EvictionPolicy) -> EngineBuilder:
        """The KV offload tier's eviction policy (an instance or registered name; default:
        ``config.kv_offloading_eviction_policy``); the tier needs ``kv_offloading_size``."""
        return attrs.evolve(self, offload_eviction_policy=policy)

    def build(self) -> Engine:
        """The engine (loads the model; ``ValueError`` / ``TypeError`` for a bad setting or
        component, raised before any weights load)."""
        return Engine(**assemble(
            self.config, scheduling_policy=self.scheduling_policy,
            eviction_policy=self.eviction_policy, attention_backend=self.attention_backend,
            sampler=self.sampler, offload_eviction_policy=self.offload_eviction_policy,
            plugins=self.plugins,
        ))

    def with_plugin(self, plugin: Any) -> EngineBuilder:
        """Plug a feature in (a :class:`~llmlab.plugin.SchedulerPlugin` or
        :class:`~llmlab.plugin.RunnerPlugin`, a registered name or ``"module:Class"``)."""
        return attrs.evolve(self, plugins=(*self.plugins, plugin))

    def plan(self) -> BuildPlan:
        """Everything decided before any weights load (see
        :func:`~llmlab.engine.assembly.plan_engine`); starts nothing."""
        return plan_engine(self.config, self.attention_backend, self.sampler)

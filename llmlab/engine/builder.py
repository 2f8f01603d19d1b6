"""``EngineBuilder``: compose an engine from a config plus any components you swap in.

    engine = (EngineBuilder(EngineConfig(model="path/or/hub-id"))
              .with_scheduling_policy(MyPolicy())
              .with_eviction_policy(LFUEviction())
              .build())

Every component left unset gets its built-in default (FCFS, LRU, the ``"auto"`` attention
backend: Triton kernels on CUDA, the torch reference elsewhere; the default sampler), so
swapping one piece still yields the whole engine.

One way for every kind: the config *names* components (``EngineConfig.scheduling_policy =
"fair"``, ``kv_press="snapkv"``, ... with ``<kind>_config`` keyword arguments: plain data,
picklable and savable as YAML), and the builder holds *instances* (or names), which take the
config's name's place. :meth:`EngineBuilder.from_settings` (``LLM``'s keywords) sorts what
it is given into the two. A component missing a required method is rejected here, naming
the method, before any weights load. The work itself is
:func:`llmlab.engine.assembly.assemble`; docs/components.md is the guide.
"""

from __future__ import annotations

from typing import Any

import attrs

from llmlab import registry
from llmlab.attention.backend import AttentionBackend
from llmlab.cache.eviction import EvictionPolicy
from llmlab.config import COMPONENT_FIELDS, EngineConfig
from llmlab.engine.assembly import CONFIG_FIELDS, assemble, plan_engine
from llmlab.engine.engine import Engine
from llmlab.pooling.pooler import PoolerConfig
from llmlab.runner.build import BuildPlan
from llmlab.sampling.sampler import Sampler
from llmlab.scheduler.policy import SchedulingPolicy
from llmlab.speculative.config import SpeculativeConfig

# LLM keywords that are not EngineConfig fields: they fold into one (speculative_config,
# pooler_config) or into the builder's instances.
COMPONENT_KEYWORDS = ("proposer", "proposer_config", "pooler")


@attrs.define
class EngineBuilder:
    """Holds a config and optional component instances (or names, which replace the
    config's); ``build()`` makes the engine."""

    config: EngineConfig
    scheduling_policy: SchedulingPolicy | str | None = None
    eviction_policy: EvictionPolicy | str | None = None
    attention_backend: AttentionBackend | str | None = None
    sampler: Sampler | str | None = None
    # The KV offload tier's eviction policy (kv_offloading_size); None: the config's name.
    offload_eviction_policy: EvictionPolicy | str | None = None
    kv_press: Any = None  # a KV press (llmlab.kvpress.KVPress) instance
    # Speculative decoding's drafter and per-step length (instances; the config names them
    # by class: speculative_config.method == "custom").
    proposer: Any = None
    speculation_length: Any = None
    # The data-parallel router (an instance; used by DataParallelEngine, not build()).
    router: Any = None
    # Feature plugins (llmlab.plugin): instances, registered names or "module:Class".
    plugins: tuple[Any, ...] = ()

    @classmethod
    def from_settings(cls, model: str, tokenizer: str | None = None, **settings: Any
                      ) -> EngineBuilder:
        """A builder from ``LLM``'s arguments: ``EngineConfig`` fields as keywords, where
        each component (``scheduling_policy``, ``eviction_policy``, ``attention_backend``,
        ``sampler``, ``router``, ``kv_press``, ``plugins``, and ``proposer`` /
        ``proposer_config``, ``pooler``) may be a name, which the config keeps, or an
        instance, which the builder keeps (a ``<kind>_config`` with an instance is a
        ``ValueError``). Raises ``ValueError`` naming any keyword that is neither.
        ``disable_log_requests`` (an ``AsyncEngineArgs`` field, so that
        ``LLM(**vars(AsyncEngineArgs(...)))`` works) is accepted and changes nothing: the
        engine logs no per-request lines."""
        settings.pop("disable_log_requests", None)
        if "tool_parser" in settings or "tool_call_parser" in settings:
            raise ValueError(
                "tool_parser is a server setting (llmlab serve --tool-call-parser NAME, or "
                "build_app(..., tool_call_parser=...)): LLM returns the model's text and "
                "parses no tool calls"
            )
        unknown = sorted(set(settings) - set(CONFIG_FIELDS) - set(COMPONENT_KEYWORDS))
        if unknown:
            raise ValueError(
                f"unknown LLM argument(s) {unknown}; allowed: "
                f"{', '.join(CONFIG_FIELDS + COMPONENT_KEYWORDS)}"
            )
        instances = {}
        for kind in COMPONENT_FIELDS:
            value = settings.get(kind)
            if value is not None and not isinstance(value, str):
                _refuse_config(kind, value, settings.get(f"{kind}_config"))
                instances[kind] = settings.pop(kind)
        plugins = settings.pop("plugins", None) or ()
        if isinstance(plugins, str) or not isinstance(plugins, (list, tuple)):
            plugins = [plugins]
        settings["plugins"] = tuple(p for p in plugins if isinstance(p, str))
        spec, proposer, length = SpeculativeConfig.split(
            settings.pop("speculative_config", None), settings.pop("proposer", None),
            settings.pop("proposer_config", None),
        )
        settings["speculative_config"] = spec
        if "pooler" in settings:
            settings["pooler_config"] = _with_pooler(settings.pop("pooler"),
                                                     settings.get("pooler_config"))
        return cls(
            EngineConfig(model=model, tokenizer=tokenizer, **settings),
            plugins=tuple(p for p in plugins if not isinstance(p, str)),
            proposer=proposer, speculation_length=length, **instances,
        )

    def with_scheduling_policy(self, policy: SchedulingPolicy) -> EngineBuilder:
        return attrs.evolve(self, scheduling_policy=policy)

    def with_eviction_policy(self, policy: EvictionPolicy) -> EngineBuilder:
        return attrs.evolve(self, eviction_policy=policy)

    def with_attention_backend(self, backend: AttentionBackend) -> EngineBuilder:
        return attrs.evolve(self, attention_backend=backend)

    def with_sampler(self, sampler: Sampler) -> EngineBuilder:
        return attrs.evolve(self, sampler=sampler)

    def with_kv_press(self, press: Any) -> EngineBuilder:
        """A KV press instance (or name) in place of ``config.kv_press``."""
        return attrs.evolve(self, kv_press=press)

    def with_proposer(self, proposer: Any) -> EngineBuilder:
        """Speculative decoding's drafter, an instance: the config's
        ``speculative_config`` (if any) must name it as ``method="custom"``; without one,
        speculation is turned on with ``num_speculative_tokens`` the proposer's own (else
        4)."""
        return attrs.evolve(self, proposer=proposer)

    def with_offload_eviction_policy(self, policy: EvictionPolicy) -> EngineBuilder:
        """The KV offload tier's eviction policy (an instance or registered name; default:
        ``config.kv_offloading_eviction_policy``); the tier needs ``kv_offloading_size``."""
        return attrs.evolve(self, offload_eviction_policy=policy)

    def build(self) -> Engine:
        """The engine (loads the model; ``ValueError`` / ``TypeError`` for a bad setting or
        component, raised before any weights load: among them a component instance another
        engine was built with, since it keeps that engine's state)."""
        instances = self.instances()
        registry.check_unclaimed(instances)
        engine = Engine(**assemble(
            self.config, scheduling_policy=self.scheduling_policy,
            eviction_policy=self.eviction_policy, attention_backend=self.attention_backend,
            sampler=self.sampler, offload_eviction_policy=self.offload_eviction_policy,
            kv_press=self.kv_press, proposer=self.proposer,
            speculation_length=self.speculation_length, plugins=self.plugins,
        ))
        registry.claim(instances)
        return engine

    def instances(self) -> list[tuple[str, Any]]:
        """``(keyword, value)`` of every component the builder holds (names, classes and
        None among them: :func:`llmlab.registry.claim` claims only instances)."""
        return [("scheduling_policy", self.scheduling_policy),
                ("eviction_policy", self.eviction_policy),
                ("attention_backend", self.attention_backend), ("sampler", self.sampler),
                ("offload_eviction_policy", self.offload_eviction_policy),
                ("kv_press", self.kv_press), ("proposer", self.proposer),
                ("speculation_length", self.speculation_length),
                *(("plugins", p) for p in self.plugins)]

    def with_plugin(self, plugin: Any) -> EngineBuilder:
        """Plug a feature in (a :class:`~llmlab.plugin.SchedulerPlugin` or
        :class:`~llmlab.plugin.RunnerPlugin`, a registered name or ``"module:Class"``)."""
        return attrs.evolve(self, plugins=(*self.plugins, plugin))

    def plan(self) -> BuildPlan:
        """Everything decided before any weights load (see
        :func:`~llmlab.engine.assembly.plan_engine`); starts nothing."""
        return plan_engine(self.config, self.attention_backend, self.sampler, self.kv_press,
                           self.proposer, self.speculation_length)


def _refuse_config(kind: str, instance: Any, config: Any) -> None:
    """A ``<kind>_config`` with an instance is refused (as :func:`llmlab.registry.build`
    refuses it), before anything is built."""
    if registry.config_dict(kind, config):
        registry.build(kind, instance, config)


def _with_pooler(pooler: Any, pooler_config: Any) -> PoolerConfig | None:
    """``pooler=NAME`` is ``pooler_config.pooling_type`` (vLLM's ``pooler_config`` keeps its
    meaning: the pooling settings, not the pooler's keyword arguments). The runner builds
    the pooler by name on every rank, so an instance is refused: register its class."""
    if pooler is None:
        return PoolerConfig.of(pooler_config)
    if not isinstance(pooler, str):
        raise ValueError(
            f"pooler must be a registered name or 'package.module:Class', got "
            f"{type(pooler).__name__} {pooler!r}: the runner builds the pooler by name on "
            "every rank; register its class with llmlab.register('pooler', NAME)"
        )
    config = PoolerConfig.of(pooler_config) or PoolerConfig()
    pooler = PoolerConfig(pooling_type=pooler).pooling_type  # checked; built-ins any case
    if config.pooling_type is not None and config.pooling_type != pooler:
        raise ValueError(
            f"pooler={pooler!r} and pooler_config's pooling_type {config.pooling_type!r} "
            "name two poolers: name one"
        )
    return attrs.evolve(config, pooling_type=pooler)

"""Engine assembly: from a config and any components swapped in, the parts an
:class:`~llmlab.engine.engine.Engine` is made of.

:func:`assemble` is the one path every real engine takes (``EngineBuilder.build``,
``Engine.from_engine_args``, ``LLM``, the server, each data-parallel replica);
:func:`scheduler_for` and :func:`engine_fields` are shared with the simulator
(``llmlab.sim.engine``), which puts a cost model where the runner would be. Nothing here
imports the engine itself, so the engine may assemble itself from engine args.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import attrs

from llmlab import registry
from llmlab.attention.selection import auto_backend
from llmlab.cache.eviction import EvictionPolicy, LRUEviction
from llmlab.cache.kv_cache_manager import KVCacheManager
from llmlab.config import EngineConfig
from llmlab.kernels.cpu_linear import auto_packed_dtypes, onednn_unavailable_reason
from llmlab.kvpress.schedule import PressSchedule
from llmlab.lora.attach import check_lora_settings
from llmlab.lora.schedule import LoRASchedule
from llmlab.models.expert_load import expert_load_plugins
from llmlab.models.loader import max_model_len_from_config, resolve_dtype, resolve_model_path
from llmlab.models.registry import get_model_class
from llmlab.plugin import RunnerPlugin, SchedulerPlugin
from llmlab.quantization.loading import resolve_quantization
from llmlab.runner.build import (
    BuildPlan,
    build_rank,
    check_parallel_devices,
    check_tensor_parallel,
    resolve_device,
)
from llmlab.runner.host_kv import check_host_kv_settings, host_pools
from llmlab.runner.pooling_rows import PoolingSchedule
from llmlab.runner.pooling_setup import pooling_spec
from llmlab.sampling.params import SamplingParams
from llmlab.sampling.sampler import Sampler
from llmlab.scheduler.policies import FCFS
from llmlab.scheduler.policy import SchedulingPolicy, as_policy
from llmlab.scheduler.scheduler import Scheduler
from llmlab.speculative.config import SpeculativeConfig
from llmlab.speculative.schedule import SpeculationSchedule

logger = logging.getLogger(__name__)

# The keyword arguments LLM / AsyncEngine.from_settings accept besides the components.
CONFIG_FIELDS = tuple(f.name for f in attrs.fields(EngineConfig))


def assemble(
    config: EngineConfig,
    *,
    scheduling_policy: Any = None,
    eviction_policy: Any = None,
    attention_backend: Any = None,
    sampler: Any = None,
    offload_eviction_policy: Any = None,
    kv_press: Any = None,
    proposer: Any = None,
    speculation_length: Any = None,
    plugins: Sequence[Any] = (),
) -> dict[str, Any]:
    """The keyword arguments of the ``Engine`` that ``config`` and the components describe.

    Each component is the one given here (an instance, a registered name or
    ``"module:Class"``), else the one ``config`` names, built with the config's
    ``<kind>_config`` (:func:`llmlab.registry.build`); None in both: the default.
    ``proposer`` / ``speculation_length``: instances for ``config.speculative_config``
    (which then names them by class: ``method="custom"``). ``plugins``: feature plugins
    (:mod:`llmlab.plugin`) besides the config's ``plugins``: their scheduler sides join the
    scheduler's, their runner sides every rank's runner.

    Loads the model and allocates the KV cache (starting tensor-parallel workers where the
    config asks for them); raises ``ValueError`` / ``TypeError`` for a bad setting or
    component before any weights load.
    """
    cfg = config
    if cfg.data_parallel_size > 1:
        raise ValueError(
            f"data_parallel_size={cfg.data_parallel_size}: an EngineBuilder builds one "
            "engine; use LLM(..., data_parallel_size=N) or llmlab serve "
            "--data-parallel-size N, which start N replicas behind a router"
        )
    policy = configured(cfg, "scheduling_policy", scheduling_policy)
    eviction = configured(cfg, "eviction_policy", eviction_policy)
    # The second tier's own policy instance (never the device pool's).
    offload_eviction = component("eviction_policy", (
        cfg.kv_offloading_eviction_policy
        if offload_eviction_policy is None else offload_eviction_policy
    ))
    as_policy(policy or FCFS())  # rejects a policy missing a method, before loading
    named = cfg.plugin_config or {}
    extra = [plugin_of(p, named.get(p) if isinstance(p, str) else None)
             for p in (*cfg.plugins, *plugins)]
    plan = plan_engine(cfg, attention_backend, sampler, kv_press, proposer, speculation_length)
    extra.extend(expert_load_plugins(plan.config, plan.hf_config))  # record_expert_load
    plan = attrs.evolve(plan, plugins=tuple(p for p in extra if isinstance(p, RunnerPlugin)))
    rank_plan = _bind_speculation(plan, proposer, speculation_length)
    workers = None
    tp = None
    if plan.config.tensor_parallel_size > 1:
        from llmlab.distributed.tp_executor import start_workers

        # Raises (starting nothing) on a model the size does not divide.
        check_tensor_parallel(rank_plan)
        tp, workers = start_workers(rank_plan)
    try:
        rank = build_rank(rank_plan, tp)
    except BaseException:
        if workers is not None:
            workers.shutdown()
        raise
    cfg = plan.config
    scheduling: list[SchedulerPlugin] = []
    if plan.pooling is not None:
        scheduling.append(PoolingSchedule())
    if plan.press is not None:
        scheduling.append(PressSchedule(plan.press, len(rank.runner.kv_caches)))
    scheduling.extend(p for p in extra if isinstance(p, SchedulerPlugin))
    scheduler = scheduler_for(
        cfg, rank.num_blocks, plan.max_model_len, policy, eviction,
        **host_pools(rank.runner.host_kv, offload_eviction), plugins=scheduling,
        speculation=rank.length,
    )
    executor = rank.runner
    if workers is not None:
        from llmlab.distributed.tp_executor import TensorParallelExecutor

        executor = TensorParallelExecutor(rank.runner, workers)
    return engine_fields(
        cfg, scheduler, executor, rank.length,
        tokenizer=rank.tokenizer,
        vocab_size=plan.hf_config.vocab_size,
        max_model_len=plan.max_model_len,
        eos_token_ids=rank.eos_token_ids,
        default_sampling_params=default_sampling_params(plan.model_path),
        grammars=rank.grammars,
        pooling=plan.pooling,
        lora=None if rank.lora is None else rank.lora.store,
    )


def _bind_speculation(plan: BuildPlan, proposer: Any, length: Any) -> BuildPlan:
    """The plan the ranks build from: the builder's proposer and speculation-length
    instances bound into the speculative config they read (the engine's own config keeps
    names only)."""
    spec = plan.config.speculative_config
    if spec is None or (proposer is None and length is None):
        return plan
    bound = attrs.evolve(plan.config, speculative_config=spec.bound(proposer, length))
    return attrs.evolve(plan, config=bound)


def plugin_of(value: Any, config: Any = None) -> SchedulerPlugin | RunnerPlugin:
    """A feature plugin from an instance, a registered name, ``"module:Class"`` or a class
    (``config``: its keyword arguments); ``TypeError`` for anything that is neither side of
    a plugin."""
    plugin = registry.build("plugin", value, config)
    if not isinstance(plugin, (SchedulerPlugin, RunnerPlugin)):
        raise TypeError(
            f"plugin {value!r} must be a llmlab.plugin.SchedulerPlugin or RunnerPlugin "
            f"instance, a registered plugin name or 'module:Class'; got "
            f"{type(plugin).__name__}"
        )
    return plugin


def engine_fields(cfg: EngineConfig, scheduler: Scheduler, executor: Any, length: Any,
                  **fields: Any) -> dict[str, Any]:
    """The ``Engine`` keyword arguments for a scheduler and an executor (the real runner's
    or the simulator's); the speculative length policy ``length`` (or None), when it
    learns from step events, is subscribed to them."""
    observers = []
    if callable(getattr(length, "observe", None)):
        observers.append(length.observe)  # an adaptive length learns from step events
    return dict(config=cfg, scheduler=scheduler, executor=executor,
                max_logprobs=cfg.max_logprobs, observers=observers, **fields)


def plan_engine(cfg: EngineConfig, attention_backend: Any = None, sampler: Any = None,
                kv_press: Any = None, proposer: Any = None, speculation_length: Any = None
                ) -> BuildPlan:
    """Everything decided before any weights load: the resolved config, the model
    directory and config, the dtype, the components (given here, else named by ``cfg``).
    Raises ``ValueError`` / ``TypeError`` for a bad setting or component; starts
    nothing."""
    attention_backend = cfg.attention_backend if attention_backend is None else attention_backend
    auto_attention = attention_backend in (None, "auto")
    attention = None
    if not auto_attention:
        attention = configured(cfg, "attention_backend", attention_backend)
    elif cfg.attention_backend_config:
        raise ValueError(
            f"attention_backend_config {cfg.attention_backend_config!r} needs a named "
            "attention_backend ('torch', 'cpu', 'triton', ...), not 'auto'"
        )
    sampler = configured(cfg, "sampler", sampler) or Sampler()
    cfg = check_speculation(cfg, proposer, speculation_length)
    check_host_kv_settings(cfg)
    device = resolve_device(cfg.device)
    check = getattr(attention, "check_device", None)
    if check is not None:  # e.g. triton asked for where it cannot run: fail before loading
        check(device)
    check_parallel_devices(cfg, device)
    model_path = resolve_model_path(cfg.model, cfg.revision, cache_dir=cfg.download_dir)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_path)
    # Reject an unsupported architecture, or a model class that breaks the model
    # contract, before loading any weights.
    registry.check("model", get_model_class(getattr(hf_config, "architectures", None)))
    pooling = pooling_spec(cfg, hf_config, str(model_path))  # None: it generates
    check_lora_settings(
        cfg, pooling=pooling is not None,
        model_class=get_model_class(getattr(hf_config, "architectures", None)),
    )
    if cfg.enable_expert_parallel and not hasattr(
        get_model_class(getattr(hf_config, "architectures", None)), "moe_from_config"
    ):
        raise ValueError(
            f"enable_expert_parallel=True places a mixture-of-experts model's experts on "
            f"the ranks; {model_path / 'config.json'} names a dense model "
            f"({getattr(hf_config, 'architectures', None)}); use False"
        )
    max_model_len = _max_model_len(cfg, hf_config)
    cfg = resolve_step_settings(cfg, device.type, max_model_len)
    dtype = resolve_dtype(cfg.dtype, hf_config, device)
    # The scheme (argument vs the checkpoint's) and its device, checked before loading.
    quantization = resolve_quantization(cfg.quantization, hf_config, device)
    if auto_attention:
        attention = auto_backend(device, dtype)
    check = getattr(attention, "check_dtype", None)
    if check is not None:  # e.g. the CPU kernels asked for float16: fail before loading
        check(dtype)
    press = check_press_settings(cfg, attention, pooling is not None, kv_press)

    prepack = False
    if device.type == "cpu" and cfg.cpu_linear != "plain":
        reason = onednn_unavailable_reason()
        if cfg.cpu_linear == "onednn" and reason is not None:
            raise ValueError(f"cpu_linear='onednn' cannot run: {reason}; use 'plain'")
        # "auto" packs float32 (1.2-1.4x measured) and bfloat16 where oneDNN has native
        # bf16 kernels (1.1x once attention stopped dominating; BENCHMARKS.md, issue 12).
        prepack = reason is None and (
            cfg.cpu_linear == "onednn" or dtype in auto_packed_dtypes()
        )
    return BuildPlan(
        config=cfg, model_path=str(model_path), hf_config=hf_config,
        max_model_len=max_model_len, dtype=dtype, device=device, prepack=prepack,
        attention=attention, sampler=sampler, pooling=pooling, quantization=quantization,
        press=press,
    )


def check_speculation(cfg: EngineConfig, proposer: Any = None, length: Any = None
                      ) -> EngineConfig:
    """``cfg`` with a speculative config for a proposer instance given without one; checks
    that a config naming an instance (``method="custom"``) has it, and that a named
    proposer resolves and takes its keyword arguments (building nothing)."""
    spec = cfg.speculative_config
    if spec is None and proposer is not None:
        spec = SpeculativeConfig.split(None, proposer)[0]
        cfg = attrs.evolve(cfg, speculative_config=spec)
    if spec is None:
        if length is not None:
            raise ValueError("a speculation_length instance needs speculative decoding on: "
                             "give speculative_config or proposer")
        return cfg
    if spec.proposer is not None and proposer is None:
        raise ValueError(
            f"speculative_config names a {spec.proposer} proposer instance, which the "
            "engine builder must hold: pass it as EngineBuilder(..., proposer=...)"
        )
    spec.bound(proposer, length)  # refuses two drafters
    spec.check_proposer()
    return cfg


def check_press_settings(cfg: EngineConfig, attention: Any, pooling: bool,
                         given: Any = None) -> Any:
    """The engine's KV press (``given``, else ``kv_press``, with ``kv_press_config``), or
    None; ``ValueError`` naming a setting it cannot run with, before any weights load."""
    press = configured(cfg, "kv_press", given)
    if press is None:
        return None
    unsupported = {
        "speculative_config": cfg.speculative_config is not None,
        "runner='pooling'": pooling,
        "tensor_parallel_size": cfg.tensor_parallel_size > 1,
    }
    named = [name for name, on in unsupported.items() if on]
    if named:
        raise ValueError(
            f"kv_press={cfg.kv_press or type(press).__name__!r} cannot run with "
            f"{', '.join(named)}: compacting a request's KV is not combined with "
            "speculative decoding, pooling or tensor-parallel ranks yet"
        )
    missing = [m for m in ("gather_slots", "scatter_slots") if not hasattr(attention, m)]
    if missing:
        raise ValueError(
            f"kv_press needs an attention backend that reads and writes single KV slots; "
            f"{getattr(attention, 'name', type(attention).__name__)!r} has no "
            f"{' / '.join(missing)} (the torch, cpu and triton backends do)"
        )
    return press


def resolve_step_settings(cfg: EngineConfig, device_type: str, max_model_len: int) -> EngineConfig:
    """The config with the defaults that depend on the device filled in (the token budget,
    the seed), checked: the real engine's and the simulator's are the same."""
    if cfg.max_num_batched_tokens is None:
        default_budget = 8192 if device_type == "cuda" else 2048
        if cfg.enable_chunked_prefill is False:
            # Unchunked prefill must fit the longest prompt in one step.
            default_budget = max(default_budget, max_model_len)
        cfg = attrs.evolve(cfg, max_num_batched_tokens=default_budget)
    if cfg.seed is None:
        # vLLM's seed=None: not reproducible, so draw one (and keep it in the config,
        # where a user can read it back to replay the run).
        cfg = attrs.evolve(cfg, seed=int.from_bytes(os.urandom(8), "little") >> 1)
    if cfg.enable_chunked_prefill is False and cfg.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"enable_chunked_prefill=False needs max_num_batched_tokens "
            f"({cfg.max_num_batched_tokens}) >= max_model_len ({max_model_len}), so that "
            "every prompt fits one step"
        )
    return cfg


def scheduler_for(
    cfg: EngineConfig,
    num_blocks: int,
    max_model_len: int,
    policy: SchedulingPolicy | None,
    eviction: EvictionPolicy | None,
    swap: Any = None,
    tier: Any = None,
    plugins: Sequence[SchedulerPlugin] = (),
    speculation: Any = None,
) -> Scheduler:
    """The KV cache manager and scheduler an engine of ``cfg`` runs (real or simulated);
    ``swap`` / ``tier``: its host pools' bookkeeping (``llmlab.cache.host_pools``);
    ``plugins``: features' scheduler sides (LoRA's, from the config, and speculation's,
    from the length policy ``speculation``, are added here)."""
    if policy is None:  # the config's (the simulator passes only what it was given)
        policy = configured(cfg, "scheduling_policy")
    if eviction is None:
        eviction = configured(cfg, "eviction_policy")
    if cfg.enable_lora:
        plugins = (LoRASchedule(cfg.max_loras), *plugins)
    if speculation is not None:
        plugins = (*plugins, SpeculationSchedule(speculation))
    kv = KVCacheManager(
        num_blocks=num_blocks,
        block_size=cfg.block_size,
        enable_prefix_caching=cfg.enable_prefix_caching,
        eviction=eviction or LRUEviction(),
        swap=swap,
        tier=tier,
    )
    return Scheduler(
        kv=kv,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=policy or FCFS(),
        chunked_prefill=cfg.enable_chunked_prefill is not False,
        plugins=tuple(plugins),
        preemption_mode=cfg.preemption_mode or "recompute",
    )


def component(kind: str, value: Any, config: Any = None) -> Any:
    """An instance as given, or a fresh instance of the component ``value`` names (a
    registered name, ``"module:Class"`` or a class, with ``config`` as its keyword
    arguments): :func:`llmlab.registry.build`, whose errors name the kind and the value
    (an unknown name lists the available ones; a method that cannot take the engine's
    call names the signature expected: ``registry.CONTRACTS``).
    """
    return registry.build(kind, value, config)


def configured(cfg: EngineConfig, kind: str, given: Any = None) -> Any:
    """The ``kind`` component an engine of ``cfg`` runs: ``given`` (the builder's instance
    or name) in place of the name ``cfg`` holds, built with ``cfg``'s ``<kind>_config``;
    None when neither names one (the caller's default)."""
    value = getattr(cfg, kind) if given is None else given
    return component(kind, value, getattr(cfg, f"{kind}_config"))


def _max_model_len(cfg: EngineConfig, hf_config) -> int:
    limit = max_model_len_from_config(hf_config)
    if cfg.max_model_len is None:
        return limit
    if cfg.max_model_len > limit:
        raise ValueError(
            f"max_model_len={cfg.max_model_len} exceeds the model's limit of {limit} positions"
        )
    return cfg.max_model_len


def default_sampling_params(model_path) -> SamplingParams:
    """The checkpoint's recommended sampling settings (``generation_config.json``), as vLLM
    uses them when no ``SamplingParams`` is given: temperature, top_p, top_k, min_p,
    repetition_penalty and ``max_new_tokens`` (as ``max_tokens``); anything absent keeps
    the vLLM default."""
    path = pathlib.Path(model_path) / "generation_config.json"
    if not path.is_file():
        return SamplingParams()
    try:
        gen = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        logger.warning("ignoring unreadable %s: %s", path, err)
        return SamplingParams()
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "min_p": "min_p", "repetition_penalty": "repetition_penalty",
             "max_new_tokens": "max_tokens"}
    settings = {ours: gen[theirs] for theirs, ours in names.items() if gen.get(theirs) is not None}
    try:
        return SamplingParams(**settings)
    except (TypeError, ValueError) as err:
        logger.warning("ignoring generation_config.json sampling defaults %s: %s", settings, err)
        return SamplingParams()


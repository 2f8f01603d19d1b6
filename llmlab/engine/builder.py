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
a required method is rejected here, naming the method, before any weights load.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Any

import attrs
import torch

from llmlab import registry
from llmlab.attention.backend import AttentionBackend, block_table_tensor
from llmlab.attention.selection import auto_backend
from llmlab.cache.eviction import EvictionPolicy, LRUEviction
from llmlab.cache.kv_cache_manager import KVCacheManager
from llmlab.cache.kv_tensors import allocate_kv_caches, num_blocks_for
from llmlab.config import EngineConfig
from llmlab.engine.cuda_graphs import DecodeGraphs
from llmlab.engine.engine import Engine
from llmlab.engine.host_kv import attach_host_kv, check_host_kv_settings, host_pools
from llmlab.engine.model_runner import ModelRunner
from llmlab.engine.pooling_rows import PoolingRows
from llmlab.engine.pooling_setup import pooling_spec
from llmlab.kernels import cpu_kernels
from llmlab.kernels.cpu_linear import (
    auto_packed_dtypes,
    onednn_unavailable_reason,
    prepack_linears,
)
from llmlab.kvpress.runner import PressRunner
from llmlab.kvpress.schedule import PressSchedule
from llmlab.lora.attach import attach_lora, check_lora_settings
from llmlab.models.loader import (
    load_model,
    load_tokenizer,
    max_model_len_from_config,
    resolve_dtype,
    resolve_model_path,
)
from llmlab.models.registry import get_model_class
from llmlab.pooling.task import PoolingSpec
from llmlab.quantization.loading import QuantizationSpec, resolve_quantization
from llmlab.sampling.metadata import GrammarFactory
from llmlab.sampling.params import SamplingParams
from llmlab.sampling.sampler import Sampler
from llmlab.scheduler.batch import ScheduledBatch, ScheduledRequest
from llmlab.scheduler.policies import FCFS
from llmlab.scheduler.policy import SchedulingPolicy, as_policy
from llmlab.scheduler.scheduler import Scheduler
from llmlab.speculative.proposer import ProposerContext
from llmlab.speculative.speculator import Speculator
from llmlab.threads import configure_threads

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but CUDA is not available")
    return resolved


# The keyword arguments LLM / AsyncEngine.from_settings accept besides the components.
CONFIG_FIELDS = tuple(f.name for f in attrs.fields(EngineConfig))


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
                "scheduling_policy, eviction_policy, attention_backend, sampler"
            )
        return cls(
            EngineConfig(model=model, tokenizer=tokenizer, **settings),
            scheduling_policy=scheduling_policy,
            eviction_policy=eviction_policy,
            attention_backend=attention_backend,
            sampler=sampler,
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
        cfg = self.config
        if cfg.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={cfg.data_parallel_size}: an EngineBuilder builds one "
                "engine; use LLM(..., data_parallel_size=N) or llmlab serve "
                "--data-parallel-size N, which start N replicas behind a router"
            )
        policy = _component("scheduling_policy", self.scheduling_policy)
        eviction = _component("eviction_policy", self.eviction_policy)
        # The second tier's own policy instance (never the device pool's).
        offload_eviction = _component("eviction_policy", (
            self.config.kv_offloading_eviction_policy
            if self.offload_eviction_policy is None else self.offload_eviction_policy
        ))
        as_policy(policy or FCFS())  # rejects a policy missing a method, before loading
        plan = self.plan()
        workers = None
        tp = None
        if plan.config.tensor_parallel_size > 1:
            from llmlab.distributed.tp_executor import start_workers

            # Raises (starting nothing) on a model the size does not divide.
            check_tensor_parallel(plan)
            tp, workers = start_workers(plan)
        try:
            rank = build_rank(plan, tp)
        except BaseException:
            if workers is not None:
                workers.shutdown()
            raise
        cfg = plan.config
        scheduler = build_scheduler(
            cfg, rank.num_blocks, plan.max_model_len, policy, eviction,
            **host_pools(rank.runner.host_kv, offload_eviction),
        )
        scheduler.speculation = rank.length
        if rank.runner.press is not None:
            scheduler.press = PressSchedule(plan.press, len(rank.runner.kv_caches))
        executor = rank.runner
        if workers is not None:
            from llmlab.distributed.tp_executor import TensorParallelExecutor

            executor = TensorParallelExecutor(rank.runner, workers)
        engine = Engine(
            config=cfg,
            scheduler=scheduler,
            executor=executor,
            tokenizer=rank.tokenizer,
            vocab_size=plan.hf_config.vocab_size,
            max_model_len=plan.max_model_len,
            eos_token_ids=rank.eos_token_ids,
            default_sampling_params=default_sampling_params(plan.model_path),
            max_logprobs=cfg.max_logprobs,
            grammars=rank.grammars,
            pooling=plan.pooling,
            lora=None if rank.lora is None else rank.lora.store,
        )
        if callable(getattr(rank.length, "observe", None)):
            engine.subscribe(rank.length.observe)  # an adaptive length learns from step events
        return engine

    def plan(self) -> BuildPlan:
        """Everything decided before any weights load: the resolved config, the model
        directory and config, the dtype, the components. Raises ``ValueError`` /
        ``TypeError`` for a bad setting or component; starts nothing."""
        cfg = self.config
        auto_attention = self.attention_backend in (None, "auto")
        attention = None
        if not auto_attention:
            attention = _component("attention_backend", self.attention_backend)
        sampler = _component("sampler", self.sampler) or Sampler()
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
        press = check_press_settings(cfg, attention, pooling is not None)

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


def check_press_settings(cfg: EngineConfig, attention: Any, pooling: bool) -> Any:
    """The engine's KV press (resolved from ``kv_press`` / ``kv_press_config``), or None;
    ``ValueError`` naming a setting it cannot run with, before any weights load."""
    if cfg.kv_press is None:
        if cfg.kv_press_config:
            raise ValueError("kv_press_config is set but kv_press is None: name a press")
        return None
    from llmlab.kvpress import resolve_press

    press = resolve_press(cfg.kv_press, cfg.kv_press_config)
    registry.check("kv_press", press)
    unsupported = {
        "speculative_config": cfg.speculative_config is not None,
        "runner='pooling'": pooling,
        "tensor_parallel_size": cfg.tensor_parallel_size > 1,
    }
    named = [name for name, on in unsupported.items() if on]
    if named:
        raise ValueError(
            f"kv_press={cfg.kv_press!r} cannot run with {', '.join(named)}: compacting a "
            "request's KV is not combined with speculative decoding, pooling or "
            "tensor-parallel ranks yet"
        )
    missing = [m for m in ("gather_slots", "scatter_slots") if not hasattr(attention, m)]
    if missing:
        raise ValueError(
            f"kv_press needs an attention backend that reads and writes single KV slots; "
            f"{getattr(attention, 'name', type(attention).__name__)!r} has no "
            f"{' / '.join(missing)} (the torch, cpu and triton backends do)"
        )
    return press


@attrs.frozen
class BuildPlan:
    """What :meth:`EngineBuilder.plan` decided: picklable, so that every tensor-parallel
    rank builds its part of the engine (:func:`build_rank`) from the same decisions."""

    config: EngineConfig
    model_path: str
    hf_config: Any
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    prepack: bool
    attention: AttentionBackend
    sampler: Sampler
    pooling: PoolingSpec | None = None  # runner="pooling": its tasks, pooler, defaults
    quantization: QuantizationSpec | None = None  # weight-only scheme of the linears
    press: Any = None  # the KV press (llmlab.kvpress), or None


@attrs.define
class RankParts:
    """One rank's part of an engine: its model runner and what the engine needs of it."""

    runner: ModelRunner
    num_blocks: int
    tokenizer: Any
    grammars: GrammarFactory | None
    eos_token_ids: frozenset[int]
    length: Any = None  # the speculative length policy (the scheduler's), or None
    lora: Any = None  # enable_lora: the runner's LoRASlots (its store goes to the engine)


def check_parallel_devices(cfg: EngineConfig, device: torch.device) -> None:
    """Refuse a tensor-parallel setting the devices cannot serve (``ValueError`` naming it)."""
    tp = cfg.tensor_parallel_size
    backend = cfg.collective_backend
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"collective_backend='nccl' needs CUDA devices, but device is {device.type!r}; "
            "use 'gloo' (or 'auto') on CPU"
        )
    # With Ray, the ranks' GPUs may be on other nodes: Ray's placement decides.
    if tp > 1 and device.type == "cuda" and cfg.distributed_executor_backend != "ray":
        count = torch.cuda.device_count()
        if tp > count:
            raise ValueError(
                f"tensor_parallel_size={tp} needs {tp} CUDA devices, but {count} "
                f"{'is' if count == 1 else 'are'} visible"
            )
        if device.index not in (None, 0):
            raise ValueError(
                f"tensor_parallel_size={tp} places rank r on cuda:r; device={cfg.device!r} "
                "must be 'cuda' or 'auto' (choose the GPUs with CUDA_VISIBLE_DEVICES)"
            )


def check_tensor_parallel(plan: BuildPlan) -> None:
    """Build rank 0's model on the meta device: a head count or width the tensor-parallel
    size does not divide raises ``ValueError`` here, before any process starts."""
    from llmlab.distributed.parallel_state import TensorParallel
    from llmlab.models.loader import build_model_class

    cls = get_model_class(getattr(plan.hf_config, "architectures", None))
    with torch.device("meta"):
        build_model_class(
            cls, plan.hf_config, TensorParallel(0, plan.config.tensor_parallel_size)
        )


def rank_threads(cfg: EngineConfig) -> int | None:
    """Threads for one rank: ``cpu_threads`` as given; else, with several ranks on one
    machine's cores, an equal share of them (None: the automatic single-process choice)."""
    if cfg.cpu_threads is not None or cfg.tensor_parallel_size == 1:
        return cfg.cpu_threads
    from llmlab.threads import available_cpus

    return max(1, available_cpus() // cfg.tensor_parallel_size)


def build_rank(plan: BuildPlan, tp=None) -> RankParts:
    """Load this rank's model (its shard, under tensor parallelism), size and allocate its
    KV cache (the smallest of every rank's, so one scheduler serves all), and build its
    model runner. Rank 0 and every worker run exactly this."""
    cfg, device, dtype = plan.config, plan.device, plan.dtype
    hf_config, model_path, max_model_len = plan.hf_config, plan.model_path, plan.max_model_len
    attention, sampler = plan.attention, plan.sampler
    threads = configure_threads(rank_threads(cfg))

    def for_device(model: torch.nn.Module, pack: bool = True) -> torch.nn.Module:
        """The CPU treatment every model of this engine gets (a draft model too;
        ``pack=False`` keeps plain linears)."""
        if plan.prepack and pack:
            prepack_linears(model)
        if (
            device.type == "cpu" and cfg.cpu_fused_ops and hasattr(model, "fused_ops")
            and cpu_kernels.load() is not None
        ):
            model.fused_ops = True
        return model

    # Quantized linears (each rank its own shard) before prepacking, which packs the rest.
    load = load_model if plan.quantization is None else plan.quantization.load_model
    model = for_device(load(model_path, hf_config, dtype, device, tp=tp))
    lora = None
    if cfg.enable_lora:  # wraps whatever linears loading, quantization, packing left
        lora = attach_lora(
            model, max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
            max_cpu_loras=cfg.max_cpu_loras, max_num_seqs=cfg.max_num_seqs, dtype=dtype,
            device=device, base_model_names=(cfg.model, str(model_path)),
        )
    tokenizer = None
    if not cfg.skip_tokenizer_init:
        tokenizer = load_tokenizer(
            cfg.tokenizer or str(model_path),
            cfg.tokenizer_revision or cfg.revision,
            use_fast=cfg.tokenizer_mode != "slow",
            cache_dir=cfg.download_dir,
        )
    layout = model.kv_layout
    if getattr(sampler, "tokenizer", False) is None:
        sampler.tokenizer = tokenizer  # bad_words are tokenized with it
    generator = torch.Generator(device=device)
    generator.manual_seed(cfg.seed)
    eos_token_ids = _eos_token_ids(tokenizer, hf_config, model_path)
    # One grammar compiler (and compile cache) for input checks and the runner's rows.
    grammars = None
    if tokenizer is not None:
        grammars = GrammarFactory(tokenizer, hf_config.vocab_size, eos_token_ids)

    def runner_for(kv_caches: list[torch.Tensor], num_blocks: int) -> ModelRunner:
        return ModelRunner(
            model=model,
            attention=attention,
            sampler=sampler,
            kv_caches=kv_caches,
            block_size=cfg.block_size,
            device=device,
            generator=generator,
            num_kv_blocks=num_blocks,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_model_len,
            grammars=grammars,
        )

    num_blocks = num_blocks_for(
        layout=layout,
        block_size=cfg.block_size,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        num_gpu_blocks_override=cfg.num_gpu_blocks_override,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        profile_peak_bytes=lambda: _profile_peak_bytes(
            runner_for, attention, layout, cfg, max_model_len, dtype, device
        ),
    )
    if tp is not None and tp.is_parallel:
        # Each rank sized its own cache; one scheduler hands out blocks for all of them.
        agreed = torch.tensor([num_blocks], dtype=torch.int64, device=device)
        num_blocks = int(tp.all_reduce_min(agreed).item())
    logger.info("KV cache: %d blocks of %d tokens", num_blocks, cfg.block_size)
    kv_caches = allocate_kv_caches(attention, layout, num_blocks, cfg.block_size, dtype, device)
    runner = runner_for(kv_caches, num_blocks)
    runner.threads = threads
    attach_host_kv(runner, cfg, attention, layout, dtype, device, tp)  # swap / offload tier
    runner.lora = lora
    if plan.pooling is not None:
        runner.pooling = PoolingRows(
            registry.create("pooler", plan.pooling.pooling_type),
            getattr(model, "classify", None),
            plan.pooling.hidden_size,
        )
    if plan.press is not None:
        windows = [m.sliding_window for m in model.modules()
                   if getattr(m, "sliding_window", None) is not None]
        if windows:
            raise ValueError(
                f"kv_press cannot run on a model with sliding-window attention (window "
                f"{windows[0]}): the window counts cache slots, which a press no longer "
                "keeps one per position"
            )
        runner.press = PressRunner(plan.press, attention, len(kv_caches), cfg.block_size)
    length = None
    if cfg.speculative_config is not None:
        length = _speculate(
            cfg.speculative_config, runner, attention, hf_config.vocab_size,
            dtype, tokenizer, max_model_len, for_device, cfg.seed,
        )
    # CUDA graphs capture one device's kernels; a decode step of a tensor-parallel group
    # runs collectives between them, so those run eagerly.
    if (
        device.type == "cuda" and not cfg.enforce_eager and DecodeGraphs.applies_to(attention)
        and (tp is None or not tp.is_parallel)
    ):
        runner.decode_graphs = DecodeGraphs(
            model=model,
            backend=attention,
            kv_caches=kv_caches,
            device=device,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_model_len,
            block_size=cfg.block_size,
        )
    return RankParts(runner, num_blocks, tokenizer, grammars, eos_token_ids, length, lora)


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


def build_scheduler(
    cfg: EngineConfig,
    num_blocks: int,
    max_model_len: int,
    policy: SchedulingPolicy | None,
    eviction: EvictionPolicy | None,
    swap: Any = None,
    tier: Any = None,
) -> Scheduler:
    """The KV cache manager and scheduler an engine of ``cfg`` runs (real or simulated);
    ``swap`` / ``tier``: its host pools' bookkeeping (``llmlab.cache.host_pools``)."""
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
        max_loras=cfg.max_loras if cfg.enable_lora else None,
        preemption_mode=cfg.preemption_mode or "recompute",
    )


def _speculate(spec, runner, attention, vocab_size, dtype, tokenizer,
               max_model_len, for_device, seed):
    """Wire speculative decoding: the proposer (bound to this engine) into the runner;
    returns the length policy, which the scheduler takes."""
    proposer = spec.build_proposer()
    bind = getattr(proposer, "bind", None)
    if bind is not None:
        bind(ProposerContext(
            vocab_size=vocab_size, device=runner.device, dtype=dtype,
            block_size=runner.block_size, num_kv_blocks=runner.num_kv_blocks,
            max_num_seqs=runner.max_num_seqs, max_model_len=max_model_len,
            attention=attention, tokenizer=tokenizer,
            prepare=lambda entries: runner.prepare(ScheduledBatch(entries=tuple(entries))),
            for_device=for_device, seed=seed,
        ))
    if not callable(getattr(runner.sampler, "process", None)):
        raise ValueError(
            f"speculative decoding verifies drafts with the sampler's process(logits, "
            f"metadata); the sampler {type(runner.sampler).__name__} has none"
        )
    runner.speculator = Speculator(proposer, vocab_size, runner.max_num_seqs)
    return spec.length_policy()


def _component(kind: str, value):
    """An instance as given, or a fresh instance of the component registered as ``value``.

    Raises ``ValueError`` for an unknown name (listing the available ones) and
    ``TypeError`` for an object missing a required method or whose method cannot take the
    engine's call (naming it and the expected signature: ``registry.CONTRACTS``).
    """
    if value is None:
        return None
    if isinstance(value, str):
        value = registry.create(kind, value)
    elif isinstance(value, type):
        raise TypeError(f"{kind} must be an instance, got the class {value.__name__}")
    if kind != "scheduling_policy":  # as_policy checks its two forms
        registry.check(kind, value)
    return value


def _max_model_len(cfg: EngineConfig, hf_config) -> int:
    limit = max_model_len_from_config(hf_config)
    if cfg.max_model_len is None:
        return limit
    if cfg.max_model_len > limit:
        raise ValueError(
            f"max_model_len={cfg.max_model_len} exceeds the model's limit of {limit} positions"
        )
    return cfg.max_model_len


def _eos_token_ids(tokenizer, hf_config, model_path) -> frozenset[int]:
    """The tokenizer's EOS plus every id the model's generation config calls EOS."""
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    sources = [getattr(hf_config, "eos_token_id", None)]
    try:
        from transformers import GenerationConfig

        sources.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except OSError:  # no generation_config.json: the config and tokenizer are all we have
        pass
    for eos in sources:
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


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


def _profile_peak_bytes(runner_for, attention, layout, cfg, max_model_len, dtype, device) -> int:
    """Peak torch memory of a forward pass at the largest batch the scheduler may form.

    The batch is split into sequences of at most ``max_model_len`` tokens so positions
    stay in range; it runs through the model runner's own ``run_model`` (same tensors,
    same slot mapping) on temporary KV blocks, which are subtracted from the peak.
    """
    num_tokens = cfg.max_num_batched_tokens
    bs = cfg.block_size
    lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lens.append(num_tokens % max_model_len)
    entries, tables, next_block = [], [], 0
    for row, n in enumerate(lens):
        blocks = tuple(range(next_block, next_block + -(-n // bs)))
        next_block += len(blocks)
        tables.append(blocks)
        entries.append(ScheduledRequest(f"profile-{row}", row, 0, (0,) * n, 0, blocks, 1))
    caches = allocate_kv_caches(attention, layout, next_block, bs, dtype, device)
    cache_bytes = sum(c.numel() * c.element_size() for c in caches)
    runner = runner_for([], 0)
    with torch.inference_mode():
        hidden = runner.run_model(
            ScheduledBatch(tuple(entries)), caches, block_tables=block_table_tensor(tables).numpy()
        )
        runner.model.compute_logits(hidden[: min(cfg.max_num_seqs, num_tokens)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del caches, hidden
    torch.cuda.empty_cache()
    return peak - cache_bytes

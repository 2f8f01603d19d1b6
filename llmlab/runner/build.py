"""One rank's part of an engine: load its model (its shard, under tensor parallelism), size
and allocate its KV cache, build its model runner and the runner's per-feature parts.

:class:`BuildPlan` is what the engine assembly (``llmlab.engine.assembly``) decided before
any weights load; it is picklable, so rank 0 and every tensor-parallel worker run the same
:func:`build_rank` on it.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import torch

from llmlab import registry
from llmlab.attention.backend import AttentionBackend, block_table_tensor
from llmlab.cache.kv_tensors import allocate_kv_caches, num_blocks_for
from llmlab.config import EngineConfig
from llmlab.kernels import cpu_kernels
from llmlab.kernels.cpu_linear import prepack_linears
from llmlab.kvpress.runner import PressRunner
from llmlab.lora.attach import attach_lora
from llmlab.models.loader import load_model, load_tokenizer
from llmlab.models.registry import get_model_class
from llmlab.pooling.task import PoolingSpec
from llmlab.quantization.loading import QuantizationSpec
from llmlab.runner.cuda_graphs import DecodeGraphs
from llmlab.runner.host_kv import host_kv_for
from llmlab.runner.model_runner import ModelRunner
from llmlab.plugin import RunnerPlugin
from llmlab.runner.pooling_rows import PoolingRows
from llmlab.sampling.metadata import GrammarFactory
from llmlab.sampling.sampler import Sampler
from llmlab.scheduler.batch import ScheduledBatch, ScheduledRequest
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
    plugins: tuple[RunnerPlugin, ...] = ()  # feature plugins' runner sides given by the user


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
        build_model_class(cls, plan.hf_config, TensorParallel(
            0, plan.config.tensor_parallel_size,
            expert_parallel=plan.config.enable_expert_parallel,
        ))


def cuda_fused_ops_pass(model: torch.nn.Module, dtype: torch.dtype,
                        device: torch.device) -> bool:
    """Whether ``model`` may run its fused path on ``device`` with the Triton kernels: they
    take ``dtype`` and pass :func:`llmlab.kernels.triton_fused.self_check` at the model's
    sizes (a failure is logged: the torch ops run instead)."""
    try:
        from llmlab.kernels import triton_fused
    except ImportError:  # no triton for this platform
        return False
    if dtype not in triton_fused.DTYPES:
        return False
    reason = triton_fused.self_check(device, dtype, **model.fused_sizes())
    if reason is not None:
        logger.warning("cuda_fused_ops: the Triton fused ops failed their check at this "
                       "model's sizes, so the torch ops run instead: %s", reason)
    return reason is None


def rank_threads(cfg: EngineConfig) -> int | None:
    """Threads for one rank: ``cpu_threads`` as given; else, with several ranks on one
    machine's cores, an equal share of them (None: the automatic single-process choice)."""
    if cfg.cpu_threads is not None or cfg.tensor_parallel_size == 1:
        return cfg.cpu_threads
    from llmlab.threads import available_cpus

    return max(1, available_cpus() // cfg.tensor_parallel_size)


def captures_decode(device: torch.device, enforce_eager: bool, attention: Any, tp: Any,
                    model: Any) -> bool:
    """Whether decode steps replay CUDA graphs. A graph captures one device's kernels: a
    decode step of a tensor-parallel group runs collectives between them, so it runs
    eagerly, as does a model whose kernels depend on its data (``cuda_graphs = False``:
    mixture-of-experts routing, read on the host each step)."""
    return (device.type == "cuda" and not enforce_eager and DecodeGraphs.applies_to(attention)
            and (tp is None or not tp.is_parallel) and getattr(model, "cuda_graphs", True))


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
        if device.type == "cuda" and cfg.cuda_fused_ops and hasattr(model, "fused_sizes"):
            model.fused_ops = cuda_fused_ops_pass(model, dtype, device)
        if device.type == "cuda" and hasattr(model, "stack_experts"):
            model.stack_experts()  # MoE: experts into stacked weights for the fused kernel
        return model

    # Quantized linears (each rank its own shard) before prepacking, which packs the rest.
    load = load_model if plan.quantization is None else plan.quantization.load_model
    if tp is not None and cfg.enable_expert_parallel:
        tp = attrs.evolve(tp, expert_parallel=True)
    model = for_device(load(model_path, hf_config, dtype, device, tp=tp,
                            load_format=cfg.load_format))
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

    def runner_for(kv_caches: list[torch.Tensor], num_blocks: int, **parts: Any) -> ModelRunner:
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
            **parts,
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
    plugins: list[RunnerPlugin] = []
    if lora is not None:
        plugins.append(lora)
    if plan.pooling is not None:
        plugins.append(PoolingRows(
            registry.create("pooler", plan.pooling.pooling_type),
            getattr(model, "classify", None),
            plan.pooling.hidden_size,
        ))
    if plan.press is not None:
        windows = [m.sliding_window for m in model.modules()
                   if getattr(m, "sliding_window", None) is not None]
        if windows:
            raise ValueError(
                f"kv_press cannot run on a model with sliding-window attention (window "
                f"{windows[0]}): the window counts cache slots, which a press no longer "
                "keeps one per position"
            )
        plugins.append(PressRunner(plan.press, attention, len(kv_caches), cfg.block_size))
    plugins.extend(plan.plugins)
    speculator = length = None
    # The proposer prepares draft batches through the runner, built just below.
    built: list[ModelRunner] = []
    if cfg.speculative_config is not None:
        speculator, length = _speculate(
            cfg.speculative_config, built, attention, hf_config.vocab_size, dtype, tokenizer,
            max_model_len, for_device, cfg.seed, sampler, device, cfg.block_size, num_blocks,
            cfg.max_num_seqs,
        )
    decode_graphs = None
    if captures_decode(device, cfg.enforce_eager, attention, tp, model):
        decode_graphs = DecodeGraphs(
            model=model,
            backend=attention,
            kv_caches=kv_caches,
            device=device,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_model_len,
            block_size=cfg.block_size,
        )
    runner = runner_for(
        kv_caches, num_blocks, threads=threads, decode_graphs=decode_graphs,
        host_kv=host_kv_for(cfg, attention, layout, dtype, device, tp),  # swap / offload
        speculator=speculator, plugins=tuple(plugins),
    )
    built.append(runner)
    return RankParts(runner, num_blocks, tokenizer, grammars, eos_token_ids, length, lora)


def _speculate(spec, built, attention, vocab_size, dtype, tokenizer, max_model_len,
               for_device, seed, sampler, device, block_size, num_blocks, max_num_seqs):
    """Speculative decoding's parts: the runner's speculator (the proposer bound to this
    engine; it prepares draft batches through the runner, ``built[0]`` once built) and the
    length policy, which the scheduler takes."""
    proposer = spec.build_proposer()
    bind = getattr(proposer, "bind", None)
    if bind is not None:
        bind(ProposerContext(
            vocab_size=vocab_size, device=device, dtype=dtype,
            block_size=block_size, num_kv_blocks=num_blocks,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            attention=attention, tokenizer=tokenizer,
            prepare=lambda entries: built[0].prepare(ScheduledBatch(entries=tuple(entries))),
            for_device=for_device, seed=seed,
        ))
    if not callable(getattr(sampler, "process", None)):
        raise ValueError(
            f"speculative decoding verifies drafts with the sampler's process(logits, "
            f"metadata); the sampler {type(sampler).__name__} has none"
        )
    return Speculator(proposer, vocab_size, max_num_seqs), spec.length_policy()


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


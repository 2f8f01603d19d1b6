"""``EngineBuilder``: compose an engine from a config plus any components you swap in.

    engine = (EngineBuilder(EngineConfig(model="path/or/hub-id"))
              .with_scheduling_policy(MyPolicy())
              .with_eviction_policy(LFUEviction())
              .build())

Every component left unset gets its built-in default (FCFS, LRU, torch attention, the
default sampler), so swapping one piece still yields the whole engine. Components may also
be given by registered name (``"fcfs"``, ``"lru"``, ``"fifo"``, ``"random"``, ``"torch"``),
which is how the command line picks them.
"""

from __future__ import annotations

import logging

import attrs
import torch

from llmlab.attention import ATTENTION_BACKENDS
from llmlab.attention.backend import AttentionBackend, AttentionContext, AttentionInputs
from llmlab.attention.torch_backend import TorchPagedAttention
from llmlab.cache.eviction import EVICTION_POLICIES, EvictionPolicy, LRUEviction
from llmlab.cache.kv_cache_manager import KVCacheManager
from llmlab.cache.kv_tensors import allocate_kv_caches, num_blocks_for
from llmlab.config import EngineConfig
from llmlab.engine.engine import Engine
from llmlab.engine.model_runner import ModelRunner
from llmlab.models.loader import (
    load_model,
    load_tokenizer,
    max_model_len_from_config,
    resolve_dtype,
    resolve_model_path,
)
from llmlab.models.registry import get_model_class
from llmlab.sampling.sampler import Sampler
from llmlab.scheduler.policy import FCFS, SCHEDULING_POLICIES, SchedulingPolicy
from llmlab.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but CUDA is not available")
    return resolved


@attrs.define
class EngineBuilder:
    """Holds a config and optional component instances; ``build()`` makes the engine."""

    config: EngineConfig
    scheduling_policy: SchedulingPolicy | str | None = None
    eviction_policy: EvictionPolicy | str | None = None
    attention_backend: AttentionBackend | str | None = None
    sampler: Sampler | None = None

    def with_scheduling_policy(self, policy: SchedulingPolicy) -> EngineBuilder:
        return attrs.evolve(self, scheduling_policy=policy)

    def with_eviction_policy(self, policy: EvictionPolicy) -> EngineBuilder:
        return attrs.evolve(self, eviction_policy=policy)

    def with_attention_backend(self, backend: AttentionBackend) -> EngineBuilder:
        return attrs.evolve(self, attention_backend=backend)

    def with_sampler(self, sampler: Sampler) -> EngineBuilder:
        return attrs.evolve(self, sampler=sampler)

    def build(self) -> Engine:
        cfg = self.config
        policy = _component("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        eviction = _component("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        attention = _component("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        device = resolve_device(cfg.device)
        model_path = resolve_model_path(cfg.model, cfg.revision)
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_path)
        # Reject an unsupported architecture before loading any weights.
        get_model_class(getattr(hf_config, "architectures", None))
        if cfg.max_num_batched_tokens is None:
            default_budget = 8192 if device.type == "cuda" else 2048
            cfg = attrs.evolve(cfg, max_num_batched_tokens=default_budget)
        dtype = resolve_dtype(cfg.dtype, hf_config)
        max_model_len = _max_model_len(cfg, hf_config)

        model = load_model(model_path, hf_config, dtype, device)
        tokenizer = None
        if not cfg.skip_tokenizer_init:
            tokenizer = load_tokenizer(cfg.tokenizer or str(model_path), cfg.revision)
        attention = attention or TorchPagedAttention()
        layout = model.kv_layout

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
                model, attention, layout, cfg, max_model_len, dtype, device
            ),
        )
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, cfg.block_size)
        kv = KVCacheManager(
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            eviction=eviction or LRUEviction(),
        )
        generator = torch.Generator(device=device)
        generator.manual_seed(cfg.seed)
        runner = ModelRunner(
            model=model,
            attention=attention,
            sampler=self.sampler or Sampler(),
            kv=kv,
            kv_caches=allocate_kv_caches(attention, layout, num_blocks, cfg.block_size, dtype, device),
            device=device,
            generator=generator,
        )
        scheduler = Scheduler(
            kv=kv,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=policy or FCFS(),
        )
        return Engine(
            config=cfg,
            scheduler=scheduler,
            runner=runner,
            tokenizer=tokenizer,
            vocab_size=hf_config.vocab_size,
            max_model_len=max_model_len,
            eos_token_ids=_eos_token_ids(tokenizer, hf_config, model_path),
        )


def _component(kind: str, value, registry: dict[str, type]):
    """An instance as given, or a new instance of the registered class named ``value``."""
    if not isinstance(value, str):
        return value
    cls = registry.get(value)
    if cls is None:
        raise ValueError(f"unknown {kind} {value!r}; choose one of {', '.join(sorted(registry))}")
    return cls()


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


def _profile_peak_bytes(model, attention, layout, cfg, max_model_len, dtype, device) -> int:
    """Peak torch memory of a forward pass at the largest batch the scheduler may form.

    The batch is split into sequences of at most ``max_model_len`` tokens so positions
    stay in range; the temporary KV blocks it needs are subtracted from the peak.
    """
    num_tokens = cfg.max_num_batched_tokens
    bs = cfg.block_size
    lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lens.append(num_tokens % max_model_len)
    tables, slots, next_block = [], [], 0
    for n in lens:
        blocks = list(range(next_block, next_block + -(-n // bs)))
        next_block += len(blocks)
        tables.append(blocks)
        slots.extend(blocks[p // bs] * bs + p % bs for p in range(n))
    caches = allocate_kv_caches(attention, layout, next_block, bs, dtype, device)
    cache_bytes = sum(c.numel() * c.element_size() for c in caches)
    inputs = AttentionInputs(
        query_lens=lens,
        seq_lens=lens,
        block_tables=tables,
        slot_mapping=torch.tensor(slots, device=device),
        block_size=bs,
        device=device,
    )
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    with torch.inference_mode():
        attn = AttentionContext(attention, attention.build_metadata(inputs), caches)
        hidden = model(input_ids, positions, attn)
        model.compute_logits(hidden[: min(cfg.max_num_seqs, num_tokens)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del caches, hidden
    torch.cuda.empty_cache()
    return peak - cache_bytes

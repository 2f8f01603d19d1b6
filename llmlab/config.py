"""``EngineConfig``: every engine setting in one frozen, validated attrs class.

Change a setting with ``attrs.evolve(config, block_size=32)``; invalid values are rejected
at construction with a message naming the field, the value and what is allowed: a wrong
type is a ``TypeError``, a value out of range a ``ValueError``.
"""

from __future__ import annotations

import functools
import os
import re

import attrs
import torch

from llmlab import registry
from llmlab.dtypes import dtype_from_name
from llmlab.pooling.pooler import PoolerConfig
from llmlab.speculative.config import SpeculativeConfig
from llmlab.validation import as_bool, as_choice, as_int, as_real, as_seed, as_str

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _path(field: str, value: object, *, allow_none: bool = False) -> str | None:
    """A directory or hub id: a non-empty str (an ``os.PathLike`` becomes its str)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return as_str(field, value, allow_none=allow_none, allow_empty=False)


def _dtype(value: object) -> str | torch.dtype:
    if not isinstance(value, torch.dtype):  # vLLM takes a torch.dtype too
        value = as_str("dtype", value, allow_empty=False)
    # Checking the name here rejects a typo at construction rather than after the model
    # download; what "auto" becomes is the loader's business.
    dtype_from_name(value)
    return value


def _device(value: object) -> str:
    allowed = "'auto', 'cpu', 'cuda' or 'cuda:N'"
    if not isinstance(value, str):
        raise TypeError(f"device must be {allowed}, got {type(value).__name__} {value!r}")
    if not _DEVICE.fullmatch(value):
        raise ValueError(f"device must be {allowed}, got {value!r}")
    return str(value)


def _single_device(field: str, value: object) -> int:
    size = as_int(field, value)
    if size != 1:
        raise ValueError(
            f"{field}={size} is not supported: llmlab does not split layers across devices "
            "(only 1 is allowed); use tensor_parallel_size to split a model"
        )
    return size


# Weight-only schemes applied at load time (llmlab/quantization/); vLLM's names.
QUANTIZATION_METHODS = ("int8", "fp8")
# vLLM's names of checkpoint formats: accepted for a checkpoint saved in that format (its
# config.json's quant_method), which then loads as it is (the Marlin ones: vLLM's kernels).
CHECKPOINT_QUANTIZATION = ("gptq", "awq", "compressed-tensors", "gptq_marlin", "awq_marlin")
PREEMPTION_MODES = ("recompute", "swap")
KV_OFFLOADING_BACKENDS = ("cpu", "disk")
# vLLM's load_format values llmlab reads (llmlab/models/loader.py); gguf, bitsandbytes,
# sharded_state, tensorizer, npcache, mistral, ... are refused.
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")

RUNNERS = ("generate", "pooling", "auto")
# vLLM's older ``task`` values; a pooling one selects runner="pooling" (docs/pooling.md).
TASKS = ("auto", "generate", "embed", "embedding", "classify", "score", "reward")
POOLING_TASK_NAMES = ("embed", "embedding", "classify", "score", "reward")


# vLLM's names: "mp" (worker processes started by llmlab), "ray" (Ray actors), "uni" (one
# process: the only choice at tensor_parallel_size=1). None picks "uni" or "mp".
EXECUTOR_BACKENDS = ("mp", "ray", "uni")


def _only(field: str, supported: object, value: object, *, allow_none: bool = False) -> object:
    """A vLLM setting llmlab has one value for: accept that value, refuse the others."""
    as_str(field, value, allow_none=allow_none)
    if value != supported:
        raise ValueError(f"{field}={value!r} is not supported (only {supported!r})")
    return value


def _cpu_offload_gb(value: object) -> float:
    gib = as_real("cpu_offload_gb", value)
    if gib != 0:
        raise ValueError(
            f"cpu_offload_gb={value!r} is not supported: llmlab keeps every weight on the "
            "device it runs on (only 0 is allowed)"
        )
    return gib


def _positive(field: str, *, allow_none: bool = False):
    return functools.partial(as_int, field, min=1, allow_none=allow_none)


def _flag(field: str):
    return functools.partial(as_bool, field)


def _name(kind: str):
    """A component field's converter: None, or a registered name or ``"module:Class"``."""
    return functools.partial(registry.name_of, kind)


def _settings(kind: str):
    """A ``<kind>_config`` field's converter: None, or a dict of keyword arguments (a JSON
    object's text on the command line)."""
    return functools.partial(registry.config_dict, kind)


def _plugins(value: object) -> tuple[str, ...]:
    """Feature plugins by name: a list of names or ``"module:Class"`` paths (or one str,
    comma-separated, as a command line gives it)."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"plugins must be a list of plugin names, got {value!r}")
    return tuple(registry.name_of("plugin", v) for v in value)


def _plugin_config(value: object) -> dict[str, dict] | None:
    """Per plugin (by the entry of ``plugins`` it configures), its keyword arguments."""
    value = registry.config_dict("plugin", value)
    if value is None:
        return None
    return {name: registry.config_dict("plugin", kwargs) or {} for name, kwargs in value.items()}


# The component kinds an EngineConfig names (each with a ``<kind>_config``): the engine
# builds them with llmlab.registry.build. Speculation's proposer is named in
# speculative_config, the pooler in pooler_config, plugins in plugins / plugin_config.
COMPONENT_FIELDS = ("scheduling_policy", "eviction_policy", "attention_backend", "sampler",
                    "router", "kv_press")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Engine settings (vLLM names, meanings and defaults where vLLM has them).

    Attributes:
        model: local directory or Hugging Face hub id (a ``pathlib.Path`` is taken as its str).
        tokenizer: tokenizer directory or hub id; defaults to ``model``.
        revision: hub revision (branch, tag or commit) of the model.
        tokenizer_revision: hub revision of the tokenizer; defaults to ``revision``.
        tokenizer_mode: ``"auto"`` (the fast tokenizer when there is one) or ``"slow"``
            (the Python one). vLLM's ``"mistral"`` and ``"custom"`` modes are refused.
        dtype: ``"auto"`` (the checkpoint's dtype; a float32 or unset one runs in float32
            on CPU and bfloat16 on CUDA), or a dtype name (``"float16"``, ``"bfloat16"``,
            ...) or ``torch.dtype``.
        seed: seeds the engine's generator for requests without their own seed; ``None``
            (vLLM's default) means not reproducible: the engine draws a random seed, which
            it keeps in its own copy of the config.
        device: ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda[:N]"``.
        max_model_len: longest sequence (prompt + output); defaults to the model config's.
        block_size: tokens per KV block.
        enable_prefix_caching: reuse KV blocks across requests sharing a prefix.
        enable_chunked_prefill: ``None`` or ``True``: a long prompt is prefilled in chunks
            across steps, sharing each step's token budget with decodes. ``False``: every
            prompt is prefilled in one step, so ``max_num_batched_tokens`` must be at least
            ``max_model_len``.
        async_scheduling: overlapped scheduling (vLLM's setting): plan and start each
            step's batch while the previous one runs, so the host's scheduling and commit
            hide behind the forward (:mod:`llmlab.engine.overlap`); same tokens as the
            synchronous engine. ``None``: on for a single-device CUDA engine unless a
            feature never lets a batch be planned ahead (speculation, a KV press), off
            elsewhere.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most new tokens per step (prefill chunks + decodes);
            ``None`` picks 8192 on CUDA and 2048 on CPU, where activations of larger
            chunks fall out of cache and elementwise ops slow down (BENCHMARKS.md).
        kv_cache_memory_bytes: KV cache size; overrides ``gpu_memory_utilization``.
        num_gpu_blocks_override: exact number of KV blocks; overrides both of the above.
        gpu_memory_utilization: on CUDA, the fraction of device memory the engine may use,
            weights and activations included; the KV cache gets what profiling leaves.
        skip_tokenizer_init: run on token ids only (no text in or out).
        download_dir: where hub downloads go; ``None`` is the Hugging Face cache.
        load_format: how the weights are read (vLLM's): ``"auto"`` (safetensors, else
            PyTorch ``pytorch_model*.bin``), ``"safetensors"`` or ``"pt"`` (only that
            kind of file), or ``"dummy"`` (random weights of the right shapes and dtype,
            no weight file read: for benchmarking; the config and tokenizer still load).
            Other vLLM formats (``"gguf"``, ``"bitsandbytes"``, ...) are refused.
        cpu_offload_gb: GiB of weights to keep in host memory (vLLM's): only 0, since
            llmlab does not offload weights.
        max_logprobs: most logprobs a request may ask for; -1 means no limit.
        enforce_eager: on CUDA, run decode steps eagerly instead of replaying CUDA graphs
            (captured per padded batch size on first use, with the Triton backend).
        cpu_linear: on CPU, how linear layers run: ``"onednn"`` reorders every weight once
            at load time into oneDNN's blocked layout (faster, float32 results equal to
            rounding), ``"plain"`` uses ``F.linear``; ``"auto"`` is oneDNN for float32
            models, and for bfloat16 ones where the CPU has native bf16 (avx512_bf16 or
            AMX), when this torch build has it.
        cpu_fused_ops: on CPU, run the Llama family's residual add + RMSNorm, rotary
            embedding and SiLU x up as fused C++ kernels (``llmlab.kernels.fused``) when
            llmlab's CPU kernels load; ``False`` keeps the plain torch ops.
        cuda_fused_ops: on CUDA, the same three as Triton kernels
            (``llmlab.kernels.triton_fused``), after a check at engine build that each
            compiles and matches the torch ops at the model's sizes (else a warning and the
            torch ops); ``False`` keeps the plain torch ops.
        cpu_threads: torch/OpenMP threads for CPU work (process-wide, like
            ``torch.set_num_threads``). ``None``: the ``LLMLAB_CPU_THREADS`` environment
            variable if set, else torch's count as ``OMP_NUM_THREADS`` set it, else the
            cores this process may use (CPU affinity and cgroup quota; ``llmlab.threads``).

        speculative_config: speculative decoding (vLLM's ``speculative_config``): a dict
            such as ``{"method": "ngram", "num_speculative_tokens": 4}``, its JSON, or a
            :class:`~llmlab.speculative.config.SpeculativeConfig`; None (default) is off.
            The proposer is named by its ``method`` (``LLM(proposer=...)`` is the same
            setting; a proposer instance goes to the engine builder). See
            ``docs/speculative.md``.
        disable_log_stats: as in vLLM, ``LLM.get_metrics()`` needs ``False`` (then ``LLM``
            keeps counters from the step events); llmlab logs no periodic stats either way
            (per-step numbers are in the engine's ``StepEvent``s).

        tensor_parallel_size: split every layer across this many devices (Megatron-style
            tensor parallelism: ``docs/distributed.md``), one worker process per rank; the
            attention heads (and the KV heads, or the ranks sharing a KV head) must divide
            evenly. Checked against the model and the devices at build time.
        enable_expert_parallel: (vLLM's flag) in a mixture-of-experts model's sparse layers,
            place whole experts on the tensor-parallel ranks (rank r of N holds experts
            ``r*E//N .. (r+1)*E//N - 1``) instead of splitting every expert's inner width
            over them; the attention stays split. Each rank runs its experts on the tokens
            routed to them and the ranks' sums are reduced as before. Needs an MoE model
            and at least as many experts as ranks; nothing changes at one rank.
        data_parallel_size: run this many whole engine replicas (each of
            ``tensor_parallel_size`` ranks) in processes of their own, behind a router
            that picks one per request.
        engine_core_process: run the one engine in a process of its own (the front end,
            e.g. ``llmlab serve``'s HTTP work, then never takes the engine's Python thread
            time), as one data-parallel replica: requests in and outputs out cross a pipe
            as plain data. Off by default (measured to gain nothing on a 2-core CPU; not
            measured on a GPU yet).
        distributed_executor_backend: how ranks and replicas are started: ``"mp"``
            (processes llmlab starts on this machine), ``"ray"`` (Ray actors, on an
            existing Ray cluster or a local one; ``pip install "llmlab[ray]"``), or
            ``"uni"`` (one process; tensor_parallel_size=1 only). None: ``"uni"`` at
            tensor_parallel_size=1, else ``"mp"``.
        collective_backend: the ``torch.distributed`` backend of a tensor-parallel group:
            ``"auto"`` (NCCL on CUDA, gloo on CPU), ``"nccl"`` (CUDA only) or ``"gloo"``.
        distributed_timeout_s: how long a rank waits on a collective (or a worker to start)
            before the group is declared broken; a rank that dies is noticed sooner (its
            connections close).

        runner: ``"generate"`` (text generation: ``LLM.generate``), ``"pooling"`` (prefill
            only, one vector per prompt: ``LLM.embed`` / ``classify`` / ``score`` /
            ``encode``; docs/pooling.md), or ``"auto"`` (pooling for a
            ``*ForSequenceClassification`` checkpoint, else generate).
        task: vLLM's older spelling: ``"embed"`` (``"embedding"``), ``"classify"``,
            ``"score"`` or ``"reward"`` means ``runner="pooling"`` with that default task
            (``"reward"``: the architecture's own); ``"generate"`` means
            ``runner="generate"``; ``"auto"`` leaves ``runner`` to decide.
        pooler_config: how a pooling model pools (vLLM's
            :class:`~llmlab.pooling.PoolerConfig`: ``pooling_type`` ``last`` / ``mean`` /
            ``cls``, ``normalize``, ``use_activation``), a dict or its JSON; None: the
            checkpoint's sentence-transformers settings, else last-token pooling with
            normalized embeddings. ``override_pooler_config`` is vLLM's older name (both
            may not be set).

        enable_lora: serve LoRA adapters (vLLM's): requests name one with a
            ``LoRARequest``; requests with different adapters (and none) share a batch.
        max_loras: most distinct adapters in one step (each holds a slot of stacked A/B
            weights on the device).
        max_lora_rank: the largest adapter rank accepted (slots are sized for it).
        max_cpu_loras: most adapters kept loaded in host memory (least recently used
            ones are dropped beyond it); ``None``: ``max_loras``. At least ``max_loras``.

        quantization: weight-only quantization applied at load time (vLLM's name):
            ``None`` (weights run in ``dtype``), ``"int8"`` (per-output-channel symmetric
            int8 weights, activations in the model dtype; CPU and CUDA) or ``"fp8"``
            (float8 e4m3 weights with per-channel scales; CUDA only). A checkpoint saved
            in the same scheme loads as it is. ``"gptq"``, ``"awq"``,
            ``"compressed-tensors"`` (and vLLM's ``"gptq_marlin"`` / ``"awq_marlin"``)
            name a checkpoint's own format (4-bit ones run as W4A16,
            ``docs/quantization.md``); one that does not match the checkpoint's
            ``quant_method`` is refused. An unsupported device is refused before any
            weight loads.

        preemption_mode: how a preempted request gives its KV blocks back (vLLM's):
            ``None`` or ``"recompute"`` (the blocks are freed, the tokens recomputed on
            resumption), or ``"swap"`` (the blocks are copied to a host pool of
            ``swap_space`` GiB and back on resumption; recompute is the fallback when
            that pool is full). A scheduling policy may choose per victim.
        swap_space: GiB of host memory for swapped-out KV blocks (``preemption_mode=
            "swap"``); unused otherwise.
        kv_offloading_size: GiB for a second tier of the prefix cache: blocks evicted from
            the device pool spill there, and a prefix hit on them loads them back before
            the request runs. ``None`` or 0: no second tier.
        kv_offloading_backend: where the second tier lives: ``"cpu"`` (host memory; on a
            CPU-only machine a second pool in memory) or ``"disk"`` (a file under
            ``kv_offloading_dir``, else a temporary directory).
        kv_offloading_dir: directory for ``kv_offloading_backend="disk"``.
        kv_offloading_eviction_policy: the second tier's eviction policy, by registered
            name (``"lru"``, ``"arc"``, ``"s3fifo"``, ...); the engine builder also takes
            an instance.

        Components, by name (docs/components.md): each field holds a registered name or
        ``"package.module:Class"`` (None: the built-in default), and its ``<kind>_config``
        the keyword arguments its constructor gets (a JSON object on the command line;
        set only with a name). An instance is not a setting: ``LLM(<kind>=instance)``
        hands it to the engine builder, and the config keeps None.

        scheduling_policy: which waiting request runs next, who is preempted (``"fcfs"``
            when None; ``"priority"``, ``"fair"``, ...).
        eviction_policy: which cached KV block is evicted (``"lru"`` when None).
        attention_backend: ``"torch"``, ``"cpu"``, ``"triton"``, ...; None or ``"auto"``:
            Triton kernels on CUDA, llmlab's C++ kernels on CPU, else torch.
        sampler: the sampler (the built-in ``"default"`` when None).
        router: with ``data_parallel_size > 1``, which replica gets each request
            (``"round_robin"`` when None); checked, unused, with one replica.
        plugins: feature plugins (:mod:`llmlab.plugin`) by name; ``plugin_config`` maps an
            entry of ``plugins`` to its keyword arguments.
        kv_press: a KV press (:mod:`llmlab.kvpress`): ``"snapkv"``, ``"streaming_llm"``,
            ``"knorm"``, ... Each request's KV is compacted after its prompt (and every
            ``compress_every`` decode steps) to the tokens the press keeps. None: off.
        kv_press_config: keyword arguments for the press (``compression_ratio``,
            ``compress_every`` and its own fields, e.g. ``{"window": 64}``).

        record_expert_load: for a mixture-of-experts model, count each step's tokens per
            expert and sparse layer into ``StepEvent.expert_load`` (and recordings;
            :mod:`llmlab.models.expert_load`). Steps then run eagerly (no CUDA graph
            replay) and read the counts back once each. Off (default): no counting at all.
            A model without experts is refused.

    Accepted for vLLM compatibility, with nothing to change in llmlab:
        trust_remote_code: llmlab never runs code from a checkpoint; it supports its
            built-in architectures only, whatever this says.

    vLLM settings with one supported value (any other is a ``ValueError``):
        pipeline_parallel_size: 1; layers are not split across devices.
        kv_cache_dtype: ``"auto"``; the KV cache has the model's dtype.
    """

    model: str = attrs.field(converter=functools.partial(_path, "model"))
    tokenizer: str | None = attrs.field(
        default=None, converter=functools.partial(_path, "tokenizer", allow_none=True)
    )
    revision: str | None = attrs.field(
        default=None,
        converter=functools.partial(as_str, "revision", allow_none=True, allow_empty=False),
    )
    tokenizer_revision: str | None = attrs.field(
        default=None,
        converter=functools.partial(
            as_str, "tokenizer_revision", allow_none=True, allow_empty=False
        ),
    )
    tokenizer_mode: str = attrs.field(
        default="auto",
        converter=functools.partial(as_choice, "tokenizer_mode", choices=("auto", "slow")),
    )
    dtype: str | torch.dtype = attrs.field(default="auto", converter=_dtype)
    seed: int | None = attrs.field(
        default=0, converter=functools.partial(as_seed, "seed", allow_none=True)
    )
    device: str = attrs.field(default="auto", converter=_device)
    max_model_len: int | None = attrs.field(
        default=None, converter=_positive("max_model_len", allow_none=True)
    )
    block_size: int = attrs.field(default=16, converter=_positive("block_size"))
    enable_prefix_caching: bool = attrs.field(
        default=True, converter=_flag("enable_prefix_caching")
    )
    enable_chunked_prefill: bool | None = attrs.field(
        default=None,
        converter=functools.partial(as_bool, "enable_chunked_prefill", allow_none=True),
    )
    async_scheduling: bool | None = attrs.field(
        default=None, converter=functools.partial(as_bool, "async_scheduling", allow_none=True)
    )
    max_num_seqs: int = attrs.field(default=256, converter=_positive("max_num_seqs"))
    max_num_batched_tokens: int | None = attrs.field(
        default=None, converter=_positive("max_num_batched_tokens", allow_none=True)
    )
    kv_cache_memory_bytes: int | None = attrs.field(
        default=None, converter=_positive("kv_cache_memory_bytes", allow_none=True)
    )
    num_gpu_blocks_override: int | None = attrs.field(
        default=None, converter=_positive("num_gpu_blocks_override", allow_none=True)
    )
    gpu_memory_utilization: float = attrs.field(
        default=0.9,
        converter=functools.partial(
            as_real, "gpu_memory_utilization", min=0, min_inclusive=False, max=1
        ),
    )
    skip_tokenizer_init: bool = attrs.field(default=False, converter=_flag("skip_tokenizer_init"))
    download_dir: str | None = attrs.field(
        default=None, converter=functools.partial(_path, "download_dir", allow_none=True)
    )
    load_format: str = attrs.field(
        default="auto",
        converter=functools.partial(as_choice, "load_format", choices=LOAD_FORMATS),
    )
    cpu_offload_gb: float = attrs.field(default=0.0, converter=_cpu_offload_gb)
    max_logprobs: int = attrs.field(
        default=20,
        converter=functools.partial(
            as_int, "max_logprobs", min=-1, allowed=">= 0, or -1 for no limit"
        ),
    )
    trust_remote_code: bool = attrs.field(default=False, converter=_flag("trust_remote_code"))
    enforce_eager: bool = attrs.field(default=False, converter=_flag("enforce_eager"))
    cpu_linear: str = attrs.field(
        default="auto",
        converter=functools.partial(
            as_choice, "cpu_linear", choices=("auto", "onednn", "plain")
        ),
    )
    cpu_fused_ops: bool = attrs.field(default=True, converter=_flag("cpu_fused_ops"))
    cuda_fused_ops: bool = attrs.field(default=True, converter=_flag("cuda_fused_ops"))
    cpu_threads: int | None = attrs.field(
        default=None, converter=_positive("cpu_threads", allow_none=True)
    )
    speculative_config: SpeculativeConfig | None = attrs.field(
        default=None, converter=SpeculativeConfig.of
    )
    disable_log_stats: bool = attrs.field(default=True, converter=_flag("disable_log_stats"))
    enable_lora: bool = attrs.field(default=False, converter=_flag("enable_lora"))
    max_loras: int = attrs.field(default=1, converter=_positive("max_loras"))
    max_lora_rank: int = attrs.field(default=16, converter=_positive("max_lora_rank"))
    max_cpu_loras: int | None = attrs.field(
        default=None, converter=_positive("max_cpu_loras", allow_none=True)
    )
    preemption_mode: str | None = attrs.field(
        default=None,
        converter=lambda v: None if v is None else as_choice(
            "preemption_mode", v, PREEMPTION_MODES
        ),
    )
    swap_space: float = attrs.field(
        default=4.0, converter=functools.partial(as_real, "swap_space", min=0)
    )
    kv_offloading_size: float | None = attrs.field(
        default=None,
        converter=lambda v: None if v is None else as_real("kv_offloading_size", v, min=0),
    )
    kv_offloading_backend: str = attrs.field(
        default="cpu",
        converter=functools.partial(
            as_choice, "kv_offloading_backend", choices=KV_OFFLOADING_BACKENDS
        ),
    )
    kv_offloading_dir: str | None = attrs.field(
        default=None, converter=functools.partial(_path, "kv_offloading_dir", allow_none=True)
    )
    kv_offloading_eviction_policy: str = attrs.field(
        default="lru",
        converter=functools.partial(
            as_str, "kv_offloading_eviction_policy", allow_empty=False
        ),
    )
    scheduling_policy: str | None = attrs.field(default=None,
                                                converter=_name("scheduling_policy"))
    scheduling_policy_config: dict | None = attrs.field(
        default=None, converter=_settings("scheduling_policy"))
    eviction_policy: str | None = attrs.field(default=None, converter=_name("eviction_policy"))
    eviction_policy_config: dict | None = attrs.field(
        default=None, converter=_settings("eviction_policy"))
    attention_backend: str | None = attrs.field(default=None,
                                                converter=_name("attention_backend"))
    attention_backend_config: dict | None = attrs.field(
        default=None, converter=_settings("attention_backend"))
    sampler: str | None = attrs.field(default=None, converter=_name("sampler"))
    sampler_config: dict | None = attrs.field(default=None, converter=_settings("sampler"))
    router: str | None = attrs.field(default=None, converter=_name("router"))
    router_config: dict | None = attrs.field(default=None, converter=_settings("router"))
    plugins: tuple[str, ...] = attrs.field(default=(), converter=_plugins)
    plugin_config: dict | None = attrs.field(default=None, converter=_plugin_config)
    kv_press: str | None = attrs.field(default=None, converter=_name("kv_press"))
    kv_press_config: dict | None = attrs.field(default=None, converter=_settings("kv_press"))
    record_expert_load: bool = attrs.field(default=False, converter=_flag("record_expert_load"))
    tensor_parallel_size: int = attrs.field(default=1, converter=_positive("tensor_parallel_size"))
    enable_expert_parallel: bool = attrs.field(
        default=False, converter=_flag("enable_expert_parallel"))
    data_parallel_size: int = attrs.field(default=1, converter=_positive("data_parallel_size"))
    engine_core_process: bool = attrs.field(default=False, converter=_flag("engine_core_process"))
    distributed_executor_backend: str | None = attrs.field(
        default=None,
        converter=lambda v: None if v is None else as_choice(
            "distributed_executor_backend", v, EXECUTOR_BACKENDS
        ),
    )
    collective_backend: str = attrs.field(
        default="auto",
        converter=functools.partial(
            as_choice, "collective_backend", choices=("auto", "nccl", "gloo")
        ),
    )
    distributed_timeout_s: float = attrs.field(
        default=600.0,
        converter=functools.partial(
            as_real, "distributed_timeout_s", min=0, min_inclusive=False
        ),
    )
    pipeline_parallel_size: int = attrs.field(
        default=1, converter=functools.partial(_single_device, "pipeline_parallel_size")
    )
    quantization: str | None = attrs.field(
        default=None,
        converter=lambda v: None if v is None else as_choice(
            "quantization", v, QUANTIZATION_METHODS + CHECKPOINT_QUANTIZATION
        ),
    )
    kv_cache_dtype: str = attrs.field(
        default="auto", converter=functools.partial(_only, "kv_cache_dtype", "auto")
    )

    runner: str = attrs.field(
        default="generate", converter=functools.partial(as_choice, "runner", choices=RUNNERS)
    )
    task: str = attrs.field(
        default="auto", converter=functools.partial(as_choice, "task", choices=TASKS)
    )
    pooler_config: PoolerConfig | None = attrs.field(
        default=None, converter=functools.partial(PoolerConfig.of, field="pooler_config")
    )
    override_pooler_config: PoolerConfig | None = attrs.field(
        default=None,
        converter=functools.partial(PoolerConfig.of, field="override_pooler_config"),
    )

    @property
    def runner_type(self) -> str:
        """``runner`` with ``task`` applied: ``"generate"``, ``"pooling"`` or ``"auto"``
        (resolved against the architecture when the engine is built)."""
        if self.task in POOLING_TASK_NAMES:
            return "pooling"
        if self.task == "generate":
            return "generate"
        return self.runner

    def __attrs_post_init__(self) -> None:
        for kind in COMPONENT_FIELDS:
            if getattr(self, f"{kind}_config") and getattr(self, kind) is None:
                raise ValueError(
                    f"{kind}_config is set but {kind} is None: name the {kind} it configures "
                    "(a registered name or 'package.module:Class')"
                )
        unplugged = sorted(set(self.plugin_config or ()) - set(self.plugins))
        if unplugged:
            raise ValueError(
                f"plugin_config names {unplugged}, which plugins {list(self.plugins)} does not "
                "list: plugin_config is keyed by the entries of plugins"
            )
        if self.task == "generate" and self.runner == "pooling":
            raise ValueError(
                "task='generate' and runner='pooling' contradict each other; set one"
            )
        if self.pooler_config is not None and self.override_pooler_config is not None:
            raise ValueError(
                "pooler_config and override_pooler_config are one setting (the latter is "
                "vLLM's older name); set only pooler_config"
            )
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one process, but "
                f"tensor_parallel_size={self.tensor_parallel_size}; use 'mp' or 'ray'"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras}): every adapter in a step is also kept in host memory"
            )
        budget, max_len = self.max_num_batched_tokens, self.max_model_len
        # The engine checks again once max_model_len is known from the model's config.
        one_step_prefill = self.enable_chunked_prefill is False
        if one_step_prefill and None not in (budget, max_len) and budget < max_len:
            raise ValueError(
                f"enable_chunked_prefill=False needs max_num_batched_tokens ({budget}) "
                f">= max_model_len ({max_len}), so that every prompt fits one step"
            )

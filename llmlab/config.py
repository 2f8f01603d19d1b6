"""``EngineConfig``: every engine setting in one frozen, validated attrs class.

Change a setting with ``attrs.evolve(config, block_size=32)``; invalid values are rejected
at construction with a message naming the field, the value and what is allowed.
"""

from __future__ import annotations

import attrs


def _positive(instance, attribute, value) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value!r}")


def _fraction(instance, attribute, value) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value!r}")


def _device(instance, attribute, value) -> None:
    if value not in ("auto", "cpu", "cuda") and not str(value).startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Engine settings (vLLM names and defaults where vLLM has them).

    Attributes:
        model: local directory or Hugging Face hub id.
        tokenizer: tokenizer directory or hub id; defaults to ``model``.
        revision: hub revision (branch, tag or commit) of the model.
        dtype: ``"auto"`` (the checkpoint's dtype, float32 if unset), or a dtype name.
        seed: seeds the engine's generator for requests without their own seed.
        device: ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda[:N]"``.
        max_model_len: longest sequence (prompt + output); defaults to the model config's.
        block_size: tokens per KV block.
        enable_prefix_caching: reuse KV blocks across requests sharing a prefix.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most new tokens per step (prefill chunks + decodes);
            ``None`` picks 8192 on CUDA and 2048 on CPU, where activations of larger
            chunks fall out of cache and elementwise ops slow down (BENCHMARKS.md).
        kv_cache_memory_bytes: KV cache size; overrides ``gpu_memory_utilization``.
        num_gpu_blocks_override: exact number of KV blocks; overrides both of the above.
        gpu_memory_utilization: on CUDA, the fraction of device memory the engine may use,
            weights and activations included; the KV cache gets what profiling leaves.
        skip_tokenizer_init: run on token ids only (no text in or out).
    """

    model: str
    tokenizer: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    seed: int = 0
    device: str = attrs.field(default="auto", validator=_device)
    max_model_len: int | None = attrs.field(default=None, validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    enable_prefix_caching: bool = True
    max_num_seqs: int = attrs.field(default=256, validator=_positive)
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=_positive)
    kv_cache_memory_bytes: int | None = attrs.field(default=None, validator=_positive)
    num_gpu_blocks_override: int | None = attrs.field(default=None, validator=_positive)
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_fraction)
    skip_tokenizer_init: bool = False

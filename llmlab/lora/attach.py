"""``attach_lora``: give a loaded model LoRA slots (the engine builder's one call)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from llmlab.lora.bounds import base_norms
from llmlab.lora.layer import wrap_linears
from llmlab.lora.slots import LoRASlots
from llmlab.lora.store import AdapterStore
from llmlab.lora.targets import LoRATargets

KERNELS = ("torch", "triton")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def attach_lora(
    model: nn.Module,
    *,
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int | None,
    max_num_seqs: int,
    dtype: torch.dtype,
    device: torch.device,
    base_model_names: Iterable[str] = (),
    kernel: str | None = None,
) -> LoRASlots:
    """Wrap the model's target linears (after loading, quantization and prepacking: any
    module with ``in_features``, ``out_features`` and ``forward``) and return the runner's
    :class:`LoRASlots`, whose ``store`` input processing shares (and which bounds each
    adapter's updates by the base weights measured here). ``kernel``: ``"triton"`` (CUDA's
    default) or ``"torch"``."""
    targets = LoRATargets.of(model)
    # The Triton kernels accumulate in float32 on the tensor cores: float64 weights (the
    # parity tests' dtype) take torch's path, on CUDA too.
    triton_ok = device.type == "cuda" and dtype in TRITON_DTYPES
    kernel = kernel or ("triton" if triton_ok else "torch")
    if kernel not in KERNELS:
        raise ValueError(f"LoRA kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "triton" and not triton_ok:
        raise ValueError(
            f"LoRA kernel 'triton' needs a CUDA device and a dtype in "
            f"{[str(d).removeprefix('torch.') for d in TRITON_DTYPES]}, got {device.type} "
            f"and {str(dtype).removeprefix('torch.')}; use 'torch'"
        )
    # Measured before wrapping, on the modules as they will run (packed, quantized).
    norms = {
        t.path: base_norms(model.get_submodule(t.path), t, dtype, device)
        for t in targets.targets
    }
    store = AdapterStore(
        targets, max_lora_rank, max_cpu_loras or max_loras, dtype, set(base_model_names),
        base_norms=norms,
    )
    context, modules = wrap_linears(
        model, targets.targets, max_loras, max_lora_rank, dtype, device
    )
    return LoRASlots(store, modules, context, max_loras, max_num_seqs, device, kernel)


def check_lora_settings(config, *, pooling: bool, model_class: type | None) -> None:
    """Refuse, before anything loads, what ``enable_lora`` cannot run with (``ValueError``
    naming the setting): tensor or data parallelism, a pooling runner, an architecture
    outside the Llama family. Speculative decoding, beam search, parallel samples and CUDA
    graphs work with it (steps with adapters run eagerly)."""
    if not config.enable_lora:
        return
    from llmlab.models.llama import LlamaForCausalLM

    if config.tensor_parallel_size > 1:
        raise ValueError(
            f"enable_lora=True is not supported with tensor_parallel_size="
            f"{config.tensor_parallel_size} (adapter slots are not sharded); use 1"
        )
    if config.data_parallel_size > 1:
        raise ValueError(
            f"enable_lora=True is not supported with data_parallel_size="
            f"{config.data_parallel_size} (replicas do not share adapters); use 1"
        )
    if getattr(config, "engine_core_process", False):
        raise ValueError("enable_lora=True is not supported with engine_core_process=True "
                         "(adapters are not sent to an engine process); use False")
    if pooling:
        raise ValueError(
            "enable_lora=True is not supported with runner='pooling'; LoRA adapters apply "
            "to text generation"
        )
    if model_class is not None and not issubclass(model_class, LlamaForCausalLM):
        raise ValueError(
            f"enable_lora=True supports the Llama family (Llama, Mistral, Qwen2, Qwen3); "
            f"this model is {model_class.__name__}"
        )

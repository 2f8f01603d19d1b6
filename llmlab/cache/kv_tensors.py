"""Sizing and allocating the paged KV tensors.

One tensor per layer, keys and values, in the layout the attention backend asks for
(``backend.kv_cache_shape``); a flat slot ``block_id * block_size + offset`` addresses
one token in any layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# CPU default: room for every running sequence at full length, capped like vLLM's CPU
# backend (which reserves 4 GiB unless told otherwise).
CPU_DEFAULT_KV_CAP_BYTES = 4 << 30


def bytes_per_block(layout: Any, block_size: int, dtype: torch.dtype) -> int:
    """KV bytes of one block across all layers (``layout`` is the model's ``KVLayout``)."""
    return block_size * layout.bytes_per_token(dtype)


def allocate_kv_caches(
    backend: Any,
    layout: Any,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    shape = backend.kv_cache_shape(num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]


def num_blocks_for(
    *,
    layout: Any,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    max_num_seqs: int,
    kv_cache_memory_bytes: int | None,
    num_gpu_blocks_override: int | None,
    gpu_memory_utilization: float,
    profile_peak_bytes: Callable[[], int] | None = None,
) -> int:
    """How many KV blocks to allocate, from the most specific setting given.

    ``num_gpu_blocks_override`` wins, then ``kv_cache_memory_bytes``; on CUDA the budget is
    ``gpu_memory_utilization`` of device memory minus the peak of a profiled forward pass
    (``profile_peak_bytes``) and memory held outside torch; on CPU a default sized to the
    workload limits. Raises ``ValueError`` if one ``max_model_len`` sequence cannot fit.
    """
    per_block = bytes_per_block(layout, block_size, dtype)
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
        source = f"num_gpu_blocks_override={num_gpu_blocks_override}"
    else:
        if kv_cache_memory_bytes is not None:
            budget = kv_cache_memory_bytes
            source = f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
        elif device.type == "cuda":
            budget = _cuda_budget(device, gpu_memory_utilization, profile_peak_bytes)
            source = f"gpu_memory_utilization={gpu_memory_utilization} ({budget} bytes left)"
        else:
            wanted = -(-max_model_len // block_size) * max_num_seqs * per_block
            budget = min(wanted, max(CPU_DEFAULT_KV_CAP_BYTES, per_block))
            source = f"the CPU default of {budget} bytes"
        num_blocks = budget // per_block
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(
            f"KV cache from {source} holds {num_blocks} blocks of {block_size} tokens "
            f"({num_blocks * block_size} tokens), but one sequence of max_model_len="
            f"{max_model_len} needs {needed} blocks; raise the KV cache size or lower "
            f"max_model_len"
        )
    return num_blocks


def _cuda_budget(
    device: torch.device,
    gpu_memory_utilization: float,
    profile_peak_bytes: Callable[[], int] | None,
) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    peak_torch = profile_peak_bytes() if profile_peak_bytes else torch.cuda.memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    # Memory in use that torch's allocator does not know about (CUDA context, NCCL, other
    # processes) also counts against our share.
    outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return max(0, int(total * gpu_memory_utilization) - peak_torch - outside_torch)

"""Sizing and allocating the paged KV tensors.

One tensor per layer, keys and values, in the layout the attention backend asks for
(``backend.kv_cache_shape``); a flat slot ``block_id * block_size + offset`` addresses
one token in any layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
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


# -- host pools: swap space and the offload tier (llmlab.cache.host_pools) -------------------

GIB = 1 << 30


def num_host_blocks(
    size_gib: float | None, layout: Any, block_size: int, dtype: torch.dtype
) -> int:
    """Blocks of ``size_gib`` GiB at the KV bytes one block takes across all layers."""
    if not size_gib:
        return 0
    return int(size_gib * GIB) // bytes_per_block(layout, block_size, dtype)


def check_block_layout(backend: Any, layout: Any, block_size: int) -> None:
    """Raise ``ValueError`` unless the backend's KV layout is ``[2, kv_heads, blocks, ...]``
    with everything of one block contiguous after the block index (every built-in
    backend's), which is what moving whole blocks between pools relies on."""
    one = tuple(backend.kv_cache_shape(1, block_size, layout.num_kv_heads, layout.head_dim))
    two = tuple(backend.kv_cache_shape(2, block_size, layout.num_kv_heads, layout.head_dim))
    if len(one) < 3 or one[:2] != two[:2] or one[3:] != two[3:] or two[2] != 2 * one[2]:
        raise ValueError(
            f"swap preemption and the KV offload tier move whole blocks, which needs a KV "
            f"layout [2, kv_heads, blocks (x block_size), ...]; the attention backend "
            f"{getattr(backend, 'name', type(backend).__name__)!r} uses {one} for one block"
        )


def _block_view(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[2, kv_heads, num_blocks, block_elems]``: one index per block (a view)."""
    return cache.view(cache.shape[0], cache.shape[1], num_blocks, -1)


def copy_blocks_between(
    src: list[torch.Tensor],
    src_blocks: int,
    dst: list[torch.Tensor],
    dst_blocks: int,
    pairs: Sequence[tuple[int, int]],
) -> None:
    """Copy whole blocks ``(src_block, dst_block)`` from one pool's per-layer tensors
    (``src_blocks`` blocks each) to another's (same layout; any devices): one gather and
    one scatter per layer."""
    if not pairs:
        return
    src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
    dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.int64)
    for s, d in zip(src, dst, strict=True):
        moved = _block_view(s, src_blocks).index_select(2, src_ids.to(s.device))
        _block_view(d, dst_blocks).index_copy_(2, dst_ids.to(d.device), moved.to(d.device))


@attrs.define(eq=False)
class HostKVCaches:
    """The host side of swap preemption and the offload tier: per-layer KV tensors in the
    device cache's layout. ``swap`` lives in (pinned, on CUDA) host memory; ``offload`` in
    host memory or, for ``kv_offloading_backend="disk"``, in a file-backed tensor under
    ``kv_offloading_dir`` (or a temporary directory removed by :meth:`close` or at exit).
    """

    swap: list[torch.Tensor] = attrs.field(factory=list)
    offload: list[torch.Tensor] = attrs.field(factory=list)
    num_swap_blocks: int = 0
    num_offload_blocks: int = 0
    path: str | None = None  # the offload tier's file (disk backend)
    _tempdir: Any = attrs.field(default=None, repr=False)

    def pool(self, name: str) -> tuple[list[torch.Tensor], int]:
        """A host pool's tensors and block count (``"swap"`` or ``"offload"``)."""
        if name == "swap":
            return self.swap, self.num_swap_blocks
        return self.offload, self.num_offload_blocks

    def close(self) -> None:
        """Drop the tensors; remove the temporary directory of a disk tier."""
        self.swap, self.offload = [], []
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None


def allocate_host_kv_caches(
    backend: Any,
    layout: Any,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    num_swap_blocks: int,
    num_offload_blocks: int,
    offload_backend: str = "cpu",
    offload_dir: str | None = None,
    rank: int = 0,
) -> HostKVCaches:
    """Host tensors for ``num_swap_blocks`` swap blocks and ``num_offload_blocks`` offload
    blocks (each may be 0), in ``backend``'s layout; pinned when ``device`` is CUDA."""
    check_block_layout(backend, layout, block_size)
    pin = device.type == "cuda"
    host = HostKVCaches(num_swap_blocks=num_swap_blocks, num_offload_blocks=num_offload_blocks)

    def shape(n: int) -> tuple[int, ...]:
        return tuple(backend.kv_cache_shape(n, block_size, layout.num_kv_heads, layout.head_dim))

    if num_swap_blocks:
        # Never read before written (only swapped-out blocks are copied back): no zeroing.
        host.swap = [
            torch.empty(shape(num_swap_blocks), dtype=dtype, pin_memory=pin)
            for _ in range(layout.num_layers)
        ]
    if num_offload_blocks and offload_backend == "disk":
        import os
        import tempfile

        directory = offload_dir
        if directory is None:
            host._tempdir = tempfile.TemporaryDirectory(prefix="llmlab-kv-offload-")
            directory = host._tempdir.name
        os.makedirs(directory, exist_ok=True)
        host.path = os.path.join(directory, f"kv-offload-rank{rank}-{os.getpid()}.bin")
        per_layer = math.prod(shape(num_offload_blocks))
        flat = torch.from_file(
            host.path, shared=True, size=per_layer * layout.num_layers, dtype=dtype
        )
        host.offload = list(flat.view(layout.num_layers, *shape(num_offload_blocks)).unbind(0))
    elif num_offload_blocks:
        host.offload = [
            torch.empty(shape(num_offload_blocks), dtype=dtype, pin_memory=pin)
            for _ in range(layout.num_layers)
        ]
    return host

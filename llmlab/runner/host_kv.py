"""Wiring swap preemption and the KV offload tier into an engine (the builder's part).

The settings (``EngineConfig``: ``preemption_mode``, ``swap_space``, ``kv_offloading_size``,
``kv_offloading_backend``, ``kv_offloading_dir``, ``kv_offloading_eviction_policy``) become

* on each rank, host KV tensors next to the device ones (``HostKVCaches``: GiB -> blocks
  at the bytes one block takes across layers; the smallest count of any tensor-parallel
  rank, so one scheduler's block ids fit every rank's pools), held by the model runner,
  which applies each batch's ``kv_transfers`` to them;
* on the scheduler's side, the bookkeeping of the same pools (``SwapSpace``,
  ``OffloadTier`` in ``llmlab.cache.host_pools``) inside the ``KVCacheManager``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from llmlab.cache.eviction import EvictionPolicy, LRUEviction
from llmlab.cache.host_pools import OffloadTier, SwapSpace
from llmlab.cache.kv_tensors import (
    copy_blocks_between,
    HostKVCaches,
    allocate_host_kv_caches,
    bytes_per_block,
    check_block_layout,
    num_host_blocks,
)
from llmlab.config import EngineConfig

logger = logging.getLogger(__name__)


def offloading(cfg: EngineConfig) -> bool:
    return bool(cfg.kv_offloading_size)


def swapping(cfg: EngineConfig) -> bool:
    return cfg.preemption_mode == "swap" and cfg.swap_space > 0


def check_host_kv_settings(cfg: EngineConfig) -> None:
    """Refuse contradictory settings before any weight loads (``ValueError`` naming them)."""
    if offloading(cfg) and not cfg.enable_prefix_caching:
        raise ValueError(
            f"kv_offloading_size={cfg.kv_offloading_size} is a second tier of the prefix "
            "cache, but enable_prefix_caching=False; turn prefix caching on or leave "
            "kv_offloading_size unset"
        )
    if cfg.kv_offloading_dir is not None and cfg.kv_offloading_backend != "disk":
        raise ValueError(
            f"kv_offloading_dir={cfg.kv_offloading_dir!r} is for "
            f"kv_offloading_backend='disk', but the backend is {cfg.kv_offloading_backend!r}"
        )
    if offloading(cfg) and cfg.kv_offloading_dir is not None:
        path = cfg.kv_offloading_dir
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"kv_offloading_dir={path!r} exists and is not a directory")


def host_kv_for(cfg: EngineConfig, attention: Any, layout: Any, dtype: torch.dtype,
                device: torch.device, tp: Any = None) -> HostKVCaches | None:
    """The runner's host KV pools when the config asks for any (swap space, the offload
    tier), else None."""
    if not (swapping(cfg) or offloading(cfg)):
        return None
    check_block_layout(attention, layout, cfg.block_size)
    per_block = bytes_per_block(layout, cfg.block_size, dtype)
    counts = [
        num_host_blocks(cfg.swap_space, layout, cfg.block_size, dtype) if swapping(cfg) else 0,
        num_host_blocks(cfg.kv_offloading_size, layout, cfg.block_size, dtype),
    ]
    if tp is not None and tp.is_parallel:
        agreed = torch.tensor(counts, dtype=torch.int64, device=device)
        counts = [int(n) for n in tp.all_reduce_min(agreed).tolist()]
    for field, size, n in (("swap_space", cfg.swap_space if swapping(cfg) else 0, counts[0]),
                           ("kv_offloading_size", cfg.kv_offloading_size, counts[1])):
        if size and n == 0:
            raise ValueError(
                f"{field}={size} GiB holds no KV block (one block of {cfg.block_size} tokens "
                f"takes {per_block} bytes across the layers); raise it"
            )
    host_kv = allocate_host_kv_caches(
        attention, layout, cfg.block_size, dtype, device,
        num_swap_blocks=counts[0], num_offload_blocks=counts[1],
        offload_backend=cfg.kv_offloading_backend, offload_dir=cfg.kv_offloading_dir,
        rank=0 if tp is None else tp.rank,
    )
    logger.info("host KV pools: %d swap blocks, %d offload blocks (%s)",
                counts[0], counts[1], cfg.kv_offloading_backend)
    return host_kv


def host_pools(host_kv: HostKVCaches | None,
               offload_eviction: EvictionPolicy | None) -> dict[str, Any]:
    """The KV cache manager's ``swap`` and ``tier`` for the runner's host pools."""
    if host_kv is None:
        return {}
    pools: dict[str, Any] = {}
    if host_kv.num_swap_blocks:
        pools["swap"] = SwapSpace(host_kv.num_swap_blocks)
    if host_kv.num_offload_blocks:
        pools["tier"] = OffloadTier(
            host_kv.num_offload_blocks, eviction=offload_eviction or LRUEviction()
        )
    return pools


def apply_transfers(runner: Any, transfers: Sequence[Any]) -> None:
    """Move KV blocks between the runner's device cache and its host pools, in batch order
    (outside any CUDA graph: a replayed decode reads the blocks afterwards)."""
    for transfer in transfers:
        if transfer.kind == "copy":
            runner.attention.copy_blocks(runner.kv_caches, list(transfer.blocks),
                                         runner.block_size)
            continue
        src, src_blocks = _kv_pool(runner, transfer.source)
        dst, dst_blocks = _kv_pool(runner, transfer.destination)
        copy_blocks_between(src, src_blocks, dst, dst_blocks, transfer.blocks)


def _kv_pool(runner: Any, name: str) -> tuple[list[torch.Tensor], int]:
    if name == "device":
        return runner.kv_caches, runner.num_kv_blocks
    host_kv = runner.host_kv
    tensors, num_blocks = (None, 0) if host_kv is None else host_kv.pool(name)
    if not tensors:
        raise ValueError(
            f"the batch moves KV blocks to or from the {name!r} host pool, which this "
            "runner does not have (preemption_mode='swap' / kv_offloading_size)"
        )
    return tensors, num_blocks

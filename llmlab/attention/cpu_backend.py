"""Paged attention on CPU in C++: reads each sequence's K/V where the block table says.

The torch reference (:mod:`llmlab.attention.torch_backend`) must gather a sequence's
context out of the paged cache into a dense copy before ``scaled_dot_product_attention``
can read it, which on CPU costs more than the attention itself; its decode mirror avoids
that only while the mirror fits. This backend calls :mod:`llmlab.kernels.cpu_kernels`
instead: one call per layer writes the new tokens' K/V to their slots and attends, every
(sequence, KV head, tile of query tokens) reading its context block by block through the
block table, once for all query heads that share the KV head (GQA folded), with an online
softmax. Decode, chunked prefill and prefill over a cached prefix are the same loop.

KV layout per layer: ``[2, num_kv_heads, num_blocks, block_size * head_dim]``; each block
of values holds ``block_size`` rows of ``head_dim``, each block of keys the same numbers
transposed (``head_dim`` rows of ``block_size``), so the kernel scores 16 keys per vector
instruction without a horizontal sum per key. Flat slot ``block * block_size + offset``
names a token, as in every backend. Float32 and bfloat16; head dims 64 and 128 with block
sizes that are multiples of 16 take the vector path, everything else a scalar one.
"""

from __future__ import annotations

import ctypes

import attrs
import numpy as np
import torch

from llmlab.attention.backend import AttentionInputs
from llmlab.kernels import cpu_kernels

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def cpu_kernels_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why :class:`CpuPagedAttention` cannot run (on ``device``), or None if it can."""
    if device is not None and device.type != "cpu":
        return f"it runs on CPU only, not {device}"
    return cpu_kernels.unavailable_reason()


def slot_rows(kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """A copy of one layer's cache in the torch backend's layout, ``[2, num_kv_heads,
    num_slots, head_dim]`` (for tests and inspection)."""
    _, heads, blocks, cells = kv_cache.shape
    head_dim = cells // block_size
    keys = kv_cache[0].view(heads, blocks, head_dim, block_size).transpose(2, 3)
    values = kv_cache[1].view(heads, blocks, block_size, head_dim)
    return torch.stack([keys, values]).reshape(2, heads, blocks * block_size, head_dim)


def from_slot_rows(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """The inverse of :func:`slot_rows`: a torch-layout cache in this backend's layout."""
    _, heads, slots, head_dim = rows.shape
    blocks = rows.view(2, heads, slots // block_size, block_size, head_dim)
    keys = blocks[0].transpose(2, 3).reshape(heads, slots // block_size, -1)
    values = blocks[1].reshape(heads, slots // block_size, -1)
    return torch.stack([keys, values]).contiguous()


def _slot_views(kv_cache: torch.Tensor, slots: torch.Tensor, block_size: int):
    """Views of one layer's keys ``[heads, blocks, head_dim, block_size]`` (stored
    transposed) and values ``[heads, blocks, block_size, head_dim]``, and the (head, block,
    offset) index of each slot."""
    heads, blocks, cells = kv_cache.shape[1:]
    head_dim = cells // block_size
    keys = kv_cache[0].view(heads, blocks, head_dim, block_size)
    values = kv_cache[1].view(heads, blocks, block_size, head_dim)
    slots = slots if slots.dim() == 2 else slots[None, :].expand(heads, -1)
    return keys, values, torch.arange(heads)[:, None], slots // block_size, slots % block_size


@attrs.define(eq=False)
class CpuAttentionMetadata:
    """One step's batch as the kernel reads it (the tensors stay referenced here for as
    long as the ``step`` structure points into them)."""

    step: cpu_kernels._Step
    arrays: tuple  # the int64 buffers ``step`` points to


@attrs.define
class CpuPagedAttention:
    """Paged attention through llmlab's C++ CPU kernels (see the module docstring).

    ``attention_backend="auto"`` picks it on CPU for float32 and bfloat16 models whenever
    the kernels load; otherwise the torch backend runs, with a warning saying why.
    """

    name: str = "cpu"

    def check_device(self, device: torch.device) -> None:
        """Raise ``ValueError`` before any weight loads if this backend cannot run."""
        reason = cpu_kernels_unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"attention_backend='cpu' cannot run: {reason}; use 'torch'")

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in DTYPE_CODES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
            raise ValueError(
                f"attention_backend='cpu' supports dtype {allowed}, not "
                f"{str(dtype).removeprefix('torch.')}; use attention_backend='torch'"
            )

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size * head_dim)

    def copy_blocks(
        self, kv_caches: list[torch.Tensor], copies: list[tuple[int, int]], block_size: int
    ) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (keys and values)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies])
        dst = torch.tensor([d for _, d in copies])
        for cache in kv_caches:
            cache.index_copy_(2, dst, cache.index_select(2, src))

    def gather_slots(self, kv_cache: torch.Tensor, slots: torch.Tensor, block_size: int):
        """One layer's keys and values ``[num_kv_heads, n, head_dim]`` at flat ``slots``
        (``[n]``, or ``[num_kv_heads, n]`` per head): KV presses read them."""
        keys, values, heads, blocks, offsets = _slot_views(kv_cache, slots, block_size)
        # Advanced indices around a slice: the indexed dims come first, then head_dim.
        return keys[heads, blocks, :, offsets], values[heads, blocks, offsets]

    def scatter_slots(self, kv_cache, slots, keys, values, block_size: int) -> None:
        """Write ``[num_kv_heads, n, head_dim]`` keys and values to flat ``slots``."""
        key_view, value_view, heads, blocks, offsets = _slot_views(kv_cache, slots, block_size)
        key_view[heads, blocks, :, offsets] = keys.to(kv_cache.dtype)
        value_view[heads, blocks, offsets] = values.to(kv_cache.dtype)

    def build_metadata(self, inputs: AttentionInputs) -> CpuAttentionMetadata:
        kernels = cpu_kernels.load()
        if kernels is None:
            raise RuntimeError(
                f"llmlab's CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}"
            )
        query_lens = np.asarray(inputs.query_lens, dtype=np.int64)
        seq_lens = np.asarray(inputs.seq_lens, dtype=np.int64)
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        # Work items: (sequence, first query of a tile), the tiles that see the most keys
        # first so the dynamic schedule does not end on one long tile.
        if (query_lens == 1).all():  # all decodes: one tile per sequence
            items = np.zeros((len(query_lens), 2), dtype=np.int64)
            items[:, 0] = np.argsort(-seq_lens, kind="stable")
        else:
            tile = kernels.tile_q
            tiles = -(-query_lens // tile)
            seq = np.repeat(np.arange(len(query_lens), dtype=np.int64), tiles)
            tile_start = np.repeat(np.cumsum(tiles) - tiles, tiles)
            first = (np.arange(len(seq), dtype=np.int64) - tile_start) * tile
            last_key = seq_lens[seq] - query_lens[seq] + np.minimum(first + tile, query_lens[seq])
            order = np.argsort(-last_key, kind="stable")
            items = np.ascontiguousarray(np.stack([seq[order], first[order]], axis=1))
        tables = inputs.block_tables.to(torch.int64).contiguous()
        slots = inputs.slot_mapping.to(torch.int64).contiguous()
        step = cpu_kernels._Step(
            query_start=query_start.ctypes.data,
            seq_lens=seq_lens.ctypes.data,
            block_tables=tables.data_ptr(),
            slot_mapping=slots.data_ptr(),
            items=items.ctypes.data,
            table_stride=tables.shape[1],
            num_seqs=len(query_lens),
            num_tokens=slots.shape[0],
            num_items=items.shape[0],
            block_size=inputs.block_size,
            num_threads=torch.get_num_threads(),
        )
        return CpuAttentionMetadata(step, (query_start, seq_lens, items, tables, slots))

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        code = DTYPE_CODES.get(q.dtype)
        if code is None or kv_cache.dtype != q.dtype:
            raise TypeError(
                f"the CPU attention kernel takes float32 or bfloat16 queries and a cache of "
                f"the same dtype, got q {q.dtype} and kv_cache {kv_cache.dtype}"
            )
        if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            raise ValueError("the CPU attention kernel needs a contiguous CPU kv_cache")
        # The kernel reads head_dim contiguously; any token and head strides will do.
        q = q if q.stride(-1) == 1 else q.contiguous()
        k = k.to(q.dtype) if k.dtype != q.dtype else k
        v = v.to(q.dtype) if v.dtype != q.dtype else v
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        block_size = metadata.step.block_size
        if kv_cache.shape[3] != block_size * q.shape[2] or q.shape[1] % kv_cache.shape[1]:
            raise ValueError(
                f"kv_cache {tuple(kv_cache.shape)} does not fit block_size {block_size}, "
                f"{q.shape[1]} query heads of {q.shape[2]} channels"
            )
        num_heads, head_dim = q.shape[1], q.shape[2]
        out = torch.empty((q.shape[0], num_heads, head_dim), dtype=q.dtype)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        layer = cpu_kernels._Layer(
            q=q.data_ptr(),
            q_token_stride=q.stride(0),
            q_head_stride=q.stride(1),
            k=k.data_ptr(),
            k_token_stride=k.stride(0),
            k_head_stride=k.stride(1),
            v=v.data_ptr(),
            v_token_stride=v.stride(0),
            v_head_stride=v.stride(1),
            key_cache=key_cache.data_ptr(),
            value_cache=value_cache.data_ptr(),
            cache_head_stride=key_cache.stride(0),
            # The kernel checks every block id, slot and length against this (and the
            # batch): a bad batch is an IndexError, never a read out of bounds.
            num_blocks=key_cache.shape[1],
            out=out.data_ptr(),
            num_heads=num_heads,
            num_kv_heads=key_cache.shape[0],
            head_dim=head_dim,
            scale=scale,
            sliding_window=sliding_window or 0,
        )
        kernels = cpu_kernels.load()
        status = kernels.paged_attention(code, ctypes.byref(metadata.step), ctypes.byref(layer))
        if status == -2:
            raise IndexError(
                f"attention batch does not fit the KV cache ({key_cache.shape[1]} blocks of "
                f"{block_size}): a block id or slot outside it, or inconsistent lengths (every "
                "sequence needs 1 <= new tokens <= context <= block table width * block_size)"
            )
        if status != 0:
            raise RuntimeError(f"the CPU attention kernel failed with status {status}")
        return out

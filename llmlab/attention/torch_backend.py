"""Paged attention in plain torch: the reference backend, correct on CPU and CUDA.

KV layout per layer: ``[2, num_kv_heads, num_blocks * block_size, head_dim]``, i.e. each KV
head keeps its own paged store of ``head_dim`` rows. Gathering a sequence's context with
``index_select`` along the slot axis then yields one contiguous ``[context, head_dim]``
slab per (sequence, head), which is what ``scaled_dot_product_attention`` reads fastest;
``index_select`` copies whole rows, several times faster on CPU than advanced indexing.

Per step, ``build_metadata`` splits the batch into a decode group (one new token per
sequence) and a prefill group (several), because padding decodes to the longest prefill
chunk would multiply their cost. For each group it precomputes, once for all layers:

* which flat tokens are each sequence's queries (padded to the group's longest query),
* the flat KV slots of each sequence's whole context, read through its block table,
* the boolean mask: key ``j`` is visible to the query at position ``p`` iff ``j <= p``.

``forward`` then writes the layer's new K/V by slot mapping, gathers the context and runs
``scaled_dot_product_attention`` once per group.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from llmlab.attention.backend import AttentionInputs, token_slots
from llmlab.attention.decode_mirror import DecodeMirror, MirrorPlan, additive_mask


def paged_kv_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """One layer's KV tensor: keys and values, each a paged store of rows per KV head."""
    return (2, num_kv_heads, num_blocks * block_size, head_dim)


def copy_kv_blocks(
    kv_caches: list[torch.Tensor], copies: list[tuple[int, int]], block_size: int
) -> None:
    """Copy whole blocks ``src -> dst`` in every layer (keys and values) of the
    :func:`paged_kv_shape` layout."""
    if not copies:
        return
    offsets = torch.arange(block_size)
    src = torch.tensor([s for s, _ in copies])[:, None] * block_size + offsets
    dst = torch.tensor([d for _, d in copies])[:, None] * block_size + offsets
    for cache in kv_caches:
        src_slots = src.reshape(-1).to(cache.device)
        dst_slots = dst.reshape(-1).to(cache.device)
        cache.index_copy_(2, dst_slots, cache.index_select(2, src_slots))


def gather_kv_slots(
    kv_cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[num_kv_heads, n, head_dim]`` of one layer's flat ``slots``
    (``[n]``, or ``[num_kv_heads, n]`` per head) in the :func:`paged_kv_shape` layout."""
    if slots.dim() == 1:
        return kv_cache[0].index_select(1, slots), kv_cache[1].index_select(1, slots)
    heads = torch.arange(kv_cache.shape[1], device=slots.device)[:, None]
    return kv_cache[0][heads, slots], kv_cache[1][heads, slots]


def scatter_kv_slots(
    kv_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Write ``keys`` and ``values`` (``[num_kv_heads, n, head_dim]``) to one layer's flat
    ``slots`` (``[n]`` for every head, or ``[num_kv_heads, n]``)."""
    heads = torch.arange(kv_cache.shape[1], device=slots.device)[:, None]
    slots = slots if slots.dim() == 2 else slots[None, :]
    kv_cache[0][heads, slots] = keys.to(kv_cache.dtype)
    kv_cache[1][heads, slots] = values.to(kv_cache.dtype)


@attrs.frozen
class _Group:
    is_decode: bool
    query_index: torch.Tensor  # [B, Q] flat token index of each query (padding repeats one)
    # Context gather (None when the decode mirror serves this group):
    key_slots: torch.Tensor | None  # [B * C] flat KV slot of each context position
    mask: torch.Tensor | None  # [B, 1, Q, C] True where the key is visible
    query_pos: torch.Tensor | None  # [B, Q] absolute position of each query
    valid: torch.Tensor | None  # [B * Q] rows that are real queries (None: all are)
    out_index: torch.Tensor  # flat token index of each real query, in row order
    masks: dict = attrs.field(factory=dict)  # (sliding_window, dtype) -> additive mask

    @property
    def shape(self) -> tuple[int, int, int]:
        batch, max_q = self.query_index.shape
        return batch, max_q, self.mask.shape[-1]

    def mask_for(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (0 visible, -inf hidden), built once per step and reused by layers."""
        key = (sliding_window, dtype)
        cached = self.masks.get(key)
        if cached is None:
            visible = self.mask
            if sliding_window is not None:
                key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
                in_window = (self.query_pos[:, :, None] - key_pos) < sliding_window
                visible = visible & in_window[:, None]
            cached = additive_mask(visible, dtype)
            self.masks[key] = cached
        return cached


@attrs.frozen
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    groups: tuple[_Group, ...]
    mirror: DecodeMirror | None = None
    # Set when the decode group attends through the mirror instead of gathering.
    mirror_plan: MirrorPlan | None = None


def _build_group(
    seq_ids: list[int],
    inputs: AttentionInputs,
    query_start: list[int],
    is_decode: bool,
    gathers: bool = True,
) -> _Group:
    device = inputs.device
    bs = inputs.block_size
    starts = torch.tensor([query_start[s] for s in seq_ids], dtype=torch.long)
    if not gathers:  # decodes served by the mirror: only where the queries are
        index = starts.to(device)
        return _Group(is_decode, index[:, None], None, None, None, None, index)
    q_lens = torch.tensor([inputs.query_lens[s] for s in seq_ids], dtype=torch.long)
    ctx_lens = torch.tensor([inputs.seq_lens[s] for s in seq_ids], dtype=torch.long)
    max_q = int(q_lens.max())
    max_ctx = int(ctx_lens.max())

    table = inputs.block_tables[torch.tensor(seq_ids, dtype=torch.long)]
    key_pos = torch.arange(max_ctx)
    key_slots = token_slots(table, torch.arange(len(seq_ids))[:, None], key_pos[None, :], bs)
    key_valid = key_pos[None, :] < ctx_lens[:, None]
    # Padding keys point at the sequence's first slot, which is always written, so no
    # uninitialised memory is ever read (0 * NaN would poison the output).
    key_slots = torch.where(key_valid, key_slots, key_slots[:, :1])

    q_offsets = torch.arange(max_q)
    q_valid = q_offsets[None, :] < q_lens[:, None]
    query_index = torch.where(q_valid, starts[:, None] + q_offsets, starts[:, None])
    query_pos = (ctx_lens - q_lens)[:, None] + q_offsets[None, :]
    # Padding query rows get positions past the end, so they see every real key and
    # never produce an all-masked (NaN) row; their outputs are dropped.
    mask = key_valid[:, None, :] & (key_pos[None, None, :] <= query_pos[:, :, None])

    all_valid = bool(q_valid.all())
    return _Group(
        is_decode=is_decode,
        query_index=query_index.to(device),
        key_slots=key_slots.reshape(-1).to(device),
        mask=mask[:, None].to(device),
        query_pos=query_pos.to(device),
        valid=None if all_valid else q_valid.reshape(-1).to(device),
        out_index=query_index[q_valid].to(device),
    )


# A prefill group may pad its attention work (rows x columns) up to this factor of the
# real work before a new group starts: one SDPA call per group costs little, padding a
# 16-token prompt to a 256-token one costs 16x.
_MAX_PADDING_FACTOR = 1.5


def _length_buckets(
    seq_ids: list[int], query_lens: list[int], seq_lens: list[int]
) -> list[list[int]]:
    """Split prefill sequences into groups of similar size, largest first."""
    ordered = sorted(seq_ids, key=lambda s: (seq_lens[s], query_lens[s]), reverse=True)
    buckets: list[list[int]] = []
    padded_cell = real = 0
    for s in ordered:
        work = query_lens[s] * seq_lens[s]
        if buckets and (len(buckets[-1]) + 1) * padded_cell <= _MAX_PADDING_FACTOR * (real + work):
            buckets[-1].append(s)
            real += work
            continue
        # Sorted by length, so the first member sets the group's padded shape.
        buckets.append([s])
        padded_cell, real = work, work
    return buckets


@attrs.define
class TorchPagedAttention:
    """Reference paged attention built from gather + ``scaled_dot_product_attention``.

    Args:
        decode_mirror: on CPU, serve decodes from a dense per-row copy of their KV
            (:mod:`llmlab.attention.decode_mirror`) instead of gathering the context from
            the paged cache every layer and step. Ignored on other devices. The mirror is
            per-engine state (``create_state``), so one backend instance can serve several
            engines.
    """

    name: str = "torch"
    decode_mirror: bool = True

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return paged_kv_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def create_state(
        self, *, num_rows: int, num_slots: int, device: torch.device
    ) -> DecodeMirror | None:
        """The decode mirror on CPU (capped at the paged cache's ``num_slots``), else None."""
        if not self.decode_mirror or device.type != "cpu":
            return None
        return DecodeMirror(max_cells=num_slots)

    def copy_blocks(
        self, kv_caches: list[torch.Tensor], copies: list[tuple[int, int]], block_size: int
    ) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (keys and values)."""
        copy_kv_blocks(kv_caches, copies, block_size)

    def gather_slots(self, kv_cache: torch.Tensor, slots: torch.Tensor, block_size: int):
        """One layer's keys and values at flat ``slots`` (KV presses read them)."""
        return gather_kv_slots(kv_cache, slots)

    def scatter_slots(self, kv_cache, slots, keys, values, block_size: int) -> None:
        """Write keys and values to flat ``slots`` (a KV press's compaction)."""
        scatter_kv_slots(kv_cache, slots, keys, values)

    def build_metadata(self, inputs: AttentionInputs) -> TorchAttentionMetadata:
        query_start = [0]
        for n in inputs.query_lens:
            query_start.append(query_start[-1] + n)
        decodes = [i for i, n in enumerate(inputs.query_lens) if n == 1]
        prefills = [i for i, n in enumerate(inputs.query_lens) if n > 1]
        plan = None
        mirror = inputs.state if isinstance(inputs.state, DecodeMirror) else None
        if mirror is not None and decodes and inputs.device.type == "cpu":
            plan = mirror.plan(
                [inputs.rows[i] for i in decodes],
                [inputs.seq_lens[i] for i in decodes],
                inputs.block_tables[torch.tensor(decodes, dtype=torch.long)],
                inputs.block_size,
                inputs.device,
            )
        groups = []
        if decodes:
            groups.append(_build_group(decodes, inputs, query_start, True, plan is None))
        for bucket in _length_buckets(prefills, inputs.query_lens, inputs.seq_lens):
            groups.append(_build_group(bucket, inputs, query_start, False))
        return TorchAttentionMetadata(inputs.slot_mapping, tuple(groups), mirror, plan)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [Hkv, slots, D]
        key_cache.index_copy_(1, metadata.slot_mapping, k.transpose(0, 1).to(key_cache.dtype))
        value_cache.index_copy_(1, metadata.slot_mapping, v.transpose(0, 1).to(value_cache.dtype))

        _, num_heads, head_dim = q.shape
        num_kv_heads = key_cache.shape[0]
        group_size = num_heads // num_kv_heads
        out = torch.empty_like(q)
        for group in metadata.groups:
            if group.is_decode and metadata.mirror_plan is not None:
                batch = group.query_index.shape[0]
                tokens = group.query_index[:, 0]
                attended = metadata.mirror.attend(
                    layer_idx,
                    metadata.mirror_plan,
                    q[tokens].view(batch, num_kv_heads, group_size, head_dim),
                    k[tokens],
                    v[tokens],
                    key_cache,
                    value_cache,
                    scale=scale,
                    sliding_window=sliding_window,
                )
                out[group.out_index] = attended.reshape(batch, num_heads, head_dim)
                continue
            batch, _, max_ctx = group.shape
            # [Hkv, B * C, D] -> [B, Hkv, C, D]; each (sequence, head) slab is contiguous.
            keys = key_cache.index_select(1, group.key_slots).to(q.dtype)
            keys = keys.view(num_kv_heads, batch, max_ctx, head_dim).transpose(0, 1)
            values = value_cache.index_select(1, group.key_slots).to(q.dtype)
            values = values.view(num_kv_heads, batch, max_ctx, head_dim).transpose(0, 1)
            mask = group.mask_for(sliding_window, q.dtype)
            if group.is_decode:
                # One query per sequence: fold the query heads sharing a KV head into the
                # query axis, so GQA needs no copy of K/V.
                queries = q[group.query_index[:, 0]].view(batch, num_kv_heads, group_size, head_dim)
                attended = F.scaled_dot_product_attention(
                    queries, keys, values, attn_mask=mask, scale=scale
                )
                out[group.out_index] = attended.reshape(batch, num_heads, head_dim)
                continue
            queries = q[group.query_index].transpose(1, 2)  # [B, H, Q, D]
            attended = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=group_size > 1
            )
            rows = attended.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [B * Q, H, D]
            if group.valid is not None:
                rows = rows[group.valid]
            out[group.out_index] = rows
        return out

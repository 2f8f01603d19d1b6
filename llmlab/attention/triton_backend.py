"""The Triton paged-attention backend: kernels that read the paged KV cache in place.

Where the torch reference gathers every sequence's context into a contiguous copy per layer
(``index_select``) and pads a batch to its longest member, this backend reads K/V tile by
tile straight from the block table (:mod:`llmlab.kernels.triton_kernels`) and runs on the
ragged batch as it is. Per step, :meth:`TritonPagedAttention.build_metadata` turns the batch
into a few int32 device tensors (cumulative query offsets, context lengths, block tables)
and two program lists: one program per decode (one query token, every query head of a KV
head), and one per ``block_q`` query tokens of each prefill chunk. Each layer's
``forward`` then costs one KV-write launch and one attention launch per list (plus a
reduction when decodes are split).

The KV layout is the torch backend's (``[2, num_kv_heads, num_slots, head_dim]``), so the
two backends' caches are interchangeable and ``copy_blocks`` is shared.

On CPU the kernels run in Triton's interpreter, which is for testing: it is thousands of
times slower than the torch backend, so it must be asked for with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import torch

from llmlab.attention.backend import AttentionInputs
from llmlab.attention.torch_backend import (
    copy_kv_blocks,
    gather_kv_slots,
    paged_kv_shape,
    scatter_kv_slots,
)


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device`` (None when it can)."""
    try:
        import triton  # noqa: F401
    except Exception as err:  # noqa: BLE001 - ImportError, or a broken install raising anything
        return f"triton cannot be imported ({type(err).__name__}: {err})"
    from llmlab.kernels.triton_kernels import interpreting

    if interpreting():
        if device.type == "cpu":
            return None
        return f"Triton's interpreter (TRITON_INTERPRET=1) runs on CPU tensors, not {device.type!r}"
    if device.type == "cuda":
        return None
    return (
        f"the Triton kernels need a CUDA device (device is {device.type!r}); to run them in "
        "Triton's interpreter (slow: for testing) set TRITON_INTERPRET=1 before starting "
        "Python; or use attention_backend='torch'"
    )


# What the kernels compile for; "auto" picks the torch reference for anything else.
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@attrs.define(eq=False)
class _Programs:
    """One launch's programs: sequence and first query token of each."""

    seq: torch.Tensor
    first_q: torch.Tensor
    block_q: int

    @property
    def count(self) -> int:
        return int(self.seq.shape[0])


@attrs.define(eq=False)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start: torch.Tensor  # [num_seqs + 1] int32
    block_size: int
    query_lens: np.ndarray
    seq_lens_host: np.ndarray
    decode_seqs: np.ndarray  # batch indices of one-token queries
    prefill_seqs: np.ndarray  # the others
    device: torch.device
    # Built on first use (they depend on the layer's head counts) and shared by the rest.
    launches: dict = attrs.field(factory=dict)


def _int32(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32)).to(device)


@attrs.define
class TritonPagedAttention:
    """Paged attention in Triton kernels (CUDA; Triton's interpreter on CPU for tests).

    Args:
        tile_n: keys per inner-loop tile.
        prefill_rows: (query token, head) rows per prefill program.
        min_split_context: decodes are split (flash-decoding) only when the longest
            context reaches this many tokens ...
        tokens_per_split: ... and each piece keeps at least this many keys ...
        max_splits: ... and at most this many pieces (a power of two).
        target_programs: programs that fill the device (default: 4 per SM on CUDA,
            64 elsewhere); decodes are split until the grid reaches it.
        dot_f32: run both products in float32 (default: for float32 inputs and in the
            interpreter; 16-bit inputs on CUDA use the tensor cores).
    """

    name: str = "triton"
    tile_n: int = 32
    prefill_rows: int = 64
    min_split_context: int = 1024
    tokens_per_split: int = 256
    max_splits: int = 16
    target_programs: int | None = None
    dot_f32: bool | None = None

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return paged_kv_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def copy_blocks(
        self, kv_caches: list[torch.Tensor], copies: list[tuple[int, int]], block_size: int
    ) -> None:
        copy_kv_blocks(kv_caches, copies, block_size)

    def gather_slots(self, kv_cache: torch.Tensor, slots: torch.Tensor, block_size: int):
        """One layer's keys and values at flat ``slots`` (the torch backend's layout)."""
        return gather_kv_slots(kv_cache, slots)

    def scatter_slots(self, kv_cache, slots, keys, values, block_size: int) -> None:
        """Write keys and values to flat ``slots`` (a KV press's compaction)."""
        scatter_kv_slots(kv_cache, slots, keys, values)

    def check_device(self, device: torch.device) -> None:
        """Raise ``ValueError`` when the kernels cannot run on ``device``."""
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"attention_backend='triton' cannot run: {reason}")

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ``ValueError`` for a dtype the kernels do not compile for (float64: the
        softmax state is float32, and Triton refuses a loop whose carried types change)."""
        if dtype not in TRITON_DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in TRITON_DTYPES)
            raise ValueError(
                f"attention_backend='triton' supports dtype {allowed}, not "
                f"{str(dtype).removeprefix('torch.')}; use attention_backend='torch'"
            )

    def build_metadata(self, inputs: AttentionInputs) -> TritonAttentionMetadata:
        device = inputs.device
        query_lens = np.asarray(inputs.query_lens, dtype=np.int64)
        seq_lens = np.asarray(inputs.seq_lens, dtype=np.int64)
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        return TritonAttentionMetadata(
            slot_mapping=inputs.slot_mapping.to(device),
            block_tables=inputs.block_tables.to(device=device, dtype=torch.int32),
            seq_lens=_int32(seq_lens, device),
            query_start=_int32(query_start, device),
            block_size=inputs.block_size,
            query_lens=query_lens,
            seq_lens_host=seq_lens,
            decode_seqs=np.flatnonzero(query_lens == 1),
            prefill_seqs=np.flatnonzero(query_lens > 1),
            device=device,
        )

    def decode_graph_metadata(
        self,
        *,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start: torch.Tensor,
        block_size: int,
        max_context: int,
    ) -> TritonAttentionMetadata:
        """Metadata over caller-owned static tensors for a batch of decodes, one per row,
        to be captured in a CUDA graph and replayed with new contents.

        Rows past the real batch are padding: slot -1 (nothing written) and context 0
        (nothing read; the output row is 0). The split count is fixed at capture, sized
        for ``max_context``; the kernel divides each row's actual context evenly anyway.
        """
        rows = int(seq_lens.shape[0])
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start=query_start,
            block_size=block_size,
            query_lens=np.ones(rows, dtype=np.int64),
            seq_lens_host=np.full(rows, max_context, dtype=np.int64),
            decode_seqs=np.arange(rows),
            prefill_seqs=np.arange(0),
            device=seq_lens.device,
        )

    def num_splits(self, programs: int, max_ctx: int, device: torch.device) -> int:
        """Pieces per decode context: enough to fill the device, each long enough to pay."""
        if max_ctx < self.min_split_context or programs <= 0:
            return 1
        target = self.target_programs
        if target is None:
            target = 64
            if device.type == "cuda":
                target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
        wanted = min(-(-target // programs), max_ctx // self.tokens_per_split, self.max_splits)
        return 1 << int(math.log2(wanted)) if wanted >= 1 else 1

    def launches(
        self, md: TritonAttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> list[tuple[_Programs, int, tuple[torch.Tensor, torch.Tensor] | None]]:
        """The step's kernel launches for a layer shape: ``(programs, num_splits,
        split scratch)`` for the decodes and for the prefill chunks; built by the first
        layer, shared by the rest."""
        key = (num_heads, num_kv_heads, head_dim)
        cached = md.launches.get(key)
        if cached is not None:
            return cached
        from llmlab.kernels.triton_kernels import block_q_for, split_scratch

        launches = []
        if md.decode_seqs.size:
            seqs = md.decode_seqs
            max_ctx = int(md.seq_lens_host[seqs].max())
            programs = _Programs(
                _int32(seqs, md.device), _int32(np.zeros_like(seqs), md.device), 1
            )
            splits = self.num_splits(programs.count * num_kv_heads, max_ctx, md.device)
            scratch = None
            if splits > 1:  # one buffer for all layers of the step
                scratch = split_scratch(programs.count, num_heads, splits, head_dim, md.device)
            launches.append((programs, splits, scratch))
        if md.prefill_seqs.size:
            seqs = md.prefill_seqs
            block_q = block_q_for(num_heads // num_kv_heads, self.prefill_rows)
            per_seq = -(-md.query_lens[seqs] // block_q)
            seq_of = np.repeat(seqs, per_seq)
            # Offset of each program within its sequence's run of programs.
            run_start = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
            first_q = (np.arange(seq_of.size) - run_start) * block_q
            programs = _Programs(_int32(seq_of, md.device), _int32(first_q, md.device), block_q)
            launches.append((programs, 1, None))
        md.launches[key] = launches
        return launches

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        from llmlab.kernels.triton_kernels import write_kv

        write_kv(k, v, kv_cache, metadata.slot_mapping)
        return self.attend_into(
            torch.empty_like(q), q, kv_cache, metadata, scale=scale, sliding_window=sliding_window
        )

    def attend_into(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Attention of every query in the batch into ``out`` (any float dtype), reading
        K/V already in ``kv_cache``; returns ``out``."""
        from llmlab.kernels.triton_kernels import paged_attention

        _, num_heads, head_dim = q.shape
        for programs, splits, scratch in self.launches(
            metadata, num_heads, kv_cache.shape[1], head_dim
        ):
            paged_attention(
                q,
                kv_cache,
                out,
                block_tables=metadata.block_tables,
                seq_lens=metadata.seq_lens,
                query_start=metadata.query_start,
                prog_seq=programs.seq,
                prog_q=programs.first_q,
                block_q=programs.block_q,
                block_size=metadata.block_size,
                scale=scale,
                sliding_window=sliding_window,
                num_splits=splits,
                dot_f32=self.dot_f32,
                tile_n=self.tile_n,
                scratch=scratch,
            )
        return out

"""The batched LoRA computation as two Triton kernels (SGMV-style shrink and expand).

Same update as :func:`llmlab.lora.ops.lora_update`, from tokens grouped by slot (``perm``) and
the segments of equal slot. The grid is ``(segment, block of its tokens, block of output
columns)``; a program past its segment's end returns at once, so one launch serves
segments of any length without the host reading them back (the host knows the longest).

* shrink: ``h[i] = x[perm[i]] @ A[slot]^T`` for every grouped token ``i`` (float32 ``h``);
* expand, once per slice of a fused projection: ``y[perm[i], slice] += h[i, slice's
  ranks] @ B[slot][:, slice]`` (B stored ``[R, out]``); each ``(token, column)`` belongs to
  exactly one program, so the read-add-write needs no atomics.

A program reads the weights of its own segment's slot only, and stores only its own
segment's rows (masked loads fill the tile's spare rows and columns with zeros; whatever
they compute is never stored), so one slot's values never enter another slot's tokens
(``tests/lora/test_isolation.py`` puts inf and NaN in one slot to check it).

Float32 inputs (and Triton's interpreter) multiply in IEEE float32; 16-bit inputs use the
tensor cores with float32 accumulation. On CPU they run only under ``TRITON_INTERPRET=1``
(how the tests check them against the torch op).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, perm_ptr, seg_start_ptr, seg_slot_ptr,
    K, N, stride_xm, stride_al, stride_an, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    m0 = start + tl.program_id(1) * BLOCK_M
    if m0 < end:
        slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
        rm = m0 + tl.arange(0, BLOCK_M)
        mask_m = rm < end
        tok = tl.load(perm_ptr + rm, mask=mask_m, other=0).to(tl.int64)
        rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mask_k = rk < K
            xt = tl.load(
                x_ptr + tok[:, None] * stride_xm + rk[None, :],
                mask=mask_m[:, None] & mask_k[None, :], other=0.0,
            )
            at = tl.load(
                a_ptr + slot * stride_al + rn[None, :] * stride_an + rk[:, None],
                mask=mask_k[:, None] & mask_n[None, :], other=0.0,
            )
            if IEEE:
                acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xt, at)
        tl.store(
            h_ptr + rm[:, None] * stride_hm + rn[None, :], acc,
            mask=mask_m[:, None] & mask_n[None, :],
        )


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, y_ptr, perm_ptr, seg_start_ptr, seg_slot_ptr,
    K, N, stride_hm, stride_bl, stride_bk, stride_bn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    m0 = start + tl.program_id(1) * BLOCK_M
    if m0 < end:
        slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
        rm = m0 + tl.arange(0, BLOCK_M)
        mask_m = rm < end
        tok = tl.load(perm_ptr + rm, mask=mask_m, other=0).to(tl.int64)
        rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mask_k = rk < K
            ht = tl.load(
                h_ptr + rm[:, None] * stride_hm + rk[None, :],
                mask=mask_m[:, None] & mask_k[None, :], other=0.0,
            )
            bt = tl.load(
                b_ptr + slot * stride_bl + rn[None, :] * stride_bn + rk[:, None] * stride_bk,
                mask=mask_k[:, None] & mask_n[None, :], other=0.0,
            )
            if IEEE:
                acc += tl.dot(ht, bt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(ht.to(bt.dtype), bt)
        mask = mask_m[:, None] & mask_n[None, :]
        y_at = y_ptr + tok[:, None] * stride_ym + rn[None, :]
        old = tl.load(y_at, mask=mask, other=0.0)
        tl.store(y_at, (old.to(tl.float32) + acc).to(old.dtype), mask=mask)


def sgmv_lora(
    x: torch.Tensor,
    y: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slices: Sequence[tuple[int, int]],
    perm: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_segment_len: int,
    num_lora_tokens: int,
) -> torch.Tensor:
    """Add each grouped token's adapter update to ``y`` in place (see the module).

    Args:
        x: ``[T, in]``; ``y``: ``[T, out]``, both row-major with unit column stride.
        lora_a: ``[slots, n R, in]`` (contiguous); ``lora_b``: ``[slots, R, out]`` (as
            :func:`llmlab.lora.ops.lora_update`).
        slices: ``(first output, size)`` of each of the ``n`` slices: one shrink for all,
            one expand launch per slice (on its own columns of ``h``, ``B`` and ``y``).
        perm: ``[num_lora_tokens]`` token indices grouped by slot (int32 or int64).
        seg_starts: ``[S + 1]`` segment offsets into ``perm``; ``seg_slots``: ``[S]``.
        max_segment_len: the longest segment (sizes the grid; known on the host).
    """
    num_segments = seg_slots.numel()
    if num_segments == 0 or num_lora_tokens == 0:
        return y
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("sgmv_lora needs x and y with unit column stride")
    width, in_features = lora_a.shape[1], lora_a.shape[2]
    rank = lora_b.shape[1]
    ieee = x.dtype == torch.float32 or not x.is_cuda
    h = torch.empty((num_lora_tokens, width), dtype=torch.float32, device=x.device)
    blocks_m = triton.cdiv(max_segment_len, BLOCK_M)
    _shrink_kernel[(num_segments, blocks_m, triton.cdiv(width, BLOCK_N))](
        x, lora_a, h, perm, seg_starts, seg_slots,
        in_features, width, x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=ieee,
    )
    for j, (first, size) in enumerate(slices):
        h_j = h[:, j * rank : (j + 1) * rank]
        b_j = lora_b[:, :, first : first + size]
        y_j = y[:, first : first + size]
        _expand_kernel[(num_segments, blocks_m, triton.cdiv(size, BLOCK_N))](
            h_j, b_j, y_j, perm, seg_starts, seg_slots,
            rank, size, h.stride(0), b_j.stride(0), b_j.stride(1), b_j.stride(2),
            y.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=ieee,
        )
    return y

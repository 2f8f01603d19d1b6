"""A Triton W4A16 GEMM for CUDA: 4-bit weights dequantized in registers, float32 accumulation.

``y[m, n] = sum_k x[m, k] * (q[n, k] - z[n, k // g]) * s[n, k // g]`` for the canonical
layout of :mod:`llmlab.kernels.int4`, repacked once by :func:`prepare`:

* ``qweight_t``: int32 ``[in // 8, out]``, eight consecutive input indices of one output
  channel per word (index ``k`` in bits ``4 * (k % 8)``), so a tile's words are read along
  the output axis, contiguous and coalesced (GPTQ's Triton kernels use this layout);
* ``scales_t``: float32 ``[in // g, out]``; ``zeros_t``: uint8 ``[in // g, out]``.

One program computes a ``BLOCK_M x BLOCK_N`` tile of ``y`` and walks ``K`` in steps of
``BLOCK_K`` that each lie inside one group (``BLOCK_K`` divides ``g``; per channel any step
does, the tail masked). Per step it loads a ``[BLOCK_K, BLOCK_N]`` tile of words, shifts and
masks out the nibbles, subtracts the zero point (an integer of magnitude <= 16: exact in
every activation dtype) and multiplies by the activation tile on the tensor cores
(``tl.dot``, float32 accumulation; float32 activations multiply in IEEE float32, not TF32).
The group's scale multiplies the step's partial product, once per output instead of once
per weight. Small row counts leave most of the GPU idle with one program per output tile, so
``K`` is split among up to :data:`MAX_SPLITS` programs whose float32 partial sums are added
afterwards (split-K).

Kernels are plain functions wrapped by ``triton.jit`` on first use, so they run in Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, how the tests check them) and compile
ahead of time for sm_90 (:func:`llmlab.kernels.triton_kernels.compile_for_target`). Tile
sizes are reasoned, not tuned: no GPU was available when this was written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SPLITS = 16
# Programs that keep an H100/H200 busy (132 SMs, about two resident programs each).
TARGET_PROGRAMS = 264


def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, stride_ys, group_size, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < N
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < k_end
        x = tl.load(
            x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )
        words = tl.load(
            w_ptr + (rk[:, None] // 8).to(tl.int64) * N + rn[None, :],
            mask=mask_k[:, None] & mask_n[None, :], other=0,
        )
        q = (words >> ((rk[:, None] % 8) * 4)) & 0xF
        group = k0 // group_size
        scale = tl.load(s_ptr + group * N + rn, mask=mask_n, other=0.0)
        zero = tl.load(z_ptr + group * N + rn, mask=mask_n, other=0)
        w = (q - zero[None, :].to(tl.int32)).to(tl.float32)
        if DOT_F32:
            part = tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        acc += part * scale[None, :]
    tl.store(
        y_ptr + split.to(tl.int64) * stride_ys + rm[:, None].to(tl.int64) * stride_ym
        + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


KERNELS = {"w4a16": _w4a16_kernel}


def _kernel():
    from llmlab.kernels.triton_kernels import kernel

    return kernel(_w4a16_kernel)


def block_k(in_features: int, group_size: int) -> int | None:
    """The K step for this grouping: 64, 32 or 16, dividing the group (any per channel);
    None when none does."""
    if group_size == in_features:
        return 64
    return next((b for b in (64, 32, 16) if group_size % b == 0), None)


def unsupported_reason(in_features: int, group_size: int, device: torch.device) -> str | None:
    """Why :func:`w4a16_matmul` cannot run this weight on ``device``; None if it can."""
    from llmlab.kernels.triton_kernels import interpreting

    if device.type != "cuda" and not interpreting():
        return f"Triton runs on CUDA (or CPU under TRITON_INTERPRET=1), not {device.type!r}"
    if block_k(in_features, group_size) is None:
        return f"the group size must be a multiple of 16 or per channel, got {group_size}"
    return None


def prepare(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The kernel's layout (module docstring) from the canonical one, checked and unpacked
    (``q``: ``[out, in]`` values in 0..15)."""
    q = q.to(torch.int32)
    out_features, in_features = q.shape
    if in_features % 8:
        q = torch.nn.functional.pad(q, (0, 8 - in_features % 8))  # masked off in the kernel
    shifts = torch.arange(8, dtype=torch.int32, device=q.device) * 4
    words = (q.view(out_features, -1, 8) << shifts).sum(dim=-1, dtype=torch.int64)
    # Bits 28..31 make values >= 2**31: wrap them into int32's range.
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return {
        "qweight_t": words.t().contiguous(),
        "scales_t": scales.t().contiguous(),
        "zeros_t": zeros.t().to(torch.uint8).contiguous(),
    }


def _blocks(rows: int, out_features: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a call: small tiles for decode-sized row counts."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128
    block_n = 64 if rows <= 64 or out_features <= 64 else 128
    return block_m, block_n, 8 if block_m * block_n >= 128 * 128 else 4


def w4a16_matmul(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], group_size: int
) -> torch.Tensor:
    """``x`` ``[M, in]`` (float32 / bfloat16 / float16) times the prepared weight,
    ``[M, out]`` in ``x``'s dtype."""
    from llmlab.kernels.triton_kernels import interpreting

    x = x.contiguous()
    rows, in_features = x.shape
    words, scales, zeros = tensors["qweight_t"], tensors["scales_t"], tensors["zeros_t"]
    out_features = words.shape[1]
    step = block_k(in_features, group_size)
    block_m, block_n, num_warps = _blocks(rows, out_features)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(out_features, block_n)
    # Split K while the tiles alone are too few, each split at least 4 steps long.
    splits = max(1, min(MAX_SPLITS, TARGET_PROGRAMS // tiles, in_features // (4 * step)))
    k_per_split = triton.cdiv(triton.cdiv(in_features, splits), step) * step
    splits = triton.cdiv(in_features, k_per_split)
    if splits == 1:
        y = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    else:
        y = torch.empty((splits, rows, out_features), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n), splits)
    _kernel()[grid](
        x, words, scales, zeros, y,
        rows, out_features, in_features, x.stride(0), out_features, rows * out_features,
        group_size, k_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=step,
        # The interpreter's tl.dot gets bfloat16 wrong (triton 3.7): it multiplies in
        # float32, the same products (weights are small integers, exact in any dtype).
        DOT_F32=x.dtype == torch.float32 or interpreting(),
        num_warps=num_warps,
    )
    return y if splits == 1 else y.sum(dim=0).to(x.dtype)

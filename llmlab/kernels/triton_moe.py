"""A fused mixture-of-experts layer in Triton, for CUDA.

A sparse block sends each of ``T`` tokens to ``top_k`` of ``E`` experts, each a gated MLP
(``down(silu(gate(x)) * up(x))``), and sums the picked experts' outputs weighted by the
router. Run expert by expert, that is ``E`` pairs of small matmuls a layer and, to know
which experts got tokens, a read of the routing on the host (a sync per layer per step).
Here the whole layer is about fifteen small torch ops and two kernels, nothing read back:

1. **Alignment** (:func:`align_pairs`, torch ops on the device): the ``T * top_k``
   token-expert pairs sorted by expert, each expert's run padded to a multiple of the
   GEMM's ``BLOCK_M`` so that every block of ``BLOCK_M`` sorted rows belongs to one expert.
   Buffer sizes depend only on ``T``, ``top_k``, ``E`` and ``BLOCK_M`` (the worst case:
   every expert used pads ``BLOCK_M - 1`` rows), never on the routing, so no size is read
   on the host and the layer could be captured in a CUDA graph; blocks past the real
   padded length exit at once.
2. **Gate/up** (``_moe_gate_up_kernel``): a grouped GEMM, one program per (block of sorted
   rows, tile of the inner width): it gathers its rows' tokens from ``x``, multiplies them
   by its expert's gate and up rows of the stacked ``w13`` ``[E, 2I, H]`` (two
   accumulators), and writes ``silu(gate) * up`` (SiLU-and-multiply fused into the
   epilogue, rounded where the torch chain rounds) into an ``[padded rows, I]`` buffer.
3. **Down** (``_moe_down_kernel``): the same grouping over ``w2`` ``[E, H, I]``; the
   epilogue rounds the product to the activations' dtype (as ``down_proj`` does), weighs
   it by the pair's routing weight and writes it to the pair's own row of a
   ``[T * top_k, H]`` buffer (no atomics: each pair has one row).
4. The sum over each token's ``top_k`` rows (torch, float32 accumulation).

The grouping (tokens sorted by expert, padded per expert to the GEMM's block) is the
published shape of vLLM's and SGLang's fused MoE (``moe_align_block_size``); the code here
is llmlab's own.

Kernels are plain functions wrapped by ``triton.jit`` on first use, so they also run in
Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, how the tests check them
against the torch reference in ``tests/models/test_fused_moe.py``) and compile ahead of time for sm_90
(:func:`llmlab.kernels.triton_kernels.compile_for_target`). The tile sizes
(:func:`block_sizes`) are reasoned, not tuned on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _moe_gate_up_kernel(
    x_ptr, w_ptr, h_ptr, pair_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, hidden, inner, stride_x, stride_we, stride_wn, stride_h,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a spare block of the worst-case grid
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    row_ok = pair < num_pairs  # padding rows hold num_pairs
    token = (pair // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inner
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_x + ks[None, :]
    # [BLOCK_K, BLOCK_N] tiles of the expert's gate rows and, inner rows on, its up rows.
    g_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    u_ptrs = g_ptrs + inner * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = ks < hidden - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(g_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            acc_gate += tl.dot(a, wg.to(tl.float32), input_precision="ieee")
            acc_up += tl.dot(a, wu.to(tl.float32), input_precision="ieee")
        else:
            acc_gate = tl.dot(a, wg, acc_gate)
            acc_up = tl.dot(a, wu, acc_up)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # Rounded as the torch chain rounds: gate_up in the model dtype, then silu, then the
    # product (the same arithmetic as triton_fused's silu_and_mul).
    dt = h_ptr.dtype.element_ty
    g = acc_gate.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt)
    h = (act.to(tl.float32) * acc_up.to(dt).to(tl.float32)).to(dt)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + cols[None, :], h,
             mask=row_ok[:, None] & col_ok[None, :])


def _moe_down_kernel(
    h_ptr, w_ptr, out_ptr, pair_ptr, block_expert_ptr, num_padded_ptr, route_w_ptr,
    num_pairs, hidden, inner, stride_h, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    row_ok = pair < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inner, BLOCK_K):
        k_ok = ks < inner - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # down_proj's output in the model dtype, times the routing weight (float32 or the
    # model dtype, as the block gives it), rounded once: the torch chain's two roundings.
    dt = out_ptr.dtype.element_ty
    weight = tl.load(route_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    y = (acc.to(dt).to(tl.float32) * weight[:, None]).to(dt)
    tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_out + cols[None, :], y,
             mask=row_ok[:, None] & col_ok[None, :])


KERNELS = {
    "moe_gate_up": _moe_gate_up_kernel,
    "moe_down": _moe_down_kernel,
}
"""The kernel sources by name (plain functions, jitted by :func:`_kernel`)."""


def _kernel(name: str):
    from llmlab.kernels.triton_kernels import kernel

    return kernel(KERNELS[name])


def block_sizes(num_pairs: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` for a layer of ``num_pairs`` token-expert pairs.

    Few pairs per expert (decode) take 16-row blocks, the smallest ``tl.dot`` accepts, so
    padding wastes little; many take 64. float32 tiles halve ``BLOCK_K`` to keep the
    pipelined tiles in shared memory. Reasoned from the shapes, not tuned on a GPU."""
    block_m = 16 if num_pairs < 32 * num_experts else 64
    block_k = 32 if dtype == torch.float32 else 64
    return block_m, 64, block_k


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted, padded pair list in the worst case: every expert that can be used
    (at most ``min(num_experts, num_pairs)``) pads ``block_m - 1`` rows; a multiple of
    ``block_m``."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


def align_pairs(
    chosen: torch.Tensor, num_experts: int, block_m: int, first_expert: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the token-expert pairs of ``chosen`` (``[T, top_k]`` expert ids; pair ``p`` is
    token ``p // top_k``'s ``p % top_k``-th pick) by expert, each expert's run padded to a
    multiple of ``block_m``; all on ``chosen``'s device, nothing read on the host. Only
    experts ``first_expert`` to ``first_expert + num_experts - 1`` are held (renumbered
    from 0); pairs picking any other are left out.

    Returns ``(pair_ids, block_expert, num_padded)``: ``pair_ids`` ``[max_padded_rows]``
    int32, the pair at each sorted row (``T * top_k`` on padding rows and past the end);
    ``block_expert`` ``[max_padded_rows / block_m]`` int32, the expert of each block of
    rows (``num_experts`` past the end); ``num_padded`` ``[1]`` int32, the rows in use.
    """
    local = chosen.reshape(-1).long() - first_expert
    num_pairs = local.numel()
    device = local.device
    rows = max_padded_rows(num_pairs, num_experts, block_m)
    # Pairs for experts held elsewhere go to an extra bin, num_experts, that gets no rows.
    held = (local >= 0) & (local < num_experts)
    local = torch.where(held, local, num_experts)
    # bincount would size its output from the max id, a read on the host; scatter_add does not.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0
    padded_end = padded.cumsum(0)
    first_row = padded_end - padded  # where each expert's run starts in the sorted rows
    first_pair = counts.cumsum(0) - counts  # where it starts among the sorted pairs
    order = torch.argsort(local, stable=True)
    expert_of = local[order]
    dest = first_row[expert_of] + torch.arange(num_pairs, device=device) - first_pair[expert_of]
    dest = torch.where(expert_of < num_experts, dest, rows)  # the left-out pairs: row `rows`
    pair_ids = torch.full((rows + 1,), num_pairs, dtype=torch.int32, device=device)
    pair_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end[:num_experts], block_starts, right=True)
    return pair_ids[:rows], block_expert.to(torch.int32), padded_end[-1:].to(torch.int32)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """``sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` over each token's
    picked experts ``e = chosen[t, k]``, as ``[T, H]`` in ``x``'s dtype.

    ``x`` ``[T, H]``; ``w13`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows);
    ``w2`` ``[E, H, I]``; ``weights`` ``[T, top_k]`` float32 or ``x``'s dtype; ``chosen``
    ``[T, top_k]`` expert ids. ``x``, ``w13`` and ``w2`` share one dtype of
    :data:`DTYPES`; ``w13`` and ``w2`` must be contiguous. ``w13[i]`` and ``w2[i]`` are expert
    ``first_expert + i``; picks of experts outside those contribute nothing (a rank that
    holds only some experts: its partial sum)."""
    tokens, hidden = x.shape
    num_experts, two_inner, _ = w13.shape
    inner = two_inner // 2
    top_k = chosen.shape[1]
    if w13.dtype != x.dtype or w2.dtype != x.dtype or x.dtype not in DTYPES:
        raise ValueError(
            f"fused_moe takes x, w13 and w2 in one dtype of {DTYPES}, got {x.dtype}, "
            f"{w13.dtype}, {w2.dtype}"
        )
    if w13.shape != (num_experts, 2 * inner, hidden) or w2.shape != (num_experts, hidden, inner):
        raise ValueError(
            f"fused_moe: w13 must be [E, 2I, H] and w2 [E, H, I] for H={hidden}; got "
            f"{tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("fused_moe: w13 and w2 must be contiguous")
    x = x.contiguous()
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m, block_n, block_k = block_sizes(num_pairs, num_experts, x.dtype)
    pair_ids, block_expert, num_padded = align_pairs(chosen, num_experts, block_m,
                                                     first_expert)
    rows = pair_ids.numel()
    dot_f32 = x.dtype == torch.float32 or x.device.type != "cuda"
    hidden_act = torch.empty((rows, inner), dtype=x.dtype, device=x.device)
    _kernel("moe_gate_up")[(rows // block_m, triton.cdiv(inner, block_n))](
        x, w13, hidden_act, pair_ids, block_expert, num_padded,
        num_pairs, hidden, inner, x.stride(0), w13.stride(0), w13.stride(1),
        hidden_act.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=dot_f32,
    )
    # Zeros, not empty: the rows of pairs left out (experts held elsewhere) are summed too.
    per_pair = torch.zeros((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _kernel("moe_down")[(rows // block_m, triton.cdiv(hidden, block_n))](
        hidden_act, w2, per_pair, pair_ids, block_expert, num_padded,
        weights.reshape(-1).contiguous(), num_pairs, hidden, inner, hidden_act.stride(0),
        w2.stride(0), w2.stride(1), per_pair.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=dot_f32,
    )
    if top_k == 1:
        return per_pair
    # Summed in float32 (torch's reduction accumulates 16-bit inputs in float32), rounded once.
    return per_pair.view(tokens, top_k, hidden).sum(dim=1)


def supports(x: torch.Tensor) -> bool:
    """Whether activations like ``x`` can go to :func:`fused_moe`: on CUDA (or any device
    under Triton's interpreter), in a dtype of :data:`DTYPES`."""
    from llmlab.kernels.triton_kernels import interpreting

    return (x.device.type == "cuda" or interpreting()) and x.dtype in DTYPES

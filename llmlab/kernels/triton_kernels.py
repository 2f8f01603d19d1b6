"""Triton kernels for paged attention: the KV write, the attention itself, the split reduction.

All three read the paged KV layout of :class:`~llmlab.attention.torch_backend.TorchPagedAttention`
(``[2, num_kv_heads, num_slots, head_dim]`` per layer, slot = ``block * block_size + offset``),
so a block of one KV head is ``block_size`` contiguous rows of ``head_dim``: one coalesced
tile per block table entry.

* :func:`write_kv`: store each new token's K and V at its slot (a negative slot is padding
  and is skipped, so CUDA-graph batches can be padded).
* :func:`paged_attention`: attention for a ragged batch of query spans read straight from
  the block tables. One program owns a span of ``block_q`` query tokens of one sequence
  and *all the query heads of one KV head* (GQA packing: the K/V tile loaded for one head
  serves the whole group), walks the sequence's context tile by tile with an online
  softmax, causal against the cached context and optionally limited to a sliding window.
  With ``num_splits > 1`` (flash-decoding) a third grid axis cuts each context into that
  many even pieces; the pieces write partial results that :func:`_reduce_splits_kernel`
  combines. Splitting pays when the batch alone gives too few programs to fill the GPU
  and contexts are long.

Kernels are plain functions wrapped by ``triton.jit`` on first use. With
``TRITON_INTERPRET=1`` in the environment before triton is imported, they run on CPU
tensors in Triton's interpreter, which is how they are tested without a GPU; CI also
compiles them ahead of time for sm_90 (:func:`compile_for_target`, in a process without
the interpreter).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_kv,
    stride_c_head,
    stride_c_slot,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, D_PAD)
    # slot < 0 marks padding: nothing is read or written. (The comparison is made on a
    # full tile: the interpreter rejects a scalar mask broadcast into a tensor one.)
    slots = tl.zeros([HEADS_PAD, D_PAD], tl.int64) + slot
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM) & (slots >= 0)
    src = heads[:, None] * stride_k_head + dims[None, :]
    dst = heads[:, None].to(tl.int64) * stride_c_head + slot * stride_c_slot + dims[None, :]
    k = tl.load(k_ptr + tok.to(tl.int64) * stride_k_tok + src, mask=mask)
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    src = heads[:, None] * stride_v_head + dims[None, :]
    v = tl.load(v_ptr + tok.to(tl.int64) * stride_v_tok + src, mask=mask)
    tl.store(cache_ptr + stride_c_kv + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def _paged_attention_kernel(
    q_ptr,
    out_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    prog_seq_ptr,
    prog_q_ptr,
    part_acc_ptr,
    part_ml_ptr,
    qk_scale,
    sliding_window,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_kv,
    stride_c_head,
    stride_c_slot,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(prog_seq_ptr + pid)
    q_first = tl.load(prog_q_ptr + pid)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx_len = tl.load(seq_lens_ptr + seq)

    # Row r of the tile is query token q_first + r // GROUP_PAD, query head
    # kv_head * GROUP + r % GROUP_PAD: the whole GQA group shares every K/V tile.
    rows = tl.arange(0, BLOCK_M)
    q_local = rows // GROUP_PAD
    q_idx = q_first + q_local
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (q_local < BLOCK_Q) & (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    else:
        q = q.to(cache_ptr.dtype.element_ty)
    # Absolute position of each query: the new tokens are the last q_len of the context.
    q_pos = ctx_len - q_len + q_idx

    # Keys this program can see: up to its last query (causal), from its first query's
    # window start; the range is cut into NUM_SPLITS even runs of whole tiles.
    last = ctx_len - q_len + tl.minimum(q_first + BLOCK_Q, q_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx_len - q_len + q_first - sliding_window + 1, 0)
        lo = (lo // TILE_N) * TILE_N
    num_tiles = tl.cdiv(last - lo, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    start = lo + split * tiles_per_split * TILE_N
    end = tl.minimum(last, start + tiles_per_split * TILE_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_base = cache_ptr + kv_head.to(tl.int64) * stride_c_head
    for n0 in range(start, end, TILE_N):
        keys = n0 + tl.arange(0, TILE_N)
        key_ok = keys < end
        block = tl.load(
            block_tables_ptr + seq.to(tl.int64) * stride_bt + keys // BLOCK_SIZE,
            mask=key_ok,
            other=0,
        )
        slot = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        kv_mask = key_ok[None, :] & dim_ok[:, None]
        k = tl.load(
            kv_base + slot[None, :] * stride_c_slot + dims[:, None], mask=kv_mask, other=0.0
        )  # [D_PAD, TILE_N]
        if DOT_F32:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - keys[None, :] < sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 instead so
        # exp2 gives 0 for it rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            kv_base + stride_c_kv + slot[:, None] * stride_c_slot + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [TILE_N, D_PAD]
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        # Partials of local row (pid, q_local), head, split: unnormalised acc, then m and l.
        part = ((pid * BLOCK_Q + q_local).to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(
            part_acc_ptr + part[:, None] * D_PAD + dims[None, :],
            acc,
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


def _reduce_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    prog_seq_ptr,
    prog_q_ptr,
    query_start_ptr,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    pid = row // BLOCK_Q
    seq = tl.load(prog_seq_ptr + pid)
    q_idx = tl.load(prog_q_ptr + pid) + row % BLOCK_Q
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, D_PAD)
    # Rows past the sequence's queries (a decode program's spare rows) do nothing; the
    # masks are full tiles since the interpreter rejects a broadcast scalar mask.
    ok = (tl.zeros([NUM_SPLITS], tl.int32) + q_idx) < q_len
    dim_ok = ((tl.zeros([D_PAD], tl.int32) + q_idx) < q_len) & (dims < HEAD_DIM)
    part = (row.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + splits
    m = tl.load(part_ml_ptr + part * 2, mask=ok, other=float("-inf"))
    lsum = tl.load(part_ml_ptr + part * 2 + 1, mask=ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # an empty split has m = -inf: weight 0
    acc = tl.load(
        part_acc_ptr + part[:, None] * D_PAD + dims[None, :],
        mask=ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(lsum * w, 0)
    out = num / tl.where(den > 0, den, 1.0)
    tok = (q_start + q_idx).to(tl.int64)
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


KERNELS = {
    "write_kv": _write_kv_kernel,
    "paged_attention": _paged_attention_kernel,
    "reduce_splits": _reduce_splits_kernel,
}
"""The kernel sources by name (plain functions; see :func:`kernel`)."""

_JITTED: dict[object, object] = {}


def kernel(name):
    """The kernel ``name`` (of :data:`KERNELS`; or a plain kernel function) wrapped by
    ``triton.jit``, once: compiled for CUDA tensors, or run by Triton's interpreter when
    ``TRITON_INTERPRET=1`` was set before triton was imported (the interpreter also needs
    triton's own library functions built in that mode)."""
    fn = KERNELS[name] if isinstance(name, str) else name
    jitted = _JITTED.get(fn)
    if jitted is None:
        jitted = _JITTED[fn] = triton.jit(fn)
    return jitted


def interpreting() -> bool:
    """Whether triton runs kernels in its interpreter in this process."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``k``/``v`` (``[num_tokens, num_kv_heads, head_dim]``) at ``slot_mapping``
    in ``kv_cache`` (``[2, num_kv_heads, num_slots, head_dim]``); slots < 0 are skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    kernel("write_kv")[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
    )


def block_q_for(group_size: int, rows: int = 64) -> int:
    """Query tokens per program so that a program holds about ``rows`` (token, head) rows."""
    return max(1, rows // triton.next_power_of_2(group_size))


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    prog_seq: torch.Tensor,
    prog_q: torch.Tensor,
    block_q: int,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int = 1,
    dot_f32: bool | None = None,
    tile_n: int = 32,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Paged attention of the query spans named by ``prog_seq``/``prog_q`` into ``out``.

    ``q``/``out`` are ``[num_tokens, num_heads, head_dim]``; sequence ``i``'s query tokens
    are the flat rows ``query_start[i]:query_start[i + 1]``, the last tokens of its
    ``seq_lens[i]``-long context, whose KV (already written) is found through
    ``block_tables[i]``. Program ``j`` computes query tokens ``prog_q[j]`` to
    ``prog_q[j] + block_q - 1`` of sequence ``prog_seq[j]`` (rows past the sequence's
    query length are skipped); rows no program names are left untouched.

    ``num_splits`` (a power of two) cuts each context into that many pieces run in
    parallel and reduced afterwards; ``scratch`` may supply the partial buffers
    (see :func:`split_scratch`). ``dot_f32`` computes both products in float32 (default:
    when ``q`` is float32, or when interpreting); otherwise 16-bit inputs go to the
    tensor cores with float32 accumulation.
    """
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    num_programs = int(prog_seq.shape[0])
    if num_programs == 0:
        return out
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    if dot_f32 is None:
        dot_f32 = q.dtype == torch.float32 or q.device.type != "cuda"
    d_pad = triton.next_power_of_2(head_dim)
    group_pad = triton.next_power_of_2(group)
    block_m = max(16, block_q * group_pad)
    if scratch is None and num_splits > 1:
        scratch = split_scratch(num_programs * block_q, num_heads, num_splits, head_dim, q.device)
    part_acc, part_ml = scratch if scratch is not None else (out, out)
    qk_scale = scale * LOG2E
    kernel("paged_attention")[(num_programs, num_kv_heads, num_splits)](
        q,
        out,
        kv_cache,
        block_tables,
        seq_lens,
        query_start,
        prog_seq,
        prog_q,
        part_acc,
        part_ml,
        qk_scale,
        int(sliding_window or 0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None,
        DOT_F32=bool(dot_f32),
        num_warps=num_warps,
    )
    if num_splits > 1:
        kernel("reduce_splits")[(num_programs * block_q, num_heads)](
            part_acc,
            part_ml,
            out,
            prog_seq,
            prog_q,
            query_start,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            BLOCK_Q=block_q,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=num_splits,
        )
    return out


def split_scratch(
    rows: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial-result buffers for ``rows`` query rows split ``num_splits`` ways."""
    d_pad = triton.next_power_of_2(head_dim)
    acc = torch.empty((rows, num_heads, num_splits, d_pad), dtype=torch.float32, device=device)
    ml = torch.empty((rows, num_heads, num_splits, 2), dtype=torch.float32, device=device)
    return acc, ml


def compile_for_target(name, signature: dict, constexprs: dict, arch: int = 90):
    """Compile kernel ``name`` (of this module; or any plain kernel function) ahead of time
    for CUDA ``arch`` (no GPU needed; CI uses it so that a kernel only the GPU compiler
    would reject fails on a CPU machine)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = JITFunction(KERNELS[name] if isinstance(name, str) else name)
    src = ASTSource(fn, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32))

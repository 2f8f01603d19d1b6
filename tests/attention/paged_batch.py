"""Random paged-attention batches over a poisoned cache, and the torch reference on them,
shared by the kernel tests (Triton, C++ CPU)."""

from __future__ import annotations

import torch

from llmlab.attention.backend import AttentionInputs, block_table_tensor, token_slots
from llmlab.attention.torch_backend import TorchPagedAttention

NUM_KV_HEADS = 2


def random_paged_batch(
    specs, *, block_size, group, head_dim, dtype, seed=0, device=None, fused_qkv=False
):
    """``(inputs, q, k, v, cache)`` for ``specs`` = [(context after the step, new tokens)].

    Blocks are scattered; every slot outside the contexts is NaN, and the cached context
    (positions before each sequence's new tokens) holds random K/V. The cache is in the
    torch backend's layout. ``fused_qkv``: q, k and v are views into one projection output,
    as the models hand them over (strided, not contiguous).
    """
    device = device or torch.device("cpu")
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-ctx // block_size) for ctx, _ in specs]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(order[used : used + n])
        used += n
    table = block_table_tensor(tables)
    q_lens = [q for _, q in specs]
    seq_lens = [ctx for ctx, _ in specs]
    seq_index = torch.repeat_interleave(torch.arange(len(specs)), torch.tensor(q_lens))
    positions = torch.cat([torch.arange(ctx - q, ctx) for ctx, q in specs])
    slots = token_slots(table, seq_index, positions, block_size)
    tokens, heads = len(slots), NUM_KV_HEADS * group

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    if fused_qkv:
        qkv = rand(tokens, heads + 2 * NUM_KV_HEADS, head_dim)
        q, k, v = qkv.split([heads, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    else:
        q = rand(tokens, heads, head_dim)
        k = rand(tokens, NUM_KV_HEADS, head_dim)
        v = rand(tokens, NUM_KV_HEADS, head_dim)
    cache = torch.full((2, NUM_KV_HEADS, num_blocks * block_size, head_dim), float("nan"))
    for i, (ctx, q_len) in enumerate(specs):
        pos = torch.arange(ctx - q_len)
        cached = token_slots(table, torch.full_like(pos, i), pos, block_size)
        cache[:, :, cached] = torch.randn(2, NUM_KV_HEADS, len(pos), head_dim, generator=gen)
    cache = cache.to(dtype)
    inputs = AttentionInputs(q_lens, seq_lens, table, slots.to(device), block_size, device)
    return inputs, *(t.to(device) for t in (q, k, v, cache))


def reference_attention(inputs, q, k, v, cache, *, scale, sliding_window):
    """The torch backend in float32 on the same values: ``(output, its updated cache)``."""
    ref = TorchPagedAttention(decode_mirror=False)
    ref_cache = cache.float().clone()
    out = ref.forward(
        0, q.float(), k.float(), v.float(), ref_cache, ref.build_metadata(inputs),
        scale=scale, sliding_window=sliding_window,
    )
    return out, ref_cache


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute error relative to the largest reference value."""
    return float((got.float().cpu() - want.float().cpu()).abs().max() / want.abs().max())

"""The C++ CPU attention kernel against the torch reference backend.

Inputs are random; the output buffer's rows and every KV slot outside the batch's contexts
are NaN before a run, so a kernel that reads an unwritten slot fails. The reference runs in
float32 on the same (bf16-rounded, for bfloat16) values.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from llmlab.attention.cpu_backend import CpuPagedAttention, from_slot_rows, slot_rows
from llmlab.kernels import cpu_kernels
from tests.attention.paged_batch import random_paged_batch, reference_attention, rel_err

pytestmark = pytest.mark.skipif(
    cpu_kernels.unavailable_reason() is not None, reason=str(cpu_kernels.unavailable_reason())
)

# (context length after the step, new tokens): decodes, fresh prompts of ragged lengths
# (several query tiles), prefix-cache hits (a chunk after a cached context), a one-token
# prompt, a one-block prompt.
MIXED = [(45, 1), (70, 1), (33, 33), (50, 21), (17, 17), (96, 40), (3, 1), (1, 1), (130, 2)]


def _batch(specs, **kwargs):
    return random_paged_batch(specs, fused_qkv=True, **kwargs)


def _run(inputs, q, k, v, cache, *, scale, sliding_window):
    """The kernel on ``cache`` (torch layout); returns its output and cache (torch layout)."""
    backend = CpuPagedAttention()
    metadata = backend.build_metadata(inputs)
    own = from_slot_rows(cache, inputs.block_size)
    out = backend.forward(0, q, k, v, own, metadata, scale=scale, sliding_window=sliding_window)
    return out, slot_rows(own, inputs.block_size)


# bf16 output is rounded once (relative step 2^-8); float32 differs in summation order.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_batch_matchesreference_attention(block_size, group, head_dim, dtype):
    inputs, q, k, v, cache = _batch(
        MIXED, block_size=block_size, group=group, head_dim=head_dim, dtype=dtype
    )
    scale = head_dim**-0.5
    want, want_cache = reference_attention(inputs, q, k, v, cache, scale=scale, sliding_window=None)
    got, got_cache = _run(inputs, q, k, v, cache, scale=scale, sliding_window=None)
    assert got.dtype == dtype and got.shape == q.shape
    assert not torch.isnan(got).any()
    assert rel_err(got, want) < TOLERANCE[dtype]
    # The kernel wrote exactly the new tokens' K/V, where the slot mapping says.
    torch.testing.assert_close(got_cache.float(), want_cache, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("window", [1, 7, 16, 24, 64, 500])
@pytest.mark.parametrize("group", [1, 4])
def test_sliding_window_matchesreference_attention(window, group):
    inputs, q, k, v, cache = _batch(
        MIXED, block_size=16, group=group, head_dim=64, dtype=torch.float32, seed=3
    )
    want, _ = reference_attention(inputs, q, k, v, cache, scale=0.125, sliding_window=window)
    got, _ = _run(inputs, q, k, v, cache, scale=0.125, sliding_window=window)
    assert rel_err(got, want) < 1e-5


def test_out_of_range_batches_are_refused_not_read_out_of_bounds():
    """The C++ kernel checks every block id, slot and length against the cache: a bad
    batch is an IndexError, and nothing outside the cache is written."""
    inputs, q, k, v, cache = _batch(
        [(20, 1), (9, 9)], block_size=16, group=2, head_dim=64, dtype=torch.float32
    )
    backend = CpuPagedAttention()
    own = from_slot_rows(torch.nan_to_num(cache), 16)

    def run(batch, kv):
        return backend.forward(0, q, k, v, kv, backend.build_metadata(batch), scale=0.125)

    small = own[:, :, :1].contiguous()  # fewer blocks than the tables name
    with pytest.raises(IndexError, match="does not fit the KV cache"):
        run(inputs, small)
    for bad in (
        attrs.evolve(inputs, seq_lens=[200, 9]),  # longer than its block table
        attrs.evolve(inputs, seq_lens=[20, 5]),  # fewer context tokens than new ones
        attrs.evolve(inputs, slot_mapping=inputs.slot_mapping - 1000),  # negative slots
        attrs.evolve(inputs, block_tables=inputs.block_tables + 10_000),  # foreign blocks
    ):
        before = own.clone()
        with pytest.raises(IndexError, match="does not fit the KV cache"):
            run(bad, own)
        changed = ~(own == before) & ~(own.isnan() & before.isnan())
        assert not changed.any() or bad.slot_mapping is inputs.slot_mapping
    run(inputs, own)  # and the good batch still runs


def test_copy_blocks_copies_whole_blocks_of_keys_and_values():
    backend = CpuPagedAttention()
    shape = backend.kv_cache_shape(num_blocks=6, block_size=4, num_kv_heads=2, head_dim=16)
    caches = [torch.randn(shape) for _ in range(2)]
    before = [c.clone() for c in caches]
    backend.copy_blocks(caches, [(1, 4), (5, 0)], block_size=4)
    for cache, old in zip(caches, before, strict=True):
        assert torch.equal(cache[:, :, 4], old[:, :, 1])
        assert torch.equal(cache[:, :, 0], old[:, :, 5])
        assert torch.equal(cache[:, :, 1:4], old[:, :, 1:4])
        assert torch.equal(cache[:, :, 5], old[:, :, 5])
        # In slot terms: block 4's tokens are block 1's (keys transposed within a block).
        rows, old_rows = slot_rows(cache, 4), slot_rows(old, 4)
        assert torch.equal(rows[:, :, 16:20], old_rows[:, :, 4:8])


def test_parallel_samples_share_then_copy_blocks_on_the_cpu_backend(tiny_llama):
    """n > 1 forks a request's blocks (copy-on-write of the partly written last block):
    greedy samples must all equal the single greedy continuation."""
    from llmlab import LLM, SamplingParams

    llm = LLM(tiny_llama, device="cpu", dtype="float32", block_size=4, attention_backend="cpu",
              seed=0)
    prompt = {"prompt_token_ids": [5, 9, 14, 3, 7, 22, 8]}  # 7 tokens: the last block is shared
    one = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                ignore_eos=True), use_tqdm=False)
    many = llm.generate([prompt], SamplingParams(temperature=0.0, n=3, max_tokens=12,
                                                 ignore_eos=True), use_tqdm=False)
    want = one[0].outputs[0].token_ids
    assert [o.token_ids for o in many[0].outputs] == [want] * 3

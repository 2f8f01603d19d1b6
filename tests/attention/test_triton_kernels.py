"""The Triton kernels against the torch reference backend.

On a machine without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set by ``tests/conftest.py``); on a CUDA machine the same tests run compiled. Inputs are
random, the output buffer and every KV slot outside the batch's contexts are NaN before a
run, so a kernel that reads an unwritten slot or leaves a row unwritten fails. The
reference runs in float32 on the same (16-bit-rounded) values. In the interpreter, and for
float32 inputs anywhere, the kernels compute in float32: relative error < 1e-5. Compiled on
a GPU, 16-bit inputs go to the tensor cores, which take the softmax weights rounded to the
input dtype as flash attention does (measured on an H100: up to 1.5e-3 for bfloat16, 1.5e-4
for float16), so the bound there is the dtype's.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.attention.triton_backend import TritonPagedAttention, triton_unavailable_reason
from tests.attention.paged_batch import (
    NUM_KV_HEADS,
    random_paged_batch,
    reference_attention,
    rel_err,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    triton_unavailable_reason(DEVICE) is not None,
    reason=str(triton_unavailable_reason(DEVICE)),
)

# (context length after the step, new tokens): decodes, fresh prompts of ragged lengths,
# prefix-cache hits (a chunk after a cached context), a one-block prompt.
MIXED = [(45, 1), (70, 1), (33, 33), (50, 21), (17, 17), (96, 40), (3, 1)]


def _tol(dtype: torch.dtype) -> float:
    if DEVICE.type != "cuda" or dtype == torch.float32:
        return 1e-5
    return {torch.bfloat16: 6e-3, torch.float16: 8e-4}[dtype]


def _batch(specs, **kwargs):
    return random_paged_batch(specs, device=DEVICE, **kwargs)


def _run_triton(backend, inputs, q, k, v, cache, *, scale, sliding_window):
    from llmlab.kernels.triton_kernels import write_kv

    write_kv(k, v, cache, inputs.slot_mapping)
    metadata = backend.build_metadata(inputs)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEVICE)
    backend.attend_into(out, q, cache, metadata, scale=scale, sliding_window=sliding_window)
    return out, metadata


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matchesreference_attention(block_size, group, head_dim, dtype):
    inputs, q, k, v, cache = _batch(
        MIXED, block_size=block_size, group=group, head_dim=head_dim, dtype=dtype
    )
    scale = head_dim**-0.5
    want, want_cache = reference_attention(inputs, q, k, v, cache, scale=scale, sliding_window=None)
    got, _ = _run_triton(TritonPagedAttention(), inputs, q, k, v, cache, scale=scale,
                         sliding_window=None)
    assert not torch.isnan(got).any()
    assert rel_err(got, want) < _tol(dtype)
    # The write kernel stored exactly what the reference stored, and nothing else.
    torch.testing.assert_close(cache.float().cpu(), want_cache.cpu(), rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("window", [1, 7, 24, 64])
@pytest.mark.parametrize("group", [1, 4])
def test_sliding_window_matchesreference_attention(window, group):
    inputs, q, k, v, cache = _batch(
        MIXED, block_size=16, group=group, head_dim=64, dtype=torch.float32, seed=1
    )
    want, _ = reference_attention(inputs, q, k, v, cache, scale=0.125, sliding_window=window)
    got, _ = _run_triton(TritonPagedAttention(), inputs, q, k, v, cache, scale=0.125,
                         sliding_window=window)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_long_decodes_matchreference_attention(block_size, dtype, window):
    specs = [(700, 1), (333, 1), (64, 1), (5, 1), (300, 30)]  # decodes + a prefill chunk
    inputs, q, k, v, cache = _batch(
        specs, block_size=block_size, group=4, head_dim=64, dtype=dtype, seed=2
    )
    backend = TritonPagedAttention(min_split_context=256, tokens_per_split=64, max_splits=8)
    want, _ = reference_attention(inputs, q, k, v, cache, scale=0.125, sliding_window=window)
    got, metadata = _run_triton(backend, inputs, q, k, v, cache, scale=0.125,
                                sliding_window=window)
    splits = [s for _, s, _ in backend.launches(metadata, 8, NUM_KV_HEADS, 64)]
    assert splits[0] == 8 and splits[1] == 1  # decodes split (64 // 8 programs), prefill not
    assert not torch.isnan(got).any()
    assert rel_err(got, want) < _tol(dtype)


def test_split_count_follows_context_and_batch():
    backend = TritonPagedAttention(target_programs=512)
    cpu = torch.device("cpu")
    assert backend.num_splits(programs=8, max_ctx=512, device=cpu) == 1  # short: no split
    assert backend.num_splits(programs=8, max_ctx=16384, device=cpu) == 16
    assert backend.num_splits(programs=8, max_ctx=2048, device=cpu) == 8  # >= 256 keys each
    assert backend.num_splits(programs=128, max_ctx=16384, device=cpu) == 4
    assert backend.num_splits(programs=512, max_ctx=16384, device=cpu) == 1  # grid is full


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tensor_core_path_within_16_bit_rounding(dtype):
    """With ``dot_f32=False`` the products take 16-bit inputs (P is rounded to 16 bits),
    as on the GPU's tensor cores: the error is then of the 16-bit type's order."""
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        pytest.skip("Triton's interpreter computes tl.dot of bfloat16 tiles wrongly (it "
                    "multiplies the raw bits); the bfloat16 products are checked on CUDA")
    inputs, q, k, v, cache = _batch(
        MIXED, block_size=16, group=4, head_dim=64, dtype=dtype, seed=3
    )
    want, _ = reference_attention(inputs, q, k, v, cache, scale=0.125, sliding_window=None)
    got, _ = _run_triton(TritonPagedAttention(dot_f32=False), inputs, q, k, v, cache,
                         scale=0.125, sliding_window=None)
    assert rel_err(got, want) < 2e-2


def test_write_kv_skips_negative_slots_and_casts():
    """float32 K/V into a float16 cache. (Not bfloat16: Triton's interpreter truncates
    float32 -> bfloat16 where torch and the GPU round to nearest.)"""
    from llmlab.kernels.triton_kernels import write_kv

    gen = torch.Generator().manual_seed(4)
    k = torch.randn(6, 3, 64, generator=gen)
    v = torch.randn(6, 3, 64, generator=gen)
    slots = torch.tensor([5, -1, 0, 17, -1, 40])
    cache = torch.full((2, 3, 48, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    write_kv(k.to(DEVICE), v.to(DEVICE), cache, slots.to(DEVICE))
    want = torch.full((2, 3, 48, 64), float("nan"), dtype=torch.float16)
    keep = slots >= 0
    want[0][:, slots[keep]] = k[keep].transpose(0, 1).to(torch.float16)
    want[1][:, slots[keep]] = v[keep].transpose(0, 1).to(torch.float16)
    torch.testing.assert_close(cache.cpu(), want, rtol=0, atol=0, equal_nan=True)


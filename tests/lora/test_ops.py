"""The batched LoRA ops against the one-token-at-a-time definition: the torch op (runs of
one slot's rows, in place or gathered), and the Triton SGMV kernels (Triton's interpreter
on CPU, natively on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmlab.lora.ops import lora_update, reference_lora
from llmlab.lora.slots import group_tokens

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def case(lens, entry_slots, slots=3, rank=8, d_in=40, slices=((0, 72),),
         dtype=torch.float32, seed=0):
    """Inputs, base outputs and slot weights (``len(slices)`` fused slices) for a batch."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = int(sum(lens))
    d_out = sum(size for _, size in slices)
    x = torch.randn(num_tokens, d_in, generator=gen).to(DEVICE, dtype)
    y = torch.randn(num_tokens, d_out, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(slots, len(slices) * rank, d_in, generator=gen) * 0.3).to(DEVICE, dtype)
    b = (torch.randn(slots, rank, d_out, generator=gen) * 0.3).to(DEVICE, dtype)
    token_slots = torch.from_numpy(np.repeat(np.asarray(entry_slots), lens))
    return x, y, a, b, token_slots


QKV = ((0, 32), (32, 16), (48, 16))  # a fused projection: q, k, v


CASES = [
    ([1, 1, 1, 1, 1], [0, -1, 2, 0, 1]),  # decode: interleaved slots and no adapter
    ([7, 1, 20, 3], [1, 1, -1, 2]),  # mixed prefill and decode
    ([5, 9], [0, 0]),  # short spans only, one slot
    ([4, 6], [-1, -1]),  # no adapter at all
    ([33, 17, 2], [2, 0, 2]),  # long spans and a short one
    ([40, 16, 30], [1, 1, -1]),  # long spans only (two merge)
]


def torch_op(x, y, a, b, entry_slots, lens, slices=((0, None),)):
    slices = tuple((first, size if size is not None else y.shape[1]) for first, size in slices)
    step = group_tokens(np.asarray(entry_slots), np.asarray(lens), DEVICE)
    if step is None:
        return y
    return lora_update(x, y, a, b, slices, step.runs, step.gather_index, step.gathered_runs)


@pytest.mark.parametrize("slices", [((0, 72),), QKV], ids=["one-slice", "qkv"])
@pytest.mark.parametrize(("lens", "entry_slots"), CASES)
def test_torch_op_equals_the_definition(lens, entry_slots, slices):
    x, y, a, b, token_slots = case(lens, entry_slots, slices=slices)
    expected = reference_lora(x, y, a, b, token_slots, slices)
    got = torch_op(x, y.clone(), a, b, entry_slots, lens, slices)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slices", [((0, 72),), QKV], ids=["one-slice", "qkv"])
@pytest.mark.parametrize(("lens", "entry_slots"), [c for c in CASES if max(c[1]) >= 0])
def test_triton_sgmv_equals_the_torch_op(lens, entry_slots, slices):
    pytest.importorskip("triton")
    from llmlab.lora.triton_ops import sgmv_lora

    x, y, a, b, token_slots = case(lens, entry_slots, rank=16, slices=slices)
    step = group_tokens(np.asarray(entry_slots), np.asarray(lens), DEVICE, kernel="triton")
    got = sgmv_lora(
        x, y.clone(), a, b, slices, step.perm, step.seg_starts, step.seg_slots,
        step.max_segment_len, step.num_lora_tokens,
    )
    expected = torch_op(x, y.clone(), a, b, entry_slots, lens, slices)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_long_spans_run_in_place_and_short_rows_gather_by_slot():
    step = group_tokens(np.array([1, -1, 0, 1, 1]), np.array([2, 20, 1, 16, 17]),
                        torch.device("cpu"))
    assert step.runs == ((23, 56, 1),)  # the two adjacent spans of slot 1 merged
    assert step.gather_index.tolist() == [22, 0, 1]  # sorted by slot: 0, then 1, 1
    assert step.gathered_runs == ((0, 1, 0), (1, 3, 1))
    decode = group_tokens(np.array([2, 0, 2, -1, 0]), np.ones(5), torch.device("cpu"))
    assert decode.runs == () and decode.gather_index.tolist() == [1, 4, 0, 2]
    assert decode.gathered_runs == ((0, 2, 0), (2, 4, 2))  # one matmul pair per adapter
    # Every row short, with an adapter, already in slot order: in place, nothing gathered.
    ordered = group_tokens(np.array([0, 0, 3, 3, 3]), np.ones(5), torch.device("cpu"))
    assert ordered.runs == ((0, 2, 0), (2, 5, 3)) and ordered.gather_index is None
    assert ordered.gathered_runs == ()

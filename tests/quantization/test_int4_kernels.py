"""The W4A16 kernels (:mod:`llmlab.kernels.int4`, :mod:`llmlab.kernels.triton_int4`) against
references written from the canonical layout's definition.

The chain of references: :func:`pack` / :func:`unpack` against a bit-by-bit loop;
:func:`dequantize` against ``(q - zero) * scale`` element by element in Python floats; every
kernel against ``x @ dequantize(...).T`` in float64 on the same (dtype-rounded) ``x``.

Errors are ``max |y - ref| / max |ref|``. Measured (6 seeds, the shapes below, 1/7/40 rows):
float32 <= 6.4e-7 (the dequantized weight is exact to one float32 rounding); bfloat16 <=
5.9e-3 for ATen's int4 kernel (scale rounded to bfloat16, the zero point ``(8 - z) *
scale`` rounded once more, output rounded) and 5.1e-3 for dequantize-then-matmul (weight
and output rounded to bfloat16); float16 <= 7.3e-4. The bounds below leave about 2x; a
wrong nibble, group or zero point convention is off by O(1).
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels import int4

TOL = {torch.float32: 2e-6, torch.bfloat16: 1.2e-2, torch.float16: 1.5e-3}

# (out, in, group size): groups of 32 / 64 / 128, per channel (in = 1408 = 11 x 128, so
# ATen's kernel runs it as groups of 128), out not a multiple of 16 (40: ATen's kernel
# refuses it), groups of 16 (below ATen's smallest).
SHAPES = [(64, 256, 32), (48, 512, 64), (32, 384, 128), (32, 1408, 1408), (40, 96, 32),
          (32, 64, 16)]


def _weight(out_features, in_features, group_size, symmetric, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    q = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    scales = torch.rand(out_features, groups, generator=gen) * 0.02 + 1e-3
    if symmetric:
        zeros = torch.full((out_features, groups), 8.0)
    else:
        zeros = torch.randint(0, 16, (out_features, groups), generator=gen).float()
    return q, int4.pack(q), scales, zeros


def _rel_err(y, ref):
    return float((y.double() - ref).abs().max() / ref.abs().max())


def _reference(x, qweight, scales, zeros, group_size):
    return x.double() @ int4.dequantize(qweight, scales, zeros, group_size).double().T


def test_pack_puts_the_even_input_index_in_the_low_nibble():
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]], dtype=torch.uint8)
    assert int4.pack(q).tolist() == [[0x21, 0x43], [0x0F, 0xF0]]


def test_pack_and_unpack_round_trip_bit_by_bit():
    q, packed, _, _ = _weight(24, 62, 31, symmetric=False)
    assert packed.shape == (24, 31) and packed.dtype == torch.uint8
    for o in range(24):
        for j in range(31):
            byte = int(packed[o, j])
            assert (byte & 15, byte >> 4) == (int(q[o, 2 * j]), int(q[o, 2 * j + 1]))
    assert torch.equal(int4.unpack(packed), q)


def test_dequantize_matches_the_definition_element_by_element():
    out_features, in_features, group_size = 6, 40, 8
    q, packed, scales, zeros = _weight(out_features, in_features, group_size, symmetric=False)
    w = int4.dequantize(packed, scales, zeros, group_size)
    assert w.dtype == torch.float32 and w.shape == (out_features, in_features)
    for o in range(out_features):
        for i in range(in_features):
            g = i // group_size
            want = (int(q[o, i]) - float(zeros[o, g])) * float(scales[o, g])  # float64
            # (q - z) is exact, so the float32 result is the product rounded once.
            assert float(w[o, i]) == float(torch.tensor(want, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cpu_linear_matches_the_float64_reference(shape, symmetric, dtype):
    out_features, in_features, group_size = shape
    _, packed, scales, zeros = _weight(*shape, symmetric)
    handle = int4.prepare(packed, scales, zeros, group_size, dtype=dtype)
    aten_takes_it = (dtype == torch.bfloat16 and out_features % 16 == 0
                     and group_size % 32 == 0
                     and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))
    assert handle.kernel == (int4.KERNEL_INT4PACK if aten_takes_it else int4.KERNEL_DEQUANT)
    gen = torch.Generator().manual_seed(1)
    # ATen's kernel where it runs at every row count (40: past the opt-in split too).
    for rows in (1, 7, int4.INT4PACK_MAX_ROWS + 8):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        y = int4.linear(x, handle)
        assert y.dtype == dtype and y.shape == (rows, out_features)
        err = _rel_err(y, _reference(x, packed, scales, zeros, group_size))
        assert err < TOL[dtype], (handle.kernel_for(rows), rows, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_that_runs_on_cpu_agrees(dtype):
    _, packed, scales, zeros = _weight(48, 256, 64, symmetric=False)
    kernels = [int4.KERNEL_DEQUANT, int4.KERNEL_TORCH_DEQUANT]
    if dtype == torch.bfloat16 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        kernels.append(int4.KERNEL_INT4PACK)
    x = torch.randn(5, 256).to(dtype)
    ref = _reference(x, packed, scales, zeros, 64)
    for kernel in kernels:
        handle = int4.prepare(packed, scales, zeros, 64, dtype=dtype, kernel=kernel)
        assert handle.kernel_for(5) == kernel
        assert _rel_err(int4.linear(x, handle), ref) < TOL[dtype], kernel
    if int4.KERNEL_INT4PACK in kernels:
        # By default ATen's kernel runs every row count, on its layout alone; with
        # int4pack_max_rows the handle keeps the dequantize layout too and switches past it.
        x = torch.randn(int4.INT4PACK_MAX_ROWS + 8, 256).to(dtype)
        ref = _reference(x, packed, scales, zeros, 64)
        alone = int4.prepare(packed, scales, zeros, 64, dtype=dtype)
        split = int4.prepare(packed, scales, zeros, 64, dtype=dtype,
                             int4pack_max_rows=int4.INT4PACK_MAX_ROWS)
        assert alone.kernel_for(x.shape[0]) == int4.KERNEL_INT4PACK
        assert split.kernel_for(x.shape[0]) == int4.KERNEL_DEQUANT
        assert split.kernel_for(int4.INT4PACK_MAX_ROWS) == int4.KERNEL_INT4PACK
        for handle in (alone, split):
            assert _rel_err(int4.linear(x, handle), ref) < TOL[dtype]
        assert set(alone.tensors) == {"int4pack", "scale_and_zeros"}
        assert alone.nbytes < split.nbytes


def test_dequantize_fallback_in_several_chunks(monkeypatch):
    # A scratch buffer of 5 rows: the output rows are dequantized and multiplied in chunks.
    _, packed, scales, zeros = _weight(48, 128, 32, symmetric=False)
    monkeypatch.setattr(int4, "SCRATCH_BYTES", 5 * 128 * 4)
    for dtype in (torch.float32, torch.bfloat16):
        handle = int4.prepare(packed, scales, zeros, 32, dtype=dtype, kernel="dequant_matmul")
        x = torch.randn(3, 128).to(dtype)
        err = _rel_err(int4.linear(x, handle), _reference(x, packed, scales, zeros, 32))
        assert err < TOL[dtype]


def test_linear_takes_leading_dimensions_and_a_bias():
    _, packed, scales, zeros = _weight(32, 128, 64, symmetric=True)
    handle = int4.prepare(packed, scales, zeros, 64, dtype=torch.float32)
    x, bias = torch.randn(2, 3, 128), torch.randn(32)
    y = int4.linear(x, handle, bias)
    want = _reference(x.reshape(-1, 128), packed, scales, zeros, 64) + bias.double()
    assert y.shape == (2, 3, 32)
    assert _rel_err(y.reshape(-1, 32), want) < TOL[torch.float32]
    assert int4.linear(torch.empty(0, 128), handle).shape == (0, 32)


def test_handles_count_their_bytes():
    _, packed, scales, zeros = _weight(64, 256, 32, symmetric=False)
    groups_bytes = 2 * 64 * (256 // 32) * 4  # float32 scales and zeros
    plain = int4.prepare(packed, scales, zeros, 32, dtype=torch.float32)
    assert plain.nbytes == 64 * 128 + groups_bytes
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pairs_bytes = 64 * (256 // 32) * 2 * 2  # bfloat16 (scale, zero) pairs
        alone = int4.prepare(packed, scales, zeros, 32, dtype=torch.bfloat16)
        assert alone.nbytes == 64 * 128 + pairs_bytes  # ATen's packed copy only
        both = int4.prepare(packed, scales, zeros, 32, dtype=torch.bfloat16,
                            int4pack_max_rows=int4.INT4PACK_MAX_ROWS)
        # ... and, opted in, the fallback's layout besides.
        assert both.nbytes == 2 * 64 * 128 + groups_bytes + pairs_bytes


def test_bad_layouts_are_refused_with_the_sizes():
    _, packed, scales, zeros = _weight(32, 96, 32, symmetric=False)
    with pytest.raises(ValueError, match="group_size 64 must divide the input size 96"):
        int4.prepare(packed, scales, zeros, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"scales must be float32 \[32, 3\]"):
        int4.prepare(packed, scales[:, :2], zeros, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="qweight must be uint8"):
        int4.prepare(packed.int(), scales, zeros, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="integer zero points in 0..15.*got 2.5"):
        int4.prepare(packed, scales, zeros.clone().fill_(2.5), 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="dtype must be one of"):
        int4.prepare(packed, scales, zeros, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="kernel 'int4pack_mm' cannot run this weight"):
        int4.prepare(packed, scales, zeros, 32, dtype=torch.float32, kernel="int4pack_mm")
    with pytest.raises(ValueError, match="even in"):
        int4.pack(torch.zeros(2, 3, dtype=torch.uint8))
    handle = int4.prepare(packed, scales, zeros, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="must be torch.float32"):
        int4.linear(torch.randn(1, 96).bfloat16(), handle)
    with pytest.raises(ValueError, match="input size 96"):
        int4.linear(torch.randn(1, 64), handle)


# --- the Triton GEMM: Triton's interpreter on CPU (tests/conftest.py), compiled on CUDA ---

TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _triton_reason():
    try:
        from llmlab.kernels import triton_int4
    except ImportError as err:
        return f"triton is not importable: {err}"
    return triton_int4.unsupported_reason(64, 64, TRITON_DEVICE)


# (out, in, group, rows): decode rows with split-K, prefill-sized rows beyond one tile,
# per channel with in not a multiple of the K step (masked tail), groups of 16, out not a
# multiple of the tile.
TRITON_CASES = [(64, 256, 32, 1), (48, 512, 64, 70), (40, 200, 200, 3), (32, 96, 16, 17),
                (72, 256, 128, 33)]


@pytest.mark.skipif(_triton_reason() is not None, reason=str(_triton_reason()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "x".join(map(str, c)))
def test_triton_w4a16_matches_the_float64_reference(case, dtype):
    out_features, in_features, group_size, rows = case
    _, packed, scales, zeros = _weight(out_features, in_features, group_size,
                                       symmetric=False, seed=rows)
    zeros[0, 0] = 16  # GPTQ v1's zero point read back
    handle = int4.prepare(packed, scales, zeros, group_size, dtype=dtype,
                          device=TRITON_DEVICE, kernel="triton_w4a16")
    x = torch.randn(rows, in_features).to(dtype)
    y = int4.linear(x.to(TRITON_DEVICE), handle).cpu()
    # Interpreted (and for float32) it multiplies in float32: only the output rounds; on a
    # GPU 16-bit products are exact on the tensor cores, so the same bounds hold.
    assert _rel_err(y, _reference(x, packed, scales, zeros, group_size)) < TOL[dtype]


@pytest.mark.skipif(_triton_reason() is not None, reason=str(_triton_reason()))
def test_triton_repack_reads_eight_inputs_per_word():
    from llmlab.kernels import triton_int4

    q, _, scales, zeros = _weight(16, 24, 24, symmetric=False)
    words = triton_int4.prepare(q, scales, zeros)["qweight_t"]  # [in / 8, out]
    assert words.shape == (3, 16) and words.dtype == torch.int32
    for k in range(24):
        nibble = (words[k // 8].long() & 0xFFFFFFFF) >> (4 * (k % 8)) & 15
        assert torch.equal(nibble, q[:, k].long())


def test_the_scratch_buffer_serves_calls_in_and_out_of_inference_mode():
    """The engine's forward runs under ``torch.inference_mode``; the dequantize path's
    reused buffer, first made there, must still take a later call outside it (and the
    other way round) with the same result."""
    _, qweight, scales, zeros = _weight(96, 256, 64, symmetric=False, seed=4)
    handle = int4.prepare(qweight, scales, zeros, 64, dtype=torch.float32,
                          kernel=int4.KERNEL_DEQUANT)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    int4._SCRATCH.__dict__.clear()  # this thread's buffers made afresh, inside
    with torch.inference_mode():
        inside = int4.linear(x, handle)
    outside = int4.linear(x, handle)
    assert torch.equal(inside, outside)
    assert _rel_err(outside, _reference(x, qweight, scales, zeros, 64)) < 2e-6


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                    reason="this torch has no int4 CPU matmul")
def test_a_bfloat16_cpu_weight_holds_about_four_and_a_quarter_bits():
    """The 4-bit checkpoint's point: at group 128 the default bfloat16 handle holds 4 bits
    a weight plus a bfloat16 scale and zero a group (4.25), not a second layout."""
    _, packed, scales, zeros = _weight(256, 1024, 128, symmetric=False)
    handle = int4.prepare(packed, scales, zeros, 128, dtype=torch.bfloat16)
    assert handle.kernel == int4.KERNEL_INT4PACK
    assert 8 * handle.nbytes / (256 * 1024) == pytest.approx(4.25, abs=0.02)

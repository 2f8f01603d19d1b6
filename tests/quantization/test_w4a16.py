"""The canonical 4-bit layout and :class:`W4A16Linear`, against the formula written out:
``w[o, i] = (q[o, i] - zero[o, g_idx[i]]) * scale[o, g_idx[i]]``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llmlab.quantization import W4A16Linear
from llmlab.quantization import w4a16 as w4a16_module
from llmlab.quantization.int4_formats import Int4Format
from llmlab.quantization.int4_unpack import Where, check_g_idx
from llmlab.quantization.w4a16 import canonical_layout, dequantize, pack_nibbles, unpack_nibbles

# Relative error (to the largest output) each activation dtype's arithmetic allows against
# float64 on the same 4-bit weights, with margin over what was measured on this CPU
# (in=512, group 128: float32 3e-7 / 4e-7; float16 2e-4 to 5e-4; bfloat16 4e-3 through
# ATen's int4 kernel, whose scale and zero point are rounded to bfloat16, 3e-3 through
# the dequantize-matmul): the output's own rounding (2^-9 in bfloat16, 2^-12 in float16)
# plus the scales' and the accumulation's.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _random_layer(out=64, width=256, groups=4, seed=0, act_order=False):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (out, width), generator=generator, dtype=torch.uint8)
    scales = torch.rand(out, groups, generator=generator) * 0.05 + 0.001
    zeros = torch.randint(0, 17, (out, groups), generator=generator).float()
    g_idx = torch.arange(width) // (width // groups)
    if act_order:
        g_idx = g_idx[torch.randperm(width, generator=generator)]
    return values, scales, zeros, g_idx


def _formula(values, scales, zeros, g_idx):
    return (values.float() - zeros[:, g_idx]) * scales[:, g_idx]


def _module(values, scales, zeros, g_idx, dtype=torch.float32, bias=None):
    part = canonical_layout(values, scales, zeros, g_idx)
    module = W4A16Linear(values.shape[1], values.shape[0], bias is not None, dtype)
    module.set_layout(part.group_size, part.perm)
    module.load_rows(0, part)
    if bias is not None:
        module.bias.data.copy_(bias)
    return module


def test_nibbles_pack_the_even_input_in_the_low_half():
    values = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_nibbles(values)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_nibbles(packed), values)


@pytest.mark.parametrize("act_order", [False, True])
def test_the_canonical_layout_dequantizes_to_the_formula(act_order):
    layer = _random_layer(act_order=act_order)
    part = canonical_layout(*layer)
    assert part.group_size == 64 and (part.perm is not None) == act_order
    weight = dequantize(part.qweight, part.scales, part.zeros, part.group_size)
    expected = _formula(*layer)
    if part.perm is not None:
        expected = expected[:, part.perm]  # the canonical input order
    assert torch.equal(weight, expected)


def test_a_rank_holding_parts_of_groups_gets_smaller_groups_and_the_same_weights():
    """A row-parallel rank's input slice cuts act-order groups anywhere: the canonical
    groups are the largest that split every run, the scales repeated: exact."""
    values, scales, zeros, g_idx = _random_layer(act_order=True)
    values, g_idx = values[:, 40:168], g_idx[40:168]
    part = canonical_layout(values, scales, zeros, g_idx)
    counts = torch.bincount(g_idx, minlength=4).tolist()
    assert part.group_size == math.gcd(*counts) and part.group_size < 64
    weight = dequantize(part.qweight, part.scales, part.zeros, part.group_size)
    assert torch.equal(weight, _formula(values, scales, zeros, g_idx)[:, part.perm])


@pytest.mark.parametrize("act_order", [False, True])
def test_forward_is_a_linear_with_the_dequantized_weight(act_order):
    layer = _random_layer(act_order=act_order)
    bias = torch.randn(64)
    module = _module(*layer, bias=bias)
    module.finalize(kernel="dequantize")
    weight = module.dequantized_weight()
    assert torch.equal(weight, _formula(*layer))  # in the checkpoint's input order
    x = torch.randn(3, 5, 256)
    torch.testing.assert_close(module(x), F.linear(x, weight, bias), rtol=0, atol=1e-5)


def _int4():
    kernels = w4a16_module._int4_kernels()
    if kernels is None:
        pytest.skip("llmlab.kernels.int4 is not there")
    return kernels


def test_the_layout_is_the_kernels_contract():
    int4 = _int4()
    values, scales, zeros, g_idx = _random_layer()
    part = canonical_layout(values, scales, zeros, g_idx)
    assert torch.equal(pack_nibbles(values), int4.pack(values))
    assert torch.equal(dequantize(part.qweight, part.scales, part.zeros, part.group_size),
                       int4.dequantize(part.qweight, part.scales, part.zeros, part.group_size))


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("act_order", [False, True])
def test_the_int4_kernels_stay_within_their_arithmetic(dtype, rows, act_order):
    _int4()
    layer = _random_layer(out=128, width=512, act_order=act_order, seed=rows)
    module = _module(*layer, dtype=dtype)
    weight = module.dequantized_weight().double()
    module.finalize(kernel="int4")
    assert module.kernel == "int4" and not module.holds_canonical
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = x.double() @ weight.T
    error = (module(x).double() - expected).abs().max() / expected.abs().max()
    assert error <= TOLERANCES[dtype]


def test_the_weight_read_back_from_the_kernel_is_the_canonical_one():
    """After the canonical buffers go to the kernel's handle, ``dequantized_weight`` reads
    the weight back through it: in float32 exactly the same."""
    _int4()
    layer = _random_layer(act_order=True)
    module = _module(*layer)
    before = module.dequantized_weight()
    module.finalize()
    assert module.kernel == "int4" and not module.holds_canonical
    assert torch.equal(module.dequantized_weight(), before)
    with pytest.raises(ValueError, match="already handed to a kernel"):
        module.finalize()


def test_a_wrong_g_idx_is_refused_naming_the_tensor():
    fmt = Int4Format("gptq", 32, symmetric=False, config_path="c/config.json")
    where = Where("layer", {"layer.g_idx": "c/model.safetensors"})
    g_idx = torch.arange(64) // 32
    assert torch.equal(check_g_idx(g_idx, fmt, 64, 2, where, "g_idx"), g_idx)
    with pytest.raises(ValueError, match=r"layer.g_idx \(in c/model.safetensors\) has shape "
                                         r"\(64,\).*expected an integer tensor of shape \(96,\)"):
        check_g_idx(g_idx, fmt, 96, 3, where, "g_idx")
    with pytest.raises(ValueError, match="expected an integer tensor"):
        check_g_idx(g_idx.float(), fmt, 64, 2, where, "g_idx")

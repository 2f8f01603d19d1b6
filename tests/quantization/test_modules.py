"""The quantized linears' math against a float reference (CPU; fp8's too)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmlab.quantization import Fp8Linear, Int8Linear, quantize_fp8, quantize_int8
from llmlab.quantization.base import linear_children, quantize_linears
from llmlab.quantization.fp8 import FP8_MAX, quantize_activations
from llmlab.quantization.int8 import INT8PACK_MAX_ROWS


def _linear(in_features, out_features, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    with torch.no_grad():  # one loud row: per-channel scales keep the others fine
        linear.weight[3] *= 50
    return linear.requires_grad_(False)


def test_int8_quantization_is_within_half_a_step_per_channel():
    w = _linear(64, 48).weight
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert int(q.abs().max()) == 127
    error = (q.float() * scale[:, None] - w).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-7).all())
    # dim=1: a transposed [in, out] weight gets the same numbers.
    qt, st = quantize_int8(w.t(), dim=1)
    assert torch.equal(qt.t(), q) and torch.equal(st, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, INT8PACK_MAX_ROWS, 37])
@pytest.mark.parametrize("in_features", [64, 60])  # 60: not a multiple of 16
def test_int8_linear_matches_its_dequantized_weight(dtype, rows, in_features):
    linear = _linear(in_features, 40, dtype=dtype)
    module = Int8Linear.from_linear(linear)
    assert (module.in_features, module.out_features) == (in_features, 40)
    x = torch.randn(2, rows, in_features).to(dtype)
    reference = x.float() @ module.dequantized_weight().t() + linear.bias.float()
    y = module(x)
    assert y.dtype == dtype and y.shape == (2, rows, 40)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    scale = reference.abs().max()
    assert float((y.float() - reference).abs().max() / scale) < tolerance
    # And close to the float layer: int8 rounding only.
    assert float((y.float() - linear(x).float()).abs().max() / scale) < 3e-2


def test_fp8_quantization_per_channel():
    w = _linear(64, 48).weight
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (48,)
    assert float(q.float().abs().amax(1).min()) == FP8_MAX
    relative = (q.float() * scale[:, None] - w).abs() / w.abs().amax(1, keepdim=True)
    assert float(relative.max()) < 2**-4  # e4m3: 3 mantissa bits


def _cpu_scaled_mm_is_rowwise() -> bool:
    """torch's CPU ``_scaled_mm`` takes per-row scales from 2.13 on (2.11 asserts per-tensor)."""
    a = torch.ones(2, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("kernel,rowwise", [
    ("dequantize", False), ("scaled_mm", False),
    pytest.param("scaled_mm", True, marks=pytest.mark.skipif(
        not _cpu_scaled_mm_is_rowwise(), reason="this torch's CPU _scaled_mm is per-tensor only")),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_a_float_reference(kernel, rowwise, dtype):
    """The module's own code paths (torch has a CPU ``_scaled_mm``) against the float
    layer, within fp8's error bound: e4m3 keeps 3 mantissa bits, so each rounded operand
    is within 2^-4 relative (plus a subnormal floor near zero); a dot product's error is
    then at most about 2 * 2^-4 * sum |w_i x_i|."""
    linear = _linear(64, 48, dtype=dtype)
    module = Fp8Linear.from_linear(linear)
    assert module.kernel == "dequantize"  # what finalize picks off CUDA
    module.kernel, module.rowwise = kernel, rowwise
    x = torch.randn(5, 64).to(dtype)
    y = module(x)
    assert y.dtype == dtype and y.shape == (5, 48)
    w, xf = linear.weight.detach().float(), x.float()
    reference = xf @ w.t() + linear.bias.detach().float()
    magnitude = xf.abs() @ w.abs().t()
    bound = (2 * 2**-4 + 1e-3) * magnitude + 2**-7 * reference.abs() + 1e-6
    error = (y.float() - reference).abs()
    assert bool((error <= bound).all()), float((error / bound).max())
    # And typically far inside it (errors of independent roundings partly cancel).
    assert float((error / magnitude).mean()) < 0.02


def test_dynamic_activation_scales():
    x = torch.randn(4, 32) * torch.tensor([[1.0], [10.0], [100.0], [0.0]])
    q, scale = quantize_activations(x, per_token=True)
    assert scale.shape == (4, 1) and q.dtype == torch.float8_e4m3fn
    back = q.float() * scale
    assert float(((back - x).abs().amax(1) / x.abs().amax(1).clamp(min=1)).max()) < 2**-4
    q, scale = quantize_activations(x, per_token=False)
    assert scale.shape == () and float(q.float().abs().max()) == FP8_MAX


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.inner = nn.Sequential(nn.Linear(32, 32, bias=False))
        self.lm_head = nn.Linear(32, 8, bias=False)
        self.score = nn.Linear(32, 2, bias=False)


def test_heads_stay_in_float_and_the_rest_is_replaced():
    model = _Tiny()
    assert {name for _, name, _ in linear_children(model)} == {"proj", "0"}
    assert quantize_linears(model, Int8Linear) == 2
    assert isinstance(model.proj, Int8Linear) and isinstance(model.inner[0], Int8Linear)
    assert type(model.lm_head) is nn.Linear and type(model.score) is nn.Linear
    assert model.proj.bias is not None and model.inner[0].bias is None

"""The Triton fused ops (CUDA's) against the torch chains they replace: on the GPU when
there is one, else in Triton's interpreter on CPU tensors (tests/conftest.py sets it)."""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels import triton_fused
from llmlab.kernels.triton_kernels import interpreting
from llmlab.models.layers import RMSNorm
from tests.models.test_fused import rotary_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _truncating(dtype) -> bool:
    """Triton's interpreter converts float32 to bfloat16 by truncation (the GPU rounds to
    nearest even), so there each rounding may be one unit further off."""
    return dtype == torch.bfloat16 and interpreting()


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    elif _truncating(dtype):  # a few roundings, each up to one unit off
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-5, atol=2**-5)
    else:  # one rounding apart at most, where a float32 sum's order differs
        eps = 2**-7 if dtype == torch.bfloat16 else 2**-10
        torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=1e-5)
        assert (got != want).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 100), (33, 1024)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_the_torch_chain(dtype, rows, dim, with_residual):
    gen = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(rows, dim, generator=gen).to(dtype).to(DEVICE)
    norm = RMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen))
    norm = norm.to(dtype).to(DEVICE)
    summed = x + residual if with_residual else x
    want = norm(summed)
    given = residual.clone() if with_residual else None
    got, got_residual = triton_fused.add_rms_norm(x, given, norm.weight.data, norm.eps)
    _close(got, want, dtype)
    if _truncating(dtype):
        _close(got_residual, summed, dtype)
    else:
        assert torch.equal(got_residual, summed)  # the add rounds exactly like torch's
    if with_residual:
        assert got_residual.data_ptr() == given.data_ptr()  # written in place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,half", [(1, 16), (5, 1408), (3, 3000)])
def test_silu_and_mul_matches_the_torch_chain(dtype, rows, half):
    gen = torch.Generator().manual_seed(rows + half)
    gate_up = (4 * torch.randn(rows, 2 * half, generator=gen)).to(dtype).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    _close(triton_fused.silu_and_mul(gate_up), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (32, 16)])
def test_rotary_in_place_matches_apply_rotary_on_strided_views(dtype, head_dim, rotary_dim):
    qkv, q, k, cos, sin, want_q, want_k, v_start = rotary_case(dtype, head_dim, rotary_dim,
                                                               DEVICE)
    before = qkv.clone()
    got_q, got_k = triton_fused.rotary_(q, cos, sin), triton_fused.rotary_(k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place, in the projection's output
    if dtype == torch.float32 or _truncating(dtype):  # FMA on a GPU; truncation
        _close(got_q, want_q, dtype)
        _close(got_k, want_k, dtype)
    else:  # each product and the sum round as the chain's tensors do: equal
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, v_start:], before[:, v_start:])  # v untouched


def test_the_self_check_passes_and_names_what_fails(monkeypatch):
    assert triton_fused.self_check(torch.device(DEVICE), torch.float32, hidden=64,
                                   head_dim=32, rotary_dim=32, inner=96) is None

    def broken(gate_up):
        return torch.zeros(*gate_up.shape[:-1], gate_up.shape[-1] // 2, dtype=gate_up.dtype,
                           device=gate_up.device)

    monkeypatch.setattr(triton_fused, "silu_and_mul", broken)
    reason = triton_fused.self_check(torch.device(DEVICE), torch.float32, hidden=64,
                                     head_dim=32, rotary_dim=32, inner=96)
    assert reason is not None and "silu_and_mul" in reason

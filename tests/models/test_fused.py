"""The fused CPU elementwise ops against the torch chains they replace."""

from __future__ import annotations

import pytest
import torch

from llmlab import LLM
from llmlab.kernels import cpu_kernels, fused
from llmlab.kernels.fused import apply_rotary
from llmlab.models.layers import RMSNorm
from llmlab.sampling.greedy import argmax_logprob

pytestmark = pytest.mark.skipif(
    cpu_kernels.unavailable_reason() is not None, reason=str(cpu_kernels.unavailable_reason())
)
DTYPES = [torch.float32, torch.bfloat16]


def _plain(monkeypatch):
    """Make the fused module take its torch path."""
    monkeypatch.setattr(fused, "_kernels", lambda *tensors: None)


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:  # one bf16 rounding apart at most, where a float32 sum's order differs
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
        assert (got != want).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 100), (64, 512), (300, 1024)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_the_torch_chain(monkeypatch, dtype, rows, dim, with_residual):
    gen = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=gen).to(dtype)
    residual = torch.randn(rows, dim, generator=gen).to(dtype) if with_residual else None
    norm = RMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen))
    norm = norm.to(dtype)
    # The model's own modules are the reference: x + residual, then RMSNorm.
    summed = x + residual if with_residual else x
    want = norm(summed)
    got, got_residual = fused.add_rms_norm(
        x, None if residual is None else residual.clone(), norm.weight.data, norm.eps
    )
    _close(got, want, dtype)
    assert torch.equal(got_residual, summed)  # the add rounds exactly like torch's
    _plain(monkeypatch)
    plain, _ = fused.add_rms_norm(x, None if residual is None else residual.clone(),
                                  norm.weight.data, norm.eps)
    assert torch.equal(plain, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,half", [(1, 16), (5, 1408), (64, 1408), (130, 100)])
def test_silu_and_mul_matches_the_torch_chain(dtype, rows, half):
    gen = torch.Generator().manual_seed(rows + half)
    gate_up = (4 * torch.randn(rows, 2 * half, generator=gen)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    _close(fused.silu_and_mul(gate_up), want, dtype)


def rotary_case(dtype, head_dim: int, rotary_dim: int, device="cpu"):
    """A fused q/k/v projection output with q and k as strided views into it, the angles,
    and the torch chain's rotated q and k: ``(qkv, q, k, cos, sin, want_q, want_k, v_start)``."""
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads = 9, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qkv = qkv.to(device)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, rotary_dim // 2, generator=gen) * 100
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return qkv, q, k, cos, sin, want_q, want_k, (heads + kv_heads) * head_dim


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (32, 16)])
def test_rotary_in_place_matches_apply_rotary_on_strided_views(dtype, head_dim, rotary_dim):
    qkv, q, k, cos, sin, want_q, want_k, v_start = rotary_case(dtype, head_dim, rotary_dim)
    before = qkv.clone()
    got_q, got_k = fused.rotary_(q, cos, sin), fused.rotary_(k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place, in the projection's output
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    assert torch.equal(qkv[:, v_start:], before[:, v_start:])  # v untouched


def test_the_engine_fuses_on_cpu_unless_told_not_to(tiny_llama):
    assert LLM(tiny_llama, device="cpu", dtype="float32").llm_engine.executor.model.fused_ops
    plain = LLM(tiny_llama, device="cpu", dtype="float32", cpu_fused_ops=False)
    assert not plain.llm_engine.executor.model.fused_ops


@pytest.mark.parametrize("rows,vocab", [(1, 5), (3, 1000), (64, 8000), (2, 151936)])
def test_argmax_logprob_matches_argmax_and_log_softmax(rows, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = 5 * torch.randn(rows, vocab, generator=gen)
    logits[0, vocab // 2] = logits[0, vocab - 1] = logits[0].max() + 1  # a tie: first wins
    if rows > 2:
        logits[2] = -1e30  # flat row: token 0, logprob -log(vocab)
    tokens, logprobs = argmax_logprob(logits)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens[0] == vocab // 2
    want = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, want, rtol=1e-5, atol=1e-5)

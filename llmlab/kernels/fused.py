"""Fused elementwise ops for the CPU fast path (and CUDA's), each with its plain-torch
equivalent.

(Greedy sampling's fused argmax + logprob is :func:`llmlab.sampling.greedy.argmax_logprob`.)

On CPU a decode step's activations are small (``[batch, hidden]``), so a chain of torch
ops (residual add, RMSNorm's cast / normalise / cast / scale; rotary's split / negate /
concatenate / two products / sum; SiLU then the product with ``up``) costs more in
dispatches and passes over memory than in arithmetic. Each function here runs one C++
kernel from :mod:`llmlab.kernels.cpu_kernels` when every tensor is a contiguous CPU
float32/bfloat16 tensor of one dtype and the kernels load, and the torch chain otherwise.
Both round at the same points, so float32 results differ only in summation order and
bfloat16 ones agree to the last rounding of a sum. Contiguous CUDA tensors go to the
Triton kernels of :mod:`llmlab.kernels.triton_fused`, which round at the same points
too. :func:`apply_rotary`, rotary's torch chain, lives here too, so the models take it
from here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmlab.kernels import cpu_kernels

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _kernels(*tensors: torch.Tensor):
    """The loaded kernels if all ``tensors`` can go to them, else None."""
    first = tensors[0]
    code = _DTYPE_CODES.get(first.dtype)
    if code is None or first.device.type != "cpu":
        return None
    if any(t.dtype != first.dtype or t.device.type != "cpu" for t in tensors):
        return None
    return cpu_kernels.load()


def _triton(*tensors: torch.Tensor, strided: torch.Tensor | None = None):
    """:mod:`llmlab.kernels.triton_fused` if it takes all ``tensors`` (contiguous, on CUDA)
    and ``strided`` (any strides), else None."""
    if tensors[0].device.type != "cuda" or not all(t.is_contiguous() for t in tensors):
        return None
    from llmlab.kernels import triton_fused

    given = tensors if strided is None else (strided, *tensors)
    return triton_fused if triton_fused.supports(*given) else None


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rms_norm(x + residual), x + residual)``, the pair a pre-norm block needs
    (``residual=None``: ``(weight * rms_norm(x), x)``). May update ``residual`` in place."""
    gpu = _triton(x, weight) if residual is None else _triton(x, residual, weight)
    if gpu is not None:
        return gpu.add_rms_norm(x, residual, weight, eps)
    kernels = _kernels(x, weight) if residual is None else _kernels(x, residual, weight)
    if kernels is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
        dim = x.shape[-1]
        out = torch.empty_like(x)
        kernels.add_rms_norm(
            _DTYPE_CODES[x.dtype], x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
            torch.get_num_threads(),
        )
        return out, (x if residual is None else residual)
    summed = x if residual is None else x + residual
    normed = F.rms_norm(summed.float(), (summed.shape[-1],), eps=eps)
    return weight * normed.to(summed.dtype), summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = cat(gate, up)`` along the last axis."""
    gpu = _triton(gate_up)
    if gpu is not None:
        return gpu.silu_and_mul(gate_up)
    kernels = _kernels(gate_up)
    if kernels is not None and gate_up.is_contiguous():
        half = gate_up.shape[-1] // 2
        out = torch.empty((*gate_up.shape[:-1], half), dtype=gate_up.dtype)
        kernels.silu_and_mul(
            _DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(),
            gate_up.numel() // (2 * half), half, torch.get_num_threads(),
        )
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` in place, NeoX-style, like :func:`apply_rotary`
    (``cos``/``sin`` ``[T, rotary_dim]``); returns ``x``. ``x`` may be a strided view (e.g.
    into a fused q/k/v output)."""
    gpu = _triton(cos, sin, strided=x) if x.stride(-1) == 1 and x.dim() == 3 else None
    if gpu is not None:
        return gpu.rotary_(x, cos, sin)
    kernels = _kernels(x, cos, sin)
    if (
        kernels is not None and x.stride(-1) == 1 and cos.is_contiguous()
        and sin.is_contiguous() and x.dim() == 3
    ):
        kernels.rotary(
            _DTYPE_CODES[x.dtype], x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
            x.stride(1), cos.data_ptr(), sin.data_ptr(), cos.shape[-1],
            torch.get_num_threads(),
        )
        return x
    x.copy_(apply_rotary(x, cos, sin))
    return x


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by
    :meth:`llmlab.models.layers.RotaryEmbedding.cos_sin` angles.

    When the angles cover fewer channels than ``head_dim`` (partial rotary), only the
    leading ones rotate and the rest pass through.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return _rotate(x, cos, sin)
    return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    return x * cos[:, None, :] + rotated_half * sin[:, None, :]

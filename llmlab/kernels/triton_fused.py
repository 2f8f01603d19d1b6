"""Triton versions of :mod:`llmlab.kernels.fused`'s elementwise ops, for CUDA.

A decode step of a Llama-family model runs, per layer, a residual add and RMSNorm twice
(torch: add, cast to float32, norm, cast back, scale: five kernels), rotary on q and k
(split, negate, concatenate, two products, a sum: about ten) and SiLU-and-multiply (three).
On an H200 these ~20 launches a layer were ~2.1 ms of a 8.8 ms step at 256 running and most
of a single sequence's 2.5 ms (``BENCHMARKS.md``, "Offline throughput on a GPU"). Each
function here is one kernel that rounds where the torch chain rounds (every intermediate
the chain holds in the model dtype is rounded to it here too), so results match the chain
up to the order of the norm's sum.

One program handles one row (a token; for rotary a token's head), whose width fits one
block: hidden sizes up to :data:`MAX_WIDTH`. Kernels are plain functions wrapped by
``triton.jit`` on first use, so they also run in Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, how the tests check them) and compile ahead of time for sm_90
(:func:`llmlab.kernels.triton_kernels.compile_for_target`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The widest row one program takes whole (registers: 16K float32 lanes over its warps).
MAX_WIDTH = 16384
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    stride_x, stride_res, stride_out, dim, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # the chain's rounded sum
        tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    normed = (xf * inv).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, half,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < half
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + half + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols,
             (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, stride_tok, stride_head, rot,
    HALF_BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    half = rot // 2
    i = tl.arange(0, HALF_BLOCK)
    mask = i < half
    base = x_ptr + tok * stride_tok + head * stride_head
    x1 = tl.load(base + i, mask=mask, other=0.0)
    x2 = tl.load(base + half + i, mask=mask, other=0.0)
    dt = x1.dtype
    c1 = tl.load(cos_ptr + tok * rot + i, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + tok * rot + half + i, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + tok * rot + i, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + tok * rot + half + i, mask=mask, other=0.0).to(tl.float32)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product rounded as the chain's tensors are.
    out1 = ((a * c1).to(dt).to(tl.float32) + (-b * s1).to(dt).to(tl.float32)).to(dt)
    out2 = ((b * c2).to(dt).to(tl.float32) + (a * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(base + i, out1, mask=mask)
    tl.store(base + half + i, out2, mask=mask)


KERNELS = {
    "add_rms_norm": _add_rms_norm_kernel,
    "silu_and_mul": _silu_and_mul_kernel,
    "rotary": _rotary_kernel,
}


def _kernel(name: str):
    from llmlab.kernels.triton_kernels import kernel

    return kernel(KERNELS[name])


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """(rows, row stride) of contiguous ``t`` seen as ``[rows, last dim]``."""
    if not t.is_contiguous():
        raise ValueError("the fused kernels take contiguous tensors here")
    return t.numel() // max(1, t.shape[-1]), t.shape[-1]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rms_norm(x + residual), x + residual)``, the sum written into
    ``residual`` in place (``residual=None``: ``(weight * rms_norm(x), x)``)."""
    dim = x.shape[-1]
    rows, stride_x = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    stride_res = _rows(residual)[1] if residual is not None else 0
    if rows:
        _kernel("add_rms_norm")[(rows,)](
            x, residual if residual is not None else x, weight, out,
            stride_x, stride_res, _rows(out)[1], dim, eps,
            HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(dim),
        )
    return out, (x if residual is None else residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = cat(gate, up)`` along the last axis."""
    half = gate_up.shape[-1] // 2
    rows, stride_in = _rows(gate_up)
    out = torch.empty((*gate_up.shape[:-1], half), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(half))
    if rows:
        _kernel("silu_and_mul")[(rows, triton.cdiv(half, block))](
            gate_up, out, stride_in, half, half, BLOCK=block,
        )
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` (any strides, unit-stride last axis) in place,
    NeoX-style, by ``cos``/``sin`` ``[T, rotary_dim]`` (contiguous); returns ``x``."""
    tokens, heads, _ = x.shape
    rot = cos.shape[-1]
    if x.stride(-1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rotary_ needs a unit-stride head_dim and contiguous cos/sin")
    if tokens and heads:
        _kernel("rotary")[(tokens, heads)](
            x, cos, sin, x.stride(0), x.stride(1), rot,
            HALF_BLOCK=triton.next_power_of_2(max(1, rot // 2)),
        )
    return x


def supports(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can go to the kernels: on CUDA (or any device under Triton's
    interpreter), one dtype among :data:`DTYPES`, rows no wider than :data:`MAX_WIDTH`."""
    from llmlab.kernels.triton_kernels import interpreting

    first = tensors[0]
    device_ok = first.device.type == "cuda" or interpreting()
    return (
        device_ok and first.dtype in DTYPES and first.shape[-1] <= MAX_WIDTH
        and all(t.device == first.device and t.dtype == first.dtype for t in tensors)
    )


class _Mismatch(Exception):
    pass


def self_check(device: torch.device, dtype: torch.dtype, *, hidden: int, head_dim: int,
               rotary_dim: int, inner: int) -> str | None:
    """Run each kernel once at a model's sizes against the torch chain it replaces (which
    also compiles the variants the model will use): None when every one agrees to within
    ``dtype``'s rounding, else why not (a compile error, a wrong result). The engine
    builder calls it before turning the kernels on, so a kernel the GPU's compiler or
    hardware gets wrong costs speed, not tokens."""
    import torch.nn.functional as F

    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        if not err <= tol:  # NaN fails too
            raise _Mismatch(f"{name} differs from the torch ops by {err:.2e} (> {tol:g})")

    try:
        x, res, weight = rand(4, hidden), rand(4, hidden), rand(hidden)
        summed = x + res
        got, got_sum = add_rms_norm(x, res.clone(), weight, 1e-6)
        check("add_rms_norm", got,
              weight * F.rms_norm(summed.float(), (hidden,), eps=1e-6).to(dtype))
        check("add_rms_norm's sum", got_sum, summed)
        alone, _ = add_rms_norm(x, None, weight, 1e-6)  # the first layer's: no residual yet
        check("add_rms_norm", alone, weight * F.rms_norm(x.float(), (hidden,), eps=1e-6).to(dtype))
        gate_up = rand(4, 2 * inner)
        gate, up = gate_up.chunk(2, dim=-1)
        check("silu_and_mul", silu_and_mul(gate_up), F.silu(gate) * up)
        q = rand(4, 2, head_dim)
        angles = torch.rand(4, rotary_dim // 2, generator=gen) * 100
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
        # The torch chain (fused.apply_rotary): the leading rotary_dim channels rotate.
        want, part = q.clone(), q[..., :rotary_dim]
        first, second = part.chunk(2, dim=-1)
        want[..., :rotary_dim] = (part * cos[:, None, :]
                                  + torch.cat((-second, first), dim=-1) * sin[:, None, :])
        check("rotary_", rotary_(q.clone(), cos, sin), want)
    except _Mismatch as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - a compile or launch failure is the reason
        return f"{type(err).__name__}: {err}"
    return None

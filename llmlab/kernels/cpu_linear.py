"""Prepacked oneDNN linears for CPU inference.

``F.linear`` on CPU multiplies by a weight in its plain row-major layout, which MKL
re-blocks on every call. oneDNN can reorder a weight once, at load time, into the blocked
layout its kernels read (``torch.ops.mkldnn._reorder_linear_weight``) and then run
``_linear_pointwise`` against it: the same math (float32 results agree to rounding, about
1e-6 relative), with far less time per call on the small row counts of decode steps.

:func:`prepack_linears` swaps every ``nn.Linear`` of a loaded model, and its LM head, for
the packed form; the plain path stays for parity tests (``cpu_linear="plain"``).
"""

from __future__ import annotations

import torch
from torch import nn


def onednn_unavailable_reason() -> str | None:
    """Why prepacked oneDNN linears cannot run here (None when they can)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return "this torch build lacks mkldnn._reorder_linear_weight/_linear_pointwise"
    return None


def auto_packed_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes ``cpu_linear="auto"`` packs: float32, and bfloat16 where oneDNN runs bf16
    natively (avx512_bf16 or AMX; elsewhere it would emulate it)."""
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([out, in]) reordered once into oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` against a weight from :func:`pack_weight`."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight lives in oneDNN's blocked layout (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight", pack_weight(weight), persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach(), persistent=False
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a :class:`PackedLinear`, and pack the
    LM head (tied or not) for ``compute_logits``; returns how many weights were packed.

    Call after the weights are loaded, on a CPU model; the plain weights of replaced
    layers are dropped (a tied embedding keeps its own table for the lookup).
    """
    reason = onednn_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cannot prepack linears: {reason}")
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child is not getattr(model, "lm_head", None):
                setattr(module, name, PackedLinear.from_linear(child))
                count += 1
    head = getattr(model, "lm_head", None)
    weight = head.weight if head is not None else model.input_embedding().weight
    model.packed_head = PackedLinear(weight)
    return count + 1

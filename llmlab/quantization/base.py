"""What every weight-only scheme shares: the quantized linear's shape, and swapping a model's
linears for quantized ones.

A scheme is a :class:`QuantizedLinear` subclass with a ``scheme`` name, a ``weight_dtype``,
``quantize(weight) -> (q, scale)`` (per output channel) and ``forward``. Its parameters
carry the checkpoint's names (``weight``, ``weight_scale``, ``bias``), so a checkpoint
saved in the scheme loads into it through the models' ordinary weight maps
(:func:`llmlab.models.weights.load_mapped_weights` sends each ``X.weight_scale`` where
``X.weight``'s output rows go).

What is quantized: every ``nn.Linear`` of the model except its heads (``lm_head``, a
classifier's ``score``), as vLLM does; embeddings and norms stay in the model dtype. The
quantized modules expose ``in_features``, ``out_features``, ``bias`` and ``forward(x)``,
which is all a LoRA wrapper or oneDNN prepacking (which leaves them alone) relies on.
"""

from __future__ import annotations

import torch
from torch import nn

# Model attributes holding heads, which stay in the model dtype.
HEAD_NAMES = ("lm_head", "score")


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored quantized, with one float32 scale per output
    channel; ``forward`` computes ``x @ (q * scale).T + bias`` in ``x``'s dtype.

    Subclasses set ``scheme``, ``weight_dtype``, implement ``quantize`` and ``forward``,
    and may extend :meth:`finalize` (called once the parameters hold their values).
    """

    scheme: str = ""
    weight_dtype: torch.dtype

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.activation_dtype = dtype
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=self.weight_dtype, device=device),
            requires_grad=False,
        )
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                         requires_grad=False)
            if bias else None
        )

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``weight`` ``[out, in]`` -> (quantized ``[out, in]``, float32 scales ``[out]``)."""
        raise NotImplementedError

    @classmethod
    def from_linear(cls, linear: nn.Module) -> QuantizedLinear:
        """A quantized copy of a loaded ``nn.Linear`` (the original is left as it was)."""
        weight = linear.weight
        module = cls(
            linear.in_features, linear.out_features, linear.bias is not None, weight.dtype,
            weight.device,
        )
        q, scale = cls.quantize(weight)
        with torch.no_grad():
            module.weight.copy_(q)
            module.weight_scale.copy_(scale)
            if linear.bias is not None:
                module.bias.copy_(linear.bias)
        module.finalize()
        return module

    def finalize(self) -> None:
        """Prepare for ``forward`` once the parameters are filled (at load time)."""
        if self.bias is not None:
            self.activation_dtype = self.bias.dtype

    def dequantized_weight(self) -> torch.Tensor:
        """``q * scale`` ``[out, in]`` in float32 (for checks and references)."""
        return self.weight.float() * self.weight_scale.float()[:, None]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, {self.scheme}"
        )


def _heads(model: nn.Module) -> set[int]:
    return {id(getattr(model, name)) for name in HEAD_NAMES if getattr(model, name, None)
            is not None}


def linear_children(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, attribute, linear)`` for every ``nn.Linear`` that a scheme quantizes."""
    heads = _heads(model)
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and id(child) not in heads:
                found.append((parent, name, child))
    return found


def quantize_linears(model: nn.Module, cls: type[QuantizedLinear]) -> int:
    """Replace every quantizable ``nn.Linear`` of a loaded model by ``cls.from_linear``
    (its float weight is dropped); returns how many were replaced."""
    places = [(parent, name) for parent, name, _ in linear_children(model)]
    for parent, name in places:
        # One layer at a time, holding no other reference, so each float weight is freed
        # as its quantized copy is made: the peak stays about the float model's size.
        setattr(parent, name, cls.from_linear(getattr(parent, name)))
    return len(places)


def empty_quantized_linears(model: nn.Module, cls: type[QuantizedLinear]) -> int:
    """Replace every quantizable ``nn.Linear`` by an unfilled ``cls`` of the same shape, on
    the same device (``meta`` before materialisation), for a quantized checkpoint to fill."""
    replaced = linear_children(model)
    for parent, name, linear in replaced:
        weight = linear.weight
        setattr(parent, name, cls(
            linear.in_features, linear.out_features, linear.bias is not None, weight.dtype,
            weight.device,
        ))
    return len(replaced)


def finalize_quantized(model: nn.Module) -> int:
    """Call ``finalize`` on every quantized linear (after a checkpoint filled them)."""
    modules = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for module in modules:
        module.finalize()
    return len(modules)

"""Weight-only-stored fp8: float8 e4m3 weights with per-output-channel float32 scales.

Weights are quantized per output channel (``max |w| / 448``; a checkpoint's per-tensor
scale is accepted and spread over the channels). At run time, where the GPU has fp8 tensor
cores (CUDA compute capability >= 8.9), activations are quantized dynamically and the
product runs in ``torch._scaled_mm`` (the "FP8 dynamic" scheme of vLLM and llm-compressor):

* activations get one scale per token (so a token's result never depends on the rest
  of the batch), weights one per output channel;
* for bfloat16 on compute capability >= 9.0 both scales are applied inside
  ``_scaled_mm`` (its row-wise scaling); otherwise it returns the unscaled products in
  float32 and both scales are applied to that.

Elsewhere on CUDA (and for a layer whose sizes ``_scaled_mm`` cannot take: both must be
multiples of 16) the weight is dequantized and multiplied in the model dtype. The engine
refuses fp8 on CPU; the math itself runs there (torch has a CPU ``_scaled_mm``), which is
how the tests check it against a float reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmlab.quantization.base import QuantizedLinear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Below this compute capability CUDA has no fp8 matmul.
SCALED_MM_CAPABILITY = (8, 9)
ROWWISE_CAPABILITY = (9, 0)


def quantize_fp8(weight: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``weight`` as float8 e4m3 with one float32 scale per index of ``dim``
    (the output channels), ``scale = max |w| / 448``."""
    w = weight.detach().float()
    reduce = 1 - dim
    scale = w.abs().amax(dim=reduce, keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.squeeze(reduce)


def quantize_activations(
    x: torch.Tensor, per_token: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic fp8 quantization of ``[rows, in]`` activations: ``(q, scale)`` with a
    float32 scale per row (``[rows, 1]``) or for the whole tensor (``[]``)."""
    amax = x.abs().amax(dim=-1, keepdim=True) if per_token else x.abs().amax()
    scale = amax.float().clamp(min=1e-12) / FP8_MAX
    q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


class Fp8Linear(QuantizedLinear):
    """A linear layer with float8 e4m3 weights ``[out, in]`` and float32 ``weight_scale``
    ``[out]``, bias in the model dtype. ``kernel`` is ``"scaled_mm"`` or ``"dequantize"``
    (chosen by :meth:`finalize` from the device; settable, e.g. by tests)."""

    scheme = "fp8"
    weight_dtype = FP8_DTYPE

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8(weight)

    def finalize(self) -> None:
        super().finalize()
        self.kernel = "dequantize"
        self.rowwise = False
        device = self.weight.device
        fits = self.in_features % 16 == 0 and self.out_features % 16 == 0
        if device.type == "cuda" and fits:
            capability = torch.cuda.get_device_capability(device)
            if capability >= SCALED_MM_CAPABILITY:
                self.kernel = "scaled_mm"
                self.rowwise = (
                    capability >= ROWWISE_CAPABILITY and self.activation_dtype == torch.bfloat16
                )
        self.register_buffer("_scale", self.weight_scale.to(self.activation_dtype),
                             persistent=False)
        self.register_buffer("_one", torch.ones((), dtype=torch.float32, device=device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel == "scaled_mm":
            y = self._scaled_mm(rows)
        else:
            y = F.linear(rows, self.weight.to(x.dtype)) * self._scale.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _scaled_mm(self, rows: torch.Tensor) -> torch.Tensor:
        # Per token either way: a token's result never depends on what else is in the batch.
        q, scale = quantize_activations(rows, per_token=True)
        # weight.t() is [in, out] column-major: the layout _scaled_mm wants for its second
        # operand.
        if self.rowwise:
            return torch._scaled_mm(
                q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale.view(1, -1),
                out_dtype=rows.dtype,
            )
        # Without row-wise scaling: unscaled products in float32, both scales applied after.
        y = torch._scaled_mm(
            q, self.weight.t(), scale_a=self._one, scale_b=self._one, out_dtype=torch.float32
        )
        return (y * scale * self.weight_scale).to(rows.dtype)

"""Weight-only int8: per-output-channel symmetric int8 weights, activations in the model dtype.

Each output channel (row of ``[out, in]``) keeps its own scale, ``max |w| / 127``, so one
outlier row does not cost the others their precision (the per-channel scheme of
LLM.int8()'s weight side, Dettmers et al., 2022, without its outlier decomposition; vLLM's
and torchao's "int8 weight-only"). ``y = (x @ q.T) * scale + bias``: the scale is applied
to the output, so the matmul reads integers that convert to the activation dtype exactly.

Kernels (picked per call by row count; numbers in BENCHMARKS.md, "Weight-only
quantization", from ``benchmarks/quantization.py --kernels``):

* ``torch._weight_int8pack_mm`` (ATen's int8 weight-only matmul, CPU and recent CUDA)
  for bfloat16 / float16 activations at decode-sized row counts, where it reads half the
  bytes of a bf16 matmul. On this torch's CPU build it is a GEMV-style loop: 2x faster
  than bf16 at one row, slower from about 8 rows, and 20-100x slower than float32 for
  float32 activations, so it is never used for those. It crashed on inner sizes that are
  not a multiple of 16, which therefore take the other path.
* Otherwise dequantize-then-matmul: ``F.linear(x, q.to(x.dtype)) * scale``. The int8 ->
  float conversion is exact; it costs one pass over the weight per call, small next to a
  prefill chunk's matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmlab.quantization.base import QuantizedLinear

# Most rows a call may have for ``_weight_int8pack_mm`` (bf16 / fp16 activations); above it
# dequantize-then-matmul wins (measured on CPU at 1, 4, 8, 16 rows: BENCHMARKS.md).
INT8PACK_MAX_ROWS = 8
_INT8PACK_DTYPES = (torch.bfloat16, torch.float16)


def quantize_int8(weight: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``weight`` as int8 with one float32 scale per index of ``dim`` (the
    output channels: dim 0 of ``[out, in]``, dim 1 of a transposed ``[in, out]``).
    Symmetric, round to nearest, so ``q * scale`` is within ``scale / 2`` of ``weight``."""
    w = weight.detach().float()
    reduce = 1 - dim
    scale = w.abs().amax(dim=reduce, keepdim=True).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.squeeze(reduce)


class Int8Linear(QuantizedLinear):
    """A linear layer with int8 weights ``[out, in]`` and float32 ``weight_scale`` ``[out]``
    (the checkpoint's names), bias in the model dtype. Inference only."""

    scheme = "int8"
    weight_dtype = torch.int8

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8(weight)

    def finalize(self) -> None:
        super().finalize()
        # The kernels take the scale in the activation dtype.
        self.register_buffer(
            "_scale", self.weight_scale.to(self.activation_dtype), persistent=False
        )
        self._int8pack = (
            self.activation_dtype in _INT8PACK_DTYPES
            and self.in_features % 16 == 0
            and _int8pack_runs(self.weight.device, self.activation_dtype)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self._int8pack and rows.shape[0] <= INT8PACK_MAX_ROWS and x.dtype == self._scale.dtype:
            y = torch._weight_int8pack_mm(rows.contiguous(), self.weight, self._scale)
        else:
            y = F.linear(rows, self.weight.to(x.dtype)) * self._scale.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


_INT8PACK_PROBED: dict[tuple[str, torch.dtype], bool] = {}


def _int8pack_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._weight_int8pack_mm`` runs on this device type for ``dtype``
    (CUDA gained it in torch 2.9; older builds raise ``NotImplementedError``)."""
    key = (device.type, dtype)
    if key not in _INT8PACK_PROBED:
        try:
            x = torch.ones(1, 32, dtype=dtype, device=device)
            q = torch.ones(16, 32, dtype=torch.int8, device=device)
            y = torch._weight_int8pack_mm(x, q, torch.ones(16, dtype=dtype, device=device))
            _INT8PACK_PROBED[key] = bool((y == 32).all())
        except (RuntimeError, NotImplementedError, AttributeError):
            _INT8PACK_PROBED[key] = False
    return _INT8PACK_PROBED[key]

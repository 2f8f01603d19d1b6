"""Weight-only quantization applied at load time (``LLM(..., quantization="int8")``), and
quantized checkpoints (:func:`save_quantized`). See ``docs/quantization.md``.

* :mod:`~llmlab.quantization.int8`: per-output-channel symmetric int8 weights,
  activations in the model dtype (CPU and CUDA).
* :mod:`~llmlab.quantization.fp8`: float8 e4m3 weights with per-channel scales; on CUDA
  with compute capability >= 8.9, ``torch._scaled_mm`` with dynamically quantized
  activations (CUDA only).
* :mod:`~llmlab.quantization.base`: the quantized linear's shape, swapping a model's
  linears (not its head or embeddings).
* :mod:`~llmlab.quantization.checkpoint`: the checkpoint layout (compressed-tensors'),
  reading it, :func:`save_quantized`.
* :mod:`~llmlab.quantization.loading`: :func:`resolve_quantization` (before any weight
  loads) and :class:`QuantizationSpec` (each rank's load).
"""

from llmlab.quantization.base import QuantizedLinear, quantize_linears
from llmlab.quantization.checkpoint import checkpoint_scheme, save_quantized
from llmlab.quantization.fp8 import Fp8Linear, quantize_fp8
from llmlab.quantization.int8 import Int8Linear, quantize_int8
from llmlab.quantization.loading import SCHEMES, QuantizationSpec, resolve_quantization

__all__ = [
    "SCHEMES",
    "Fp8Linear",
    "Int8Linear",
    "QuantizationSpec",
    "QuantizedLinear",
    "checkpoint_scheme",
    "quantize_fp8",
    "quantize_int8",
    "quantize_linears",
    "resolve_quantization",
    "save_quantized",
]

"""Weight-only quantization applied at load time (``LLM(..., quantization="int8")``), and
quantized checkpoints (:func:`save_quantized`). See ``docs/quantization.md``.

* :mod:`~llmlab.quantization.int8`: per-output-channel symmetric int8 weights,
  activations in the model dtype (CPU and CUDA).
* :mod:`~llmlab.quantization.fp8`: float8 e4m3 weights with per-channel scales; on CUDA
  with compute capability >= 8.9, ``torch._scaled_mm`` with dynamically quantized
  activations (CUDA only).
* :mod:`~llmlab.quantization.w4a16`: 4-bit checkpoints' linear (W4A16), one canonical
  layout for every format; :mod:`~llmlab.quantization.int4_formats` (their configs),
  :mod:`~llmlab.quantization.int4_unpack` (their tensor layouts),
  :mod:`~llmlab.quantization.int4_loading` (into the models).
* :mod:`~llmlab.quantization.base`: the quantized linear's shape, swapping a model's
  linears (not its head or embeddings).
* :mod:`~llmlab.quantization.checkpoint`: the checkpoint layout (compressed-tensors'),
  reading it, :func:`save_quantized`.
* :mod:`~llmlab.quantization.loading`: :func:`resolve_quantization` (before any weight
  loads) and :class:`QuantizationSpec` (each rank's load).
* :mod:`~llmlab.quantization.memory`: :func:`weight_memory`, a model's weight bytes.
"""

from llmlab.quantization.base import QuantizedLinear, quantize_linears
from llmlab.quantization.checkpoint import checkpoint_scheme, save_quantized
from llmlab.quantization.fp8 import Fp8Linear, quantize_fp8
from llmlab.quantization.int4_formats import Int4Format
from llmlab.quantization.int8 import Int8Linear, quantize_int8
from llmlab.quantization.loading import SCHEMES, QuantizationSpec, resolve_quantization
from llmlab.quantization.memory import WeightMemory, weight_memory
from llmlab.quantization.w4a16 import W4A16Linear

__all__ = [
    "SCHEMES",
    "Fp8Linear",
    "Int4Format",
    "Int8Linear",
    "QuantizationSpec",
    "QuantizedLinear",
    "W4A16Linear",
    "WeightMemory",
    "checkpoint_scheme",
    "quantize_fp8",
    "quantize_int8",
    "quantize_linears",
    "resolve_quantization",
    "save_quantized",
    "weight_memory",
]

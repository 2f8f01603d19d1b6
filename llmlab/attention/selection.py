"""What ``attention_backend="auto"`` means on each device and dtype."""

from __future__ import annotations

import warnings

import torch


def auto_backend(device: torch.device, dtype: torch.dtype | None = None):
    """The backend ``attention_backend="auto"`` picks:

    * CUDA: the Triton kernels when triton can run them and they compile for ``dtype``
      (float32, bfloat16, float16), else the torch reference;
    * CPU: llmlab's C++ kernels (:class:`~llmlab.attention.cpu_backend.CpuPagedAttention`)
      for float32 and bfloat16 (``dtype=None``: either), else the torch reference. When
      the kernels cannot load (no C++ compiler, say) a ``RuntimeWarning`` says why, and
      the torch reference runs: correct, but several times slower at attention.
    """
    from llmlab.attention import cpu_backend, triton_backend
    from llmlab.attention.torch_backend import TorchPagedAttention

    if device.type == "cuda":
        if triton_backend.triton_unavailable_reason(device) is None and (
            dtype is None or dtype in triton_backend.TRITON_DTYPES
        ):
            return triton_backend.TritonPagedAttention()
        return TorchPagedAttention()
    if device.type == "cpu" and (dtype is None or dtype in cpu_backend.DTYPE_CODES):
        reason = cpu_backend.cpu_kernels_unavailable_reason(device)
        if reason is None:
            return cpu_backend.CpuPagedAttention()
        warnings.warn(
            f"llmlab's CPU attention kernels are unavailable ({reason}); falling back to "
            "the torch attention backend, which is slower",
            RuntimeWarning,
            stacklevel=2,
        )
    return TorchPagedAttention()

"""Attention backends: the interface, the plain-torch paged reference, the Triton kernels
and the C++ CPU kernels.

``attention_backend="auto"`` (the default) picks :class:`TritonPagedAttention` on CUDA when
triton imports, :class:`CpuPagedAttention` on CPU when llmlab's C++ kernels load, and
:class:`TorchPagedAttention` otherwise (:func:`auto_backend`).
"""

from llmlab.attention.backend import (
    AttentionBackend,
    AttentionContext,
    AttentionInputs,
    block_table_tensor,
    token_slots,
)
from llmlab.attention.cpu_backend import (
    CpuAttentionMetadata,
    CpuPagedAttention,
    cpu_kernels_unavailable_reason,
)
from llmlab.attention.selection import auto_backend
from llmlab.attention.torch_backend import TorchAttentionMetadata, TorchPagedAttention
from llmlab.attention.triton_backend import (
    TritonAttentionMetadata,
    TritonPagedAttention,
    triton_unavailable_reason,
)
from llmlab.registry import register, table

register("attention_backend", "torch")(TorchPagedAttention)
register("attention_backend", "triton")(TritonPagedAttention)
register("attention_backend", "cpu")(CpuPagedAttention)
ATTENTION_BACKENDS = table("attention_backend")
"""Registered attention backends by name (live: includes the ones users register)."""

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionContext",
    "AttentionInputs",
    "CpuAttentionMetadata",
    "CpuPagedAttention",
    "TorchAttentionMetadata",
    "TorchPagedAttention",
    "TritonAttentionMetadata",
    "TritonPagedAttention",
    "auto_backend",
    "block_table_tensor",
    "cpu_kernels_unavailable_reason",
    "token_slots",
    "triton_unavailable_reason",
]

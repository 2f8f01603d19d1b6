"""Attention backends: the interface, the plain-torch paged reference, the Triton kernels.

``attention_backend="auto"`` (the default) picks :class:`TritonPagedAttention` on CUDA when
triton imports, and :class:`TorchPagedAttention` otherwise (:func:`auto_backend`).
"""

from llmlab.attention.backend import (
    AttentionBackend,
    AttentionContext,
    AttentionInputs,
    block_table_tensor,
    token_slots,
)
from llmlab.attention.torch_backend import TorchAttentionMetadata, TorchPagedAttention
from llmlab.attention.triton_backend import (
    TritonAttentionMetadata,
    TritonPagedAttention,
    auto_backend,
    triton_unavailable_reason,
)
from llmlab.registry import register, table

register("attention_backend", "torch")(TorchPagedAttention)
register("attention_backend", "triton")(TritonPagedAttention)
ATTENTION_BACKENDS = table("attention_backend")
"""Registered attention backends by name (live: includes the ones users register)."""

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionContext",
    "AttentionInputs",
    "TorchAttentionMetadata",
    "TorchPagedAttention",
    "TritonAttentionMetadata",
    "TritonPagedAttention",
    "auto_backend",
    "block_table_tensor",
    "token_slots",
    "triton_unavailable_reason",
]

"""Attention backends: the interface, and the plain-torch paged reference."""

from llmlab.attention.backend import AttentionBackend, AttentionContext, AttentionInputs
from llmlab.attention.torch_backend import TorchAttentionMetadata, TorchPagedAttention

__all__ = [
    "AttentionBackend",
    "AttentionContext",
    "AttentionInputs",
    "TorchAttentionMetadata",
    "TorchPagedAttention",
]

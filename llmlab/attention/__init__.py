"""Attention backends: the interface, and the plain-torch paged reference."""

from llmlab.attention.backend import (
    AttentionBackend,
    AttentionContext,
    AttentionInputs,
    block_table_tensor,
    token_slots,
)
from llmlab.attention.torch_backend import TorchAttentionMetadata, TorchPagedAttention
from llmlab.registry import register, table

register("attention_backend", "torch")(TorchPagedAttention)
ATTENTION_BACKENDS = table("attention_backend")
"""Registered attention backends by name (live: includes the ones users register)."""

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionContext",
    "AttentionInputs",
    "TorchAttentionMetadata",
    "TorchPagedAttention",
    "block_table_tensor",
    "token_slots",
]

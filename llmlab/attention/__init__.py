"""Attention backends: the interface, and the plain-torch paged reference."""

from llmlab.attention.backend import (
    AttentionBackend,
    AttentionContext,
    AttentionInputs,
    block_table_tensor,
    token_slots,
)
from llmlab.attention.torch_backend import TorchAttentionMetadata, TorchPagedAttention

ATTENTION_BACKENDS: dict[str, type] = {"torch": TorchPagedAttention}

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

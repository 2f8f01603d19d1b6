"""Pooling models: poolers (one request's hidden states -> one vector), their
configuration (:class:`PoolerConfig`, vLLM's), and the task heads that turn a pooled vector
into an embedding, class probabilities or a score (:class:`PoolingSpec`, :func:`finish`).

The engine's mechanism (collecting hidden states across prefill chunks, per row) is in the
model runner; the decisions (which positions, how they are reduced, what a task does) are
here, in small components.
"""

from llmlab.pooling.pooler import (
    POOLING_TYPES,
    CLSPool,
    LastPool,
    MeanPool,
    Pooler,
    PoolerConfig,
    pooler_config_from_checkpoint,
)
from llmlab.pooling.task import PoolingSpec, finish

__all__ = [
    "POOLING_TYPES",
    "CLSPool",
    "LastPool",
    "MeanPool",
    "Pooler",
    "PoolerConfig",
    "PoolingSpec",
    "finish",
    "pooler_config_from_checkpoint",
]

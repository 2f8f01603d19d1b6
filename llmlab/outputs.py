"""vLLM's ``vllm.outputs`` module path: ``from llmlab.outputs import RequestOutput``."""

from llmlab.engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

__all__ = [
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "RequestMetrics",
    "RequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]

"""vLLM's ``vllm.outputs`` module path: ``from llmlab.outputs import RequestOutput``."""

from llmlab.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput"]

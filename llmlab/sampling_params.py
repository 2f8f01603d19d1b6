"""vLLM's ``vllm.sampling_params`` module path: ``from llmlab.sampling_params import ...``."""

from llmlab.sampling.beam_search import BeamSearchParams
from llmlab.sampling.params import (
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = [
    "BeamSearchParams",
    "GuidedDecodingParams",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]

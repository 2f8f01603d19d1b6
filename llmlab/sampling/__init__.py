"""Sampling: parameters, the batched sampler and its logits processors, logprobs, beam
search and structured outputs."""

from llmlab.sampling.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from llmlab.sampling.logprobs import Logprob, TokenLogprobs
from llmlab.sampling.metadata import SamplingMetadata, SamplingRow
from llmlab.sampling.params import (
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from llmlab.sampling.processors import LogitsProcessor, SamplingBatch, default_processors
from llmlab.sampling.sampler import Sampler, SamplerOutput

__all__ = [
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "GuidedDecodingParams",
    "LogitsProcessor",
    "Logprob",
    "RequestOutputKind",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingMetadata",
    "SamplingParams",
    "SamplingRow",
    "StructuredOutputsParams",
    "TokenLogprobs",
    "default_processors",
]

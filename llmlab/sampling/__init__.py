"""Sampling: parameters, the batched sampler, and (later) logits processors."""

from llmlab.sampling.params import RequestOutputKind, SamplingParams
from llmlab.sampling.sampler import Sampler, SamplerOutput

__all__ = ["RequestOutputKind", "Sampler", "SamplerOutput", "SamplingParams"]

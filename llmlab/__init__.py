"""llmlab: a research toolkit for LLM inference that is also a real engine.

Public API (everything else may change)::

    from llmlab import LLM, SamplingParams
    outputs = LLM("path/or/hub-id").generate(["Hello"], SamplingParams(max_tokens=16))
"""

# Before anything imports torch: the OpenMP runtime reads its wait policy when it loads.
from llmlab.threads import set_wait_policy

set_wait_policy()

from llmlab import _moved

_moved.install()

from llmlab.config import EngineConfig
from llmlab.distributed.data_parallel import DataParallelEngine
from llmlab.entrypoints.arg_utils import AsyncEngineArgs, EngineArgs
from llmlab.entrypoints.async_engine import AsyncEngine
from llmlab.engine.builder import EngineBuilder
from llmlab.engine.engine import Engine
from llmlab.observe.events import Arrival, EngineSnapshot, StepEvent
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
from llmlab.errors import ExecutorDeadError
from llmlab.inputs import PromptType, TextPrompt, TokensPrompt
from llmlab.entrypoints.llm import LLM
from llmlab.lora.request import LoRARequest
from llmlab.pooling import PoolerConfig
from llmlab.pooling_params import PoolingParams
from llmlab.registry import register
from llmlab.request import Request, RequestStatus
from llmlab.sampling.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from llmlab.sampling.logprobs import Logprob
from llmlab.sampling.params import (
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from llmlab.scheduler.policy import Policy
from llmlab.speculative import DraftRequest, Proposal, SpecDecodeStats, SpeculativeConfig

# vLLM's names for the engine classes.
LLMEngine = Engine
AsyncLLMEngine = AsyncEngine

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "Arrival",
    "AsyncEngine",
    "AsyncEngineArgs",
    "AsyncLLMEngine",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "DataParallelEngine",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Engine",
    "EngineArgs",
    "EngineBuilder",
    "EngineConfig",
    "EngineSnapshot",
    "ExecutorDeadError",
    "GuidedDecodingParams",
    "LLMEngine",
    "Logprob",
    "LoRARequest",
    "Policy",
    "PoolerConfig",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "PromptType",
    "DraftRequest",
    "Proposal",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStatus",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StepEvent",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "register",
]

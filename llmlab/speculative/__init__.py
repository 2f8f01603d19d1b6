"""Speculative decoding: proposers (the fifth component kind), verification, lengths.

A proposer drafts tokens; the target scores them all in one forward pass and keeps the
longest prefix it agrees with (greedy) or what rejection sampling accepts (sampled), so
outputs are distributed exactly as without speculation. See ``docs/speculative.md``.

Built-in proposers (registered by name): ``ngram`` (prompt lookup), ``suffix`` (suffix
trees over the request and earlier outputs), ``draft_model`` (a smaller model sharing the
target's block tables), ``synthetic`` (acceptance at given rates, for studying cost).
"""

from llmlab.speculative.config import SpeculativeConfig
from llmlab.speculative.draft_model import DraftModelProposer
from llmlab.speculative.length import (
    AdaptiveLength,
    BatchSizeLength,
    FixedLength,
    SpeculationLength,
)
from llmlab.speculative.ngram import NgramProposer
from llmlab.speculative.proposer import (
    DraftRequest,
    Proposal,
    Proposer,
    ProposerContext,
    Verified,
)
from llmlab.speculative.speculator import Speculator
from llmlab.speculative.stats import SpecDecodeStats
from llmlab.speculative.suffix import SuffixProposer
from llmlab.speculative.synthetic import SyntheticProposer

__all__ = [
    "AdaptiveLength",
    "BatchSizeLength",
    "DraftModelProposer",
    "DraftRequest",
    "FixedLength",
    "NgramProposer",
    "Proposal",
    "Proposer",
    "ProposerContext",
    "SpeculationLength",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "Speculator",
    "SuffixProposer",
    "SyntheticProposer",
    "Verified",
]

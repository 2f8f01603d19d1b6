"""Tiny random-weight Hugging Face models, built on the fly for tests, examples and benchmarks.

:func:`build_tiny_model` writes a real checkpoint (config, safetensors, tokenizer) for any
architecture in :data:`TINY_ARCHITECTURES` (and the sequence classifiers of
:data:`TINY_CLASSIFIER_ARCHITECTURES`, pooling models) in about a second, offline
(:mod:`~llmlab.testing.tiny`; the tokenizer's corpus is :mod:`~llmlab.testing.tiny_corpus`).
The trained story models llmlab ships are elsewhere: :mod:`llmlab.builtin`.
"""

from llmlab.testing.tiny import (
    TINY_ARCHITECTURES,
    TINY_CLASSIFIER_ARCHITECTURES,
    build_tiny_model,
)

__all__ = ["TINY_ARCHITECTURES", "TINY_CLASSIFIER_ARCHITECTURES", "build_tiny_model"]

"""KV presses: compress a request's KV cache by keeping its most useful tokens.

A press is a component (:class:`~llmlab.kvpress.base.KVPress`, one ``score`` method); the
engine compacts a request's blocks after its prompt (and, with ``compress_every``, every
few decode steps) and frees the blocks it no longer needs. Built-ins, one per file, each
citing its paper: ``streaming_llm``, ``h2o``, ``snapkv``, ``tova``, ``knorm``, ``random``
and the ``pyramid`` per-layer budget wrapper. See ``docs/kv_press.md``.
"""

from llmlab.kvpress.base import (
    KIND,
    KVPress,
    PressInput,
    check_budget,
    kept_count,
    register_press,
    resolve_press,
)
from llmlab.kvpress.h2o import H2OPress
from llmlab.kvpress.knorm import KnormPress
from llmlab.kvpress.pyramid import PyramidPress
from llmlab.kvpress.random_press import RandomPress
from llmlab.kvpress.snapkv import SnapKVPress
from llmlab.kvpress.streaming_llm import StreamingLLMPress
from llmlab.kvpress.tova import TOVAPress

__all__ = [
    "KIND",
    "H2OPress",
    "KVPress",
    "KnormPress",
    "PressInput",
    "PyramidPress",
    "RandomPress",
    "SnapKVPress",
    "StreamingLLMPress",
    "TOVAPress",
    "check_budget",
    "kept_count",
    "register_press",
    "resolve_press",
]

"""H2O: keep the heavy hitters (most attended tokens so far) and the recent tokens."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from llmlab.kvpress.base import KVPress, PressInput, register_press


@register_press("h2o")
@attrs.define
class H2OPress(KVPress):
    """Keep the heavy hitters (most attended tokens) and the most recent tokens.

    Zhang et al. 2023, *H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
    Large Language Models* (arXiv:2306.14048). Keeps the tokens with the largest attention
    accumulated over every query computed since the last compaction (the heavy hitters)
    and the ``recent`` most recent tokens.
    """

    recent: int = attrs.field(default=8, validator=attrs.validators.ge(0))

    name: ClassVar[str] = "h2o"
    query_window: ClassVar[int] = -1

    def score(self, layer: PressInput) -> torch.Tensor:
        n = layer.num_tokens
        if layer.num_queries == 0:  # no query computed: keep the most recent tokens
            return torch.arange(n, device=layer.keys.device, dtype=torch.float32)
        scores = layer.per_kv_head(layer.attention_sum())  # [num_kv_heads, n]
        if self.recent:
            scores[:, -self.recent :] = float("inf")
        return scores

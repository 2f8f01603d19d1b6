"""SnapKV: keep the tokens an observation window of recent queries attends to."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch
import torch.nn.functional as F

from llmlab.kvpress.base import KVPress, PressInput, register_press


@register_press("snapkv")
@attrs.define
class SnapKVPress(KVPress):
    """Keep what the last prompt window attends to most, pooled into spans.

    Li et al. 2024, *SnapKV: LLM Knows What You are Looking for Before Generation*
    (arXiv:2404.14469). Keeps the observation window (the last ``window_size`` tokens) and
    the earlier tokens those queries attend to most, attention pooled over
    ``kernel_size`` neighbours so whole spans are kept rather than isolated tokens.
    """

    window_size: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    kernel_size: int = attrs.field(default=5, validator=attrs.validators.ge(1))

    name: ClassVar[str] = "snapkv"
    query_window: ClassVar[int] = 32

    @property
    def query_span(self) -> int:
        """The engine keeps this many recent queries for the press: ``window_size``."""
        return self.window_size

    def score(self, layer: PressInput) -> torch.Tensor:
        n, q = layer.num_tokens, layer.num_queries
        if q == 0:  # no query computed: keep the most recent tokens
            return torch.arange(n, device=layer.keys.device, dtype=torch.float32)
        # The window's own tokens are always kept; the paper ranks only the tokens before it.
        scores = torch.full((layer.num_kv_heads, n), float("inf"), device=layer.keys.device)
        if n > q:
            summed = layer.per_kv_head(layer.attention_sum())  # [num_kv_heads, n]
            pooled = F.max_pool1d(
                summed[:, None, : n - q], self.kernel_size, stride=1, padding=self.kernel_size // 2
            )
            scores[:, : n - q] = pooled[:, 0, : n - q]  # an even kernel yields one extra column
        return scores

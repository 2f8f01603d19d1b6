"""StreamingLLM: keep the attention sinks and a window of recent tokens."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from llmlab.kvpress.base import KVPress, PressInput, register_press


@register_press("streaming_llm")
@attrs.define
class StreamingLLMPress(KVPress):
    """Keep the attention sinks and a window of recent tokens.

    Xiao et al. 2023, *Efficient Streaming Language Models with Attention Sinks*
    (arXiv:2309.17453). Keeps the first ``n_sink`` cached tokens (the attention sinks) and
    the most recent ones; with ``window`` set, exactly ``n_sink + window`` tokens per layer
    whatever the compression ratio.
    """

    n_sink: int = attrs.field(default=4, validator=attrs.validators.ge(0))
    window: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )

    name: ClassVar[str] = "streaming_llm"

    def score(self, layer: PressInput) -> torch.Tensor:
        # Cache order is token order (compactions keep it), so the index is the recency.
        scores = torch.arange(layer.num_tokens, device=layer.keys.device, dtype=torch.float32)
        scores[: self.n_sink] = float("inf")
        return scores

    def layer_budgets(self, context_len: int, keep: float, num_layers: int) -> list[int]:
        if self.window is None:
            return super().layer_budgets(context_len, keep, num_layers)
        return [min(context_len, self.n_sink + self.window)] * num_layers

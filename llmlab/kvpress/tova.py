"""TOVA: keep the tokens the newest query attends to most."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from llmlab.kvpress.base import KVPress, PressInput, register_press


@register_press("tova")
@attrs.define
class TOVAPress(KVPress):
    """Keep the tokens the newest query attends to most (all heads averaged).

    Oren et al. 2024, *Transformers are Multi-State RNNs* (arXiv:2401.06104). Keeps the
    tokens with the highest attention weight from the last query, averaged over all the
    layer's heads (one choice shared by every KV head), and always the newest token.
    """

    name: ClassVar[str] = "tova"
    query_window: ClassVar[int] = 1

    def score(self, layer: PressInput) -> torch.Tensor:
        n = layer.num_tokens
        if layer.num_queries == 0:  # no query computed: keep the most recent tokens
            return torch.arange(n, device=layer.keys.device, dtype=torch.float32)
        scores = layer.attention()[:, -1, :].mean(dim=0)  # [num_tokens]
        scores[-1] = float("inf")  # the newest token, whose query this is
        return scores

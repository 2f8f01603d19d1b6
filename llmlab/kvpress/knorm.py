"""Knorm: keep the keys with the smallest L2 norm."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from llmlab.kvpress.base import KVPress, PressInput, register_press


@register_press("knorm")
@attrs.define
class KnormPress(KVPress):
    """Keep the tokens whose keys have the lowest L2 norm.

    Devoto et al. 2024, *A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression* (arXiv:2406.11430). Keeps the tokens whose keys have the lowest L2 norm:
    low-norm keys draw the most attention, and the score needs no queries.
    """

    name: ClassVar[str] = "knorm"

    def score(self, layer: PressInput) -> torch.Tensor:
        return -layer.keys.float().norm(dim=-1)  # [num_kv_heads, num_tokens]

"""Random: the control every press should beat."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from llmlab.kvpress.base import KVPress, PressInput, register_press


@register_press("random")
@attrs.define
class RandomPress(KVPress):
    """Keep a uniformly random subset of each KV head's tokens (the control).

    The baseline that shows what a press's scores are worth. Draws from the layer's generator when the engine
    gives one, else from one seeded by ``seed`` and the layer index (deterministic).
    """

    seed: int = 0

    name: ClassVar[str] = "random"

    def score(self, layer: PressInput) -> torch.Tensor:
        device = layer.keys.device
        generator = layer.generator
        if generator is None:
            # Mix in the layer so layers do not all drop the same positions.
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed * 1_000_003 + layer.layer)
        shape = (layer.num_kv_heads, layer.num_tokens)
        return torch.rand(shape, generator=generator, device=device)

"""PyramidKV: more cache for the lower layers, less for the upper ones."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from llmlab.kvpress.base import KVPress, PressInput, kept_count, register_press, resolve_press
from llmlab.kvpress.snapkv import SnapKVPress


def _as_press(value: Any) -> KVPress:
    return value if isinstance(value, KVPress) else resolve_press(value)


@register_press("pyramid")
@attrs.define
class PyramidPress(KVPress):
    """Per-layer budgets falling from the bottom layer to the top, around an inner press.

    Cai et al. 2024, *PyramidKV: Dynamic KV Cache Compression based on Pyramidal
    Information Funneling* (arXiv:2406.02069). Keeps what the inner ``press`` scores
    highest, with budgets falling linearly from the bottom layer to the top (whose budget
    is ``beta`` times below the mean), the same total as uniform budgets.

    The wrapper's ``compression_ratio`` and ``compress_every`` apply, not the inner press's.
    """

    press: KVPress = attrs.field(factory=SnapKVPress, converter=_as_press)
    beta: int = attrs.field(default=20, validator=attrs.validators.ge(1))

    name: ClassVar[str] = "pyramid"

    @property
    def query_span(self) -> int:
        """The inner press's query window: it is the one reading the queries."""
        return self.press.query_span

    def score(self, layer: PressInput) -> torch.Tensor:
        return self.press.score(layer)

    def layer_budgets(self, context_len: int, keep: float, num_layers: int) -> list[int]:
        total = kept_count(context_len, keep)
        # As in the paper, the inner press's query window is kept in every layer on top of
        # the pyramid (otherwise a top layer's budget could be spent inside the window).
        window = min(max(self.press.query_span, 0), context_len)
        if num_layers == 1 or total >= context_len or total <= window:
            return [total] * num_layers
        mean, context_len = total - window, context_len - window
        return [window + b for b in self._pyramid(mean, context_len, num_layers)]

    def _pyramid(self, mean: int, context_len: int, num_layers: int) -> list[int]:
        k_min = mean / self.beta
        k_max = 2 * mean - k_min
        if k_max > context_len:
            # The paper's clamp: a bottom layer cannot keep more than the context, so the
            # top keeps more instead and the mean stays the same.
            k_max = context_len
            k_min = 2 * mean - k_max
        step = (k_max - k_min) / (num_layers - 1)
        return [
            max(1, min(context_len, round(k_max - step * layer))) for layer in range(num_layers)
        ]

"""The model runner's pooling mechanism: per-row hidden states across prefill chunks.

A pooling request's prompt may be prefilled over several steps (chunked prefill), so what
its pooler reads is collected per row, the way sampling state is: started by the row's
setup, dropped when the batch frees the row (or after a failed step). When an entry's span
ends the prompt, the collected states go through the pooler, and the pooled vectors of the
step through :func:`~llmlab.pooling.task.finish` (normalization, the classifier, the
activation) in one batch.

The pooler decides what is kept: ``uses_all_positions=False`` keeps nothing across chunks
(the last position is in the final chunk); True keeps a copy of each chunk's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from llmlab.errors import ComponentError
from llmlab.pooling.pooler import Pooler
from llmlab.pooling.task import finish
from llmlab.pooling_params import PoolingParams
from llmlab.scheduler.batch import ScheduledRequest


@attrs.define(eq=False, slots=True)
class _PoolingRow:
    params: PoolingParams
    chunks: list[torch.Tensor] = attrs.field(factory=list)


@attrs.define
class PoolingRows:
    """Pooling state of every row of a pooling runner.

    Attributes:
        pooler: reduces one prompt's hidden states to one vector (the registry's
            ``pooler`` kind).
        classifier: the model's ``classify`` (label logits of pooled states), or None for
            a model without a classifier head.
        hidden_size: the width the pooler must return.
    """

    pooler: Pooler
    classifier: Callable[[torch.Tensor], torch.Tensor] | None
    hidden_size: int
    _rows: dict[int, _PoolingRow] = attrs.field(factory=dict)

    def start(self, row: int, params: Any) -> None:
        if not isinstance(params, PoolingParams):
            raise ValueError(  # noqa: TRY004 - a broken batch, as the runner reports it
                f"row {row}: a pooling entry's setup must carry PoolingParams, got "
                f"{type(params).__name__}"
            )
        self._rows[row] = _PoolingRow(params)

    def has(self, row: int) -> bool:
        return row in self._rows

    def release(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._rows.pop(row, None)

    def reset(self) -> None:
        self._rows.clear()

    def collect(
        self, entries: Sequence[ScheduledRequest], hidden: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...] | None:
        """Keep what the pooler needs of this step's pooling spans (``hidden`` is the flat
        ``[num_tokens, hidden]`` of the batch, entries in order); per entry, the output of
        each one that ends its prompt, else None (None when no entry pooled)."""
        keep_all = self.pooler.uses_all_positions
        due: list[tuple[int, torch.Tensor, PoolingParams]] = []
        offset = 0
        for i, entry in enumerate(entries):
            base, offset = offset, offset + len(entry.token_ids)
            if not entry.pooling:
                continue
            row = self._rows[entry.row]
            if keep_all:
                # A copy: a view would keep the whole step's hidden states alive.
                row.chunks.append(hidden[base:offset].clone())
            if entry.pools_now:
                states = torch.cat(row.chunks) if keep_all else hidden[offset - 1 : offset]
                row.chunks = []
                due.append((i, self._pool(states), row.params))
        if not due:
            return None
        outputs = finish(
            torch.stack([vector for _, vector, _ in due]),
            [params for _, _, params in due],
            self.classifier,
        )
        pooled: list[torch.Tensor | None] = [None] * len(entries)
        for (i, _, _), out in zip(due, outputs, strict=True):
            pooled[i] = out
        return tuple(pooled)

    def _pool(self, states: torch.Tensor) -> torch.Tensor:
        try:
            vector = self.pooler.pool(states)
        except Exception as err:
            raise ComponentError.wrap("pooler", self.pooler, "pool", err) from err
        if not isinstance(vector, torch.Tensor) or tuple(vector.shape) != (self.hidden_size,):
            got = tuple(vector.shape) if isinstance(vector, torch.Tensor) else type(vector).__name__
            raise ComponentError(
                "pooler", self.pooler, "pool",
                f"returned {got}, not a [hidden_size={self.hidden_size}] tensor",
            )
        return vector

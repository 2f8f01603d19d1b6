"""The model runner's pooling mechanism: per-row hidden states across prefill chunks.

A pooling request's prompt may be prefilled over several steps (chunked prefill), so what
its pooler reads is collected per row, the way sampling state is: started by the row's
setup, dropped when the batch frees the row (or after a failed step). When an entry's span
ends the prompt, the collected states go through the pooler, and the pooled vectors of the
step through :func:`~llmlab.pooling.task.finish` (normalization, the classifier, the
activation) in one batch.

:class:`PoolingRows` is pooling's runner plugin and :class:`PoolingSchedule` its scheduler
plugin (:mod:`llmlab.plugin`, both named ``pooling``): the scheduler side marks each
pooling request's entries (its side map: request id -> True), the runner side answers the
entry whose span ends the prompt with the pooled output (its output side), and the
scheduler side then finishes the request (its blocks freed in that step).

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
from llmlab.plugin import RunnerPlugin, SchedulerPlugin, StepPlan
from llmlab.pooling_params import PoolingParams
from llmlab.scheduler.batch import BatchOutput, ScheduledBatch, ScheduledRequest

NAME = "pooling"


def pools_now(entry: ScheduledRequest) -> bool:
    """A pooling entry whose span reaches the end of the prompt: its output is due."""
    return entry.start + len(entry.token_ids) >= entry.num_prompt_tokens


class PoolingSchedule(SchedulerPlugin):
    """Pooling's scheduler side: marks pooling entries, checks and commits pooled outputs.
    A pooling request always recomputes after preemption (its pooler's per-row state does
    not survive the row)."""

    name = NAME

    def plan(self, step: StepPlan) -> dict[str, bool]:
        return {e.request_id: True for e in step.entries
                if step.requests[e.request_id].pooling_params is not None}

    def check(self, batch: ScheduledBatch, output: BatchOutput) -> None:
        pooling = batch.side(NAME) or {}
        pooled = output.side(NAME)
        for i, entry in enumerate(batch.entries):
            if output.failed is not None and output.failed[i] is not None:
                continue
            vector = None if pooled is None else pooled[i]
            if entry.request_id in pooling:
                due = pools_now(entry)
                if output.token_ids[i] or (vector is None) == due:
                    raise ValueError(
                        f"pooling entry {entry.request_id!r} must return no tokens, and a "
                        f"pooled output exactly when its span ends the prompt (it "
                        f"{'does' if due else 'does not'}); the executor returned "
                        f"{len(output.token_ids[i])} tokens and "
                        f"{'no' if vector is None else 'a'} pooled output"
                    )
            elif vector is not None:
                raise ValueError(
                    f"entry {entry.request_id!r} samples, but the executor returned a pooled "
                    "output for it"
                )

    def commit(self, request: Any, sent: Any, returned: Any) -> bool:
        if returned is None:
            return False
        # Prefill only: its output is the pooled one, and it ends as soon as its prompt
        # is computed.
        request.pooled = returned
        return True

    def recompute_only(self, request: Any) -> bool:
        return request.pooling_params is not None


@attrs.define(eq=False, slots=True)
class _PoolingRow:
    params: PoolingParams
    chunks: list[torch.Tensor] = attrs.field(factory=list)


@attrs.define
class PoolingRows(RunnerPlugin):
    """Pooling state of every row of a pooling runner.

    Attributes:
        pooler: reduces one prompt's hidden states to one vector (the registry's
            ``pooler`` kind).
        classifier: the model's ``classify`` (label logits of pooled states), or None for
            a model without a classifier head.
        hidden_size: the width the pooler must return.
    """

    name = NAME

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

    def start_row(self, row: int, entry: ScheduledRequest, side: Any) -> None:
        if side:
            self.start(row, entry.setup.params)

    def after_forward(self, batch: ScheduledBatch, hidden: torch.Tensor, output: BatchOutput,
                      context: Any) -> BatchOutput:
        pooled = self.collect(batch, hidden)
        return output if pooled is None else output.with_side(NAME, pooled)

    def release(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._rows.pop(row, None)

    def reset(self) -> None:
        self._rows.clear()

    def collect(
        self, batch: ScheduledBatch, hidden: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...] | None:
        """Keep what the pooler needs of this step's pooling spans (``hidden`` is the flat
        ``[num_tokens, hidden]`` of the batch, entries in order); per entry, the output of
        each one that ends its prompt, else None (None when no entry pooled)."""
        pooling = batch.side(NAME)
        if not pooling:
            return None
        entries = batch.entries
        keep_all = self.pooler.uses_all_positions
        due: list[tuple[int, torch.Tensor, PoolingParams]] = []
        offset = 0
        for i, entry in enumerate(entries):
            base, offset = offset, offset + len(entry.token_ids)
            if entry.request_id not in pooling:
                continue
            row = self._rows.get(entry.row)
            if row is None:
                raise ValueError(
                    f"row {entry.row} (request {entry.request_id!r}) has no pooling state: a "
                    "row's first entry must carry its setup"
                )
            if keep_all:
                # A copy: a view would keep the whole step's hidden states alive.
                row.chunks.append(hidden[base:offset].clone())
            if pools_now(entry):
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

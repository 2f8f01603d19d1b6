"""The executor's side of a KV press: keep recent queries, score, move the kept tokens.

:class:`PressRunner` is the press's runner plugin (:mod:`llmlab.plugin`, ``kv_press``). Per
step, :meth:`PressRunner.capture_plan` names the flat tokens whose queries the press will
read (the entry's :class:`~llmlab.kvpress.schedule.PressStep`, in the batch's side map, says
from which position each row keeps them); the attention context hands every layer's queries of those tokens to
:meth:`QueryCapture.take` during the forward, and :meth:`PressRunner.store` files them per
row, keeping the most recent ``window``. After the forward (and sampling),
:meth:`PressRunner.compact` serves each entry whose step asks for a compaction: per layer it
reads the row's cached keys and values through the block table, asks the press which
indices each KV head keeps, and writes those tokens, in order, into the fresh blocks the
scheduler reserved. The row's own blocks are only read, so a press that raises or answers
nonsense leaves the request exactly as it was: the result says why, the scheduler gives the
reserved blocks back and the request goes on uncompressed.

Backends provide the layout-specific reads and writes (``gather_slots`` /
``scatter_slots``); positions are not stored anywhere: the cache keeps the kept tokens in
their original order and the keys carry their rotary positions.
"""

from __future__ import annotations

import zlib
from typing import Any

import attrs
import numpy as np
import torch

from llmlab.attention.backend import token_slots
from llmlab.kvpress.base import KVPress, PressInput
from llmlab.kvpress.schedule import CompactionResult, PressStep
from llmlab.plugin import RunnerPlugin
from llmlab.scheduler.batch import BatchOutput, ScheduledBatch, ScheduledRequest


@attrs.define(eq=False)
class QueryCapture:
    """One step's query capture: flat token ``index`` (on the device) and, per segment,
    ``(row, offset in the captured tokens, count, window)``; filled layer by layer."""

    index: torch.Tensor
    segments: list[tuple[int, int, int, int]]
    queries: dict[int, torch.Tensor] = attrs.field(factory=dict)
    scales: dict[int, float] = attrs.field(factory=dict)

    def take(self, layer_idx: int, q: torch.Tensor, scale: float) -> None:
        """Called by the attention context with a layer's queries ``[tokens, heads, dim]``."""
        self.queries[layer_idx] = q.index_select(0, self.index)
        self.scales[layer_idx] = scale


@attrs.define
class PressRunner(RunnerPlugin):
    """Executor-side state and work of a KV press (see the module docstring).

    Args:
        press: the press (its ``score`` / ``select`` run here).
        backend: the attention backend; it must provide ``gather_slots`` and
            ``scatter_slots`` for its KV layout.
        num_layers: the model's layers.
        block_size: tokens per KV block.
    """

    name = "kv_press"

    press: KVPress
    backend: Any
    num_layers: int
    block_size: int
    _runner: Any = attrs.field(init=False, default=None)
    # Per row: per layer, the kept queries [heads, tokens, dim] (oldest first).
    _queries: dict[int, list[torch.Tensor | None]] = attrs.field(init=False, factory=dict)
    _scales: dict[int, float] = attrs.field(init=False, factory=dict)

    def release(self, rows) -> None:
        for row in rows:
            self._queries.pop(row, None)

    def reset(self) -> None:
        self._queries.clear()

    # -- the plugin hooks ------------------------------------------------------------------

    def bind(self, runner: Any) -> None:
        self._runner = runner

    def before_forward(self, batch: ScheduledBatch, sides: Any) -> QueryCapture | None:
        return self.capture_plan(batch, self._runner.device)

    def observe_queries(self, context: QueryCapture | None) -> Any:
        return None if context is None else context.take

    def eager_only(self, context: QueryCapture | None) -> bool:
        return context is not None  # keeping queries: no graph replay

    def after_forward(self, batch: ScheduledBatch, hidden: Any, output: BatchOutput,
                      context: QueryCapture | None) -> BatchOutput:
        if context is not None:
            self.store(context)
        # After the forward wrote this step's KV and after sampling: the row's blocks are
        # only read; the kept tokens go to blocks the scheduler reserved.
        runner = self._runner
        compacted = self.compact(batch, runner.kv_caches, runner.block_tables,
                                 runner.attention_state)
        return output if compacted is None else output.with_side(self.name, compacted)

    def kv_offsets(self, batch: ScheduledBatch) -> tuple[Any, Any]:
        side = batch.side(self.name)
        if not side:
            return None, None
        steps = [side.get(e.request_id) for e in batch.entries]
        dropped = np.fromiter((0 if s is None else s.kv_dropped for s in steps), np.int64,
                              len(steps))
        layer_shift = None
        if any(s is not None and s.kv_layer_shift is not None for s in steps):
            layer_shift = np.zeros((self.num_layers, len(steps)), dtype=np.int64)
            for i, s in enumerate(steps):
                if s is not None and s.kv_layer_shift is not None:
                    layer_shift[:, i] = s.kv_layer_shift
        return (dropped if dropped.any() else None), layer_shift

    # -- capture ---------------------------------------------------------------------------

    def capture_plan(self, batch: ScheduledBatch, device: torch.device) -> QueryCapture | None:
        """The flat tokens whose queries this step keeps, or None (no entry keeps any)."""
        side = batch.side(self.name)
        if not side:
            return None
        index: list[np.ndarray] = []
        segments = []
        offset = flat = 0
        for entry in batch.entries:
            n = len(entry.token_ids)
            step = side.get(entry.request_id)
            if step is not None and step.capture_from >= 0:
                first = max(entry.start, step.capture_from)
                end = entry.start + n
                if first < end:
                    lo = flat + first - entry.start
                    index.append(np.arange(lo, lo + end - first))
                    segments.append((entry.row, offset, end - first, step.window))
                    offset += end - first
            flat += n
        if not segments:
            return None
        flat_index = torch.from_numpy(np.concatenate(index)).to(device)
        return QueryCapture(flat_index, segments)

    def store(self, capture: QueryCapture) -> None:
        """File a step's captured queries per row, keeping each row's last ``window``."""
        if len(capture.queries) != self.num_layers:
            return  # the model skipped attention somewhere: keep nothing rather than half
        self._scales.update(capture.scales)
        for row, offset, count, window in capture.segments:
            kept = self._queries.setdefault(row, [None] * self.num_layers)
            for layer in range(self.num_layers):
                new = capture.queries[layer][offset : offset + count].transpose(0, 1)
                old = kept[layer]
                both = new if old is None else torch.cat([old, new], dim=1)
                if window > 0 and both.shape[1] > window:
                    both = both[:, -window:]
                kept[layer] = both

    # -- compaction --------------------------------------------------------------------------

    def compact(
        self,
        batch: ScheduledBatch,
        kv_caches: list[torch.Tensor],
        tables,
        attention_state: Any = None,
    ) -> tuple[CompactionResult | None, ...] | None:
        """Compact the rows whose entry asks for it; per entry its result (None where none
        was asked), or None when no entry asked."""
        side = batch.side(self.name)
        if not side:
            return None
        entries = batch.entries
        results: list[CompactionResult | None] | None = None
        for i, entry in enumerate(entries):
            step = side.get(entry.request_id)
            if step is None or step.budgets is None:
                continue
            if results is None:
                results = [None] * len(entries)
            table = np.asarray(tables.tables[entry.row, : tables.lengths[entry.row]])
            try:
                results[i] = self._compact_row(entry, step, table, kv_caches)
            except Exception as err:  # noqa: BLE001 - the press is user code: this row only
                # Reported (logged, in the step event) by the scheduler, which applies it.
                results[i] = CompactionResult(error=f"{type(err).__name__}: {err}")
            else:
                # The row's KV moved: the next step's entry brings its new table; a
                # backend's per-row copy (the CPU decode mirror) is stale.
                release = getattr(attention_state, "release", None)
                if release is not None:
                    release([entry.row])
            self._queries.pop(entry.row, None)
        return None if results is None else tuple(results)

    def _compact_row(
        self, entry: ScheduledRequest, step: PressStep, table: np.ndarray,
        kv_caches: list[torch.Tensor],
    ) -> CompactionResult:
        bs = self.block_size
        held = entry.start + len(entry.token_ids) - step.kv_dropped
        shift = step.kv_layer_shift or (0,) * self.num_layers
        targets = np.asarray(step.targets, dtype=np.int64)[None, :]
        queries = self._queries.get(entry.row)
        before, kept, moves = [], [], []
        # Every layer is selected before any is written: a press that fails on a later
        # layer leaves the row as it was (in place, its own blocks are the targets).
        for layer, cache in enumerate(kv_caches):
            n = held - shift[layer]
            budget = step.budgets[layer]
            device = cache.device
            src = torch.from_numpy(token_slots(table[None, :], 0, np.arange(n), bs)).to(device)
            keys, values = self.backend.gather_slots(cache, src, bs)
            layer_queries = None if queries is None else queries[layer]
            generator = torch.Generator(device=device)
            generator.manual_seed(
                zlib.crc32(f"{entry.request_id}:{step.context_len}:{layer}".encode())
            )
            press_input = PressInput(
                layer=layer, num_layers=self.num_layers, keys=keys, values=values,
                queries=layer_queries, scale=self._scales.get(layer, keys.shape[-1] ** -0.5),
                context_len=step.context_len, is_prompt=step.is_prompt, generator=generator,
            )
            index = self.press.select(press_input, budget)
            _check_selection(index, keys.shape[0], n, min(budget, n), layer)
            gather = index.to(device)[..., None].expand(-1, -1, keys.shape[-1])
            moves.append((keys.gather(1, gather), values.gather(1, gather)))
            before.append(n)
            kept.append(int(index.shape[1]))
        for cache, (keys, values), k in zip(kv_caches, moves, kept, strict=True):
            dst = torch.from_numpy(token_slots(targets, 0, np.arange(k), bs)).to(cache.device)
            self.backend.scatter_slots(cache, dst, keys, values, bs)
        return CompactionResult(tuple(before), tuple(kept))


def _check_selection(index: Any, heads: int, n: int, budget: int, layer: int) -> None:
    """A selection must be ``[heads, budget]`` ascending unique indices in ``[0, n)``."""
    if not isinstance(index, torch.Tensor) or index.dtype not in (
        torch.int64, torch.int32, torch.int16, torch.uint8,
    ):
        raise ValueError(
            f"select() must return an integer tensor, got {getattr(index, 'dtype', type(index))}"
        )
    if tuple(index.shape) != (heads, budget):
        raise ValueError(
            f"select() returned shape {list(index.shape)} for layer {layer}; expected "
            f"[num_kv_heads={heads}, budget={budget}]"
        )
    if budget and (
        int(index.min()) < 0 or int(index.max()) >= n
        or (budget > 1 and bool((index[:, 1:] <= index[:, :-1]).any()))
    ):
        raise ValueError(
            f"select() must return ascending, unique cache indices in [0, {n}) per KV head "
            f"(layer {layer})"
        )

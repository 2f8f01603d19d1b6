"""The executor's side of a KV press: keep recent queries, score, move the kept tokens.

Per step, :meth:`PressRunner.capture_plan` names the flat tokens whose queries the press
will read (the batch's :class:`~llmlab.scheduler.batch.PressStep` says from which position
each row keeps them); the attention context hands every layer's queries of those tokens to
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
from llmlab.scheduler.batch import CompactionResult, ScheduledRequest


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
class PressRunner:
    """Executor-side state and work of a KV press (see the module docstring).

    Args:
        press: the press (its ``score`` / ``select`` run here).
        backend: the attention backend; it must provide ``gather_slots`` and
            ``scatter_slots`` for its KV layout.
        num_layers: the model's layers.
        block_size: tokens per KV block.
    """

    press: KVPress
    backend: Any
    num_layers: int
    block_size: int
    # Per row: per layer, the kept queries [heads, tokens, dim] (oldest first).
    _queries: dict[int, list[torch.Tensor | None]] = attrs.field(init=False, factory=dict)
    _scales: dict[int, float] = attrs.field(init=False, factory=dict)

    def release(self, rows) -> None:
        for row in rows:
            self._queries.pop(row, None)

    def reset(self) -> None:
        self._queries.clear()

    # -- capture ---------------------------------------------------------------------------

    def capture_plan(self, entries: tuple[ScheduledRequest, ...], device: torch.device) -> QueryCapture | None:
        """The flat tokens whose queries this step keeps, or None (no entry keeps any)."""
        index: list[np.ndarray] = []
        segments = []
        offset = flat = 0
        for entry in entries:
            n = len(entry.token_ids)
            step = entry.kv_press
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
        entries: tuple[ScheduledRequest, ...],
        kv_caches: list[torch.Tensor],
        tables,
        attention_state: Any = None,
    ) -> tuple[CompactionResult | None, ...] | None:
        """Compact the rows whose entry asks for it; per entry its result (None where none
        was asked), or None when no entry asked."""
        results: list[CompactionResult | None] | None = None
        for i, entry in enumerate(entries):
            step = entry.kv_press
            if step is None or step.budgets is None:
                continue
            if results is None:
                results = [None] * len(entries)
            table = np.asarray(tables.tables[entry.row, : tables.lengths[entry.row]])
            try:
                results[i] = self._compact_row(entry, table, kv_caches)
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
        self, entry: ScheduledRequest, table: np.ndarray, kv_caches: list[torch.Tensor]
    ) -> CompactionResult:
        step = entry.kv_press
        bs = self.block_size
        held = entry.start + len(entry.token_ids) - entry.kv_dropped
        shift = entry.kv_layer_shift or (0,) * self.num_layers
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

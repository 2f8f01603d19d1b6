"""CUDA graphs for decode steps: one captured forward per padded batch size.

A decode step of a small model launches hundreds of kernels whose launch cost, not their
work, sets the step time. A CUDA graph records the whole forward (embedding, every layer's
matmuls, KV write and attention, final norm) once and replays it with one launch. Graphs
replay fixed addresses and shapes, so:

* every input lives in a *static* device buffer sized for the largest batch, refilled
  in place each step from pinned host buffers (one asynchronous copy per input);
* a batch of ``n`` decodes runs the graph of the smallest captured size ``B >= n``; rows
  ``n..B`` are padding (token 0, KV slot -1 so nothing is written, context 0 so nothing
  is read) and their outputs are dropped;
* the attention backend provides metadata over those buffers
  (``decode_graph_metadata``); only backends that do (the Triton one) get graphs.

Graphs are captured lazily, the first time a batch needs a size, so building an engine
stays quick. Only pure decode steps replay a graph (one new token per request); prefill
and mixed steps run eagerly. ``enforce_eager=True`` turns graphs off.

Sampling stays outside the graph: it reads the output rows of the real requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch

from llmlab.attention.backend import AttentionContext, token_slots
from llmlab.runner.block_tables import BlockTables
from llmlab.runner.inputs import fill_placeholders
from llmlab.scheduler.batch import ScheduledBatch
from llmlab.scheduler.columns import columns_of

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int, largest: int = 512) -> list[int]:
    """Sizes to capture: 1, 2, 4, 8, then every multiple of 8, up to ``max_num_seqs``."""
    top = min(max_num_seqs, largest)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top + 8, 8))
    return sorted({min(s, top) for s in sizes})


@attrs.define(eq=False)
class _Captured:
    replay: Callable[[], None]
    hidden: torch.Tensor  # static output [size, hidden]
    metadata: Any  # kept alive: the graph reads its tensors


@attrs.define(eq=False, slots=False)  # the buffers are set in __attrs_post_init__
class DecodeGraphs:
    """Static buffers, captured graphs and the per-step refill for decode batches.

    Args:
        model, backend, kv_caches: what the forward runs on.
        max_num_seqs: the largest decode batch.
        max_model_len, block_size: size the block-table buffer and the split count.
        emulate: instead of capturing a CUDA graph, replay by calling the forward again on
            the same static buffers. Tests use it on CPU to check the buffer handling a
            real graph relies on (a forward that read anything but the static buffers
            would see stale data here as in a graph).
    """

    model: torch.nn.Module
    backend: Any
    kv_caches: list[torch.Tensor]
    device: torch.device
    max_num_seqs: int
    max_model_len: int
    block_size: int
    emulate: bool = False
    sizes: list[int] = attrs.field(init=False)
    captured: dict[int, _Captured] = attrs.field(init=False, factory=dict)
    disabled: str | None = attrs.field(init=False, default=None)
    _pool: Any = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self.sizes = graph_batch_sizes(self.max_num_seqs)
        rows = self.sizes[-1]
        width = -(-self.max_model_len // self.block_size)
        pin = self.device.type == "cuda"

        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, torch.zeros(shape, dtype=dtype, device=self.device)

        # Host staging (pinned on CUDA) and the static device buffers the graphs read.
        self._ids_h, self.input_ids = pair((rows,), torch.long)
        self._pos_h, self.positions = pair((rows,), torch.long)
        self._slot_h, self.slot_mapping = pair((rows,), torch.long)
        self._len_h, self.seq_lens = pair((rows,), torch.int32)
        self._bt_h, self.block_tables = pair((rows, width), torch.int32)
        # One query per row: cumulative offsets never change.
        self.query_start = torch.arange(rows + 1, dtype=torch.int32, device=self.device)

    @staticmethod
    def applies_to(backend: Any) -> bool:
        return callable(getattr(backend, "decode_graph_metadata", None))

    def size_for(self, n: int) -> int | None:
        for size in self.sizes:
            if size >= n:
                return size
        return None

    def run(self, batch: ScheduledBatch, tables: BlockTables,
            dropped: np.ndarray | None = None, last_tokens: Any = None
            ) -> torch.Tensor | None:
        """Hidden states ``[n, hidden]`` of a pure decode batch through a graph, or None
        when this batch must run eagerly (prefill, too large, graphs disabled).
        ``tables``: the rows' block tables (the runner's, already updated by the batch);
        ``dropped``: per entry, positions its row no longer caches (a KV press), or None;
        ``last_tokens``: per row, its last sampled token (fills placeholders)."""
        entries = batch.entries
        if self.disabled is not None or not entries:
            return None
        if len(columns_of(batch).token_ids) != len(entries):  # not one token each
            return None
        size = self.size_for(len(entries))
        if size is None:
            return None
        captured = self.captured.get(size)
        if captured is None:
            try:
                captured = self._capture(size)
            except Exception as err:  # noqa: BLE001 - a failed capture costs speed, never the step
                self.disabled = f"{type(err).__name__}: {err}"
                logger.warning("CUDA graph capture failed, running eagerly: %s", self.disabled)
                return None
            self.captured[size] = captured
        self._fill(batch, tables, size, dropped, last_tokens)
        captured.replay()
        return captured.hidden[: len(entries)]

    def _fill(self, batch: ScheduledBatch, tables: BlockTables, size: int, dropped=None,
              last_tokens=None) -> None:
        n, bs = len(batch.entries), self.block_size
        ids, pos, slot = self._ids_h.numpy(), self._pos_h.numpy(), self._slot_h.numpy()
        lens, staged = self._len_h.numpy(), self._bt_h.numpy()
        # One new token per row, at position ``start``.
        columns = columns_of(batch)
        rows, p = columns.rows, columns.starts
        # A row a KV press compacted caches ``dropped`` fewer tokens than its position.
        c = p if dropped is None else p - dropped
        ids[:n] = columns.token_ids
        if last_tokens is not None:
            fill_placeholders(last_tokens, ids[:n], rows)
        pos[:n] = p
        lens[:n] = c + 1
        width = max(1, int(-(-(c.max() + 1) // bs)))
        rows_tables = tables.tables[rows, :width]
        staged[:n, :width] = rows_tables
        slot[:n] = token_slots(rows_tables, np.arange(n), c, bs)
        # Safe to overwrite the pinned staging now: the previous step's copies finished
        # before its sampled tokens were read back, which waits for the stream.
        ids[n:size] = 0
        pos[n:size] = 0
        slot[n:size] = -1
        lens[n:size] = 0
        # Only the filled part moves; stale entries elsewhere are never read.
        self.input_ids[:size].copy_(self._ids_h[:size], non_blocking=True)
        self.positions[:size].copy_(self._pos_h[:size], non_blocking=True)
        self.slot_mapping[:size].copy_(self._slot_h[:size], non_blocking=True)
        self.seq_lens[:size].copy_(self._len_h[:size], non_blocking=True)
        self.block_tables[:n, :width].copy_(self._bt_h[:n, :width], non_blocking=True)

    def _capture(self, size: int) -> _Captured:
        metadata = self.backend.decode_graph_metadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start=self.query_start[: size + 1],
            block_size=self.block_size,
            max_context=self.max_model_len,
        )
        context = AttentionContext(self.backend, metadata, self.kv_caches)
        ids, positions = self.input_ids[:size], self.positions[:size]
        # Padding everywhere while capturing: the KV cache is not touched.
        self.slot_mapping[:size].fill_(-1)
        self.seq_lens[:size].zero_()

        def forward() -> torch.Tensor:
            return self.model(ids, positions, context)

        if self.emulate:
            hidden = forward()

            def replay() -> None:
                hidden.copy_(forward())

            return _Captured(replay, hidden, metadata)

        with torch.inference_mode():
            # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels, the
            # backend builds its per-shape launch lists) so the capture records only work.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    forward()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                hidden = forward()
        torch.cuda.synchronize(self.device)
        return _Captured(graph.replay, hidden, metadata)


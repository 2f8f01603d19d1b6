"""``BlockTables``: every row's KV block table, as an executor keeps it, updated from each
batch's entries (their ``blocks_from`` / ``blocks`` change)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from llmlab.scheduler.batch import ScheduledRequest


class BlockTables:
    """The block table of every row, kept by an executor and updated from each batch.

    ``tables[row, :lengths[row]]`` is the row's table. :meth:`apply` writes each entry's
    change (``blocks_from``, ``blocks``); nothing else is rebuilt per step, so a decode
    step that adds no block moves no table data at all.

    Args:
        num_rows: rows the scheduler may hand out (``max_num_seqs``).
        max_blocks: the longest table a row can have (``ceil(max_model_len / block_size)``).
    """

    def __init__(self, num_rows: int, max_blocks: int) -> None:
        self.tables = np.zeros((num_rows, max(max_blocks, 1)), dtype=np.int64)
        self.lengths = np.zeros(num_rows, dtype=np.int64)

    def apply(self, entries: Sequence[ScheduledRequest], columns: Any = None) -> None:
        """Write each entry's change; ``columns`` (the batch's
        :class:`~llmlab.scheduler.columns.BatchColumns`) finds the changed ones at once."""
        tables, lengths = self.tables, self.lengths
        if columns is not None:
            changed = (columns.num_blocks > 0) | (columns.blocks_from != lengths[columns.rows])
            entries = [entries[i] for i in np.flatnonzero(changed).tolist()]
        for e in entries:
            blocks = e.blocks
            if blocks or e.blocks_from != lengths[e.row]:
                end = e.blocks_from + len(blocks)
                if end > tables.shape[1]:
                    raise ValueError(
                        f"request {e.request_id!r} has {end} KV blocks, more than the "
                        f"{tables.shape[1]} a row holds (max_model_len / block_size)"
                    )
                tables[e.row, e.blocks_from : end] = blocks
                lengths[e.row] = end

    def release(self, rows: Sequence[int]) -> None:
        self.lengths[list(rows)] = 0

    def reset(self) -> None:
        self.lengths[:] = 0

    def table(self, row: int) -> tuple[int, ...]:
        return tuple(self.tables[row, : self.lengths[row]].tolist())

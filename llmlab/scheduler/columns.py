"""A batch's entries as arrays: the columns an executor applies a step with.

The scheduler builds them once per batch, on the engine's thread (with overlapped
scheduling that work hides behind the previous forward), so the executor's thread reads
column slices instead of walking the entries: which rows start, which block tables
changed, the flat token ids and positions. A batch built elsewhere (a profiling pass, a
test) gets its columns on first use (:func:`columns_of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np


@attrs.frozen(eq=False)
class BatchColumns:
    """Per entry (in batch order): ``rows``, ``starts`` (first position computed),
    ``lens`` (tokens computed), ``blocks_from`` and ``num_blocks`` (the block-table change);
    ``token_ids``: every entry's tokens, flat (placeholders included); ``setups``: indices
    of the entries that start their row; ``plain``: every entry scores its last token
    alone (no fork, prompt logprobs or lookahead), so sampling takes one row each."""

    rows: np.ndarray
    starts: np.ndarray
    lens: np.ndarray
    blocks_from: np.ndarray
    num_blocks: np.ndarray
    token_ids: np.ndarray
    setups: tuple[int, ...]
    plain: bool

    @classmethod
    def of(cls, entries: Sequence[Any]) -> BatchColumns:
        n = len(entries)
        # One pass over the entries (this runs every step): one row per entry, then one
        # contiguous row per column.
        table = np.array(
            [(e.row, e.start, len(e.token_ids), e.blocks_from, len(e.blocks), e.num_scored,
              len(e.forks), e.prompt_logprobs_from, e.num_lookahead, e.setup is not None)
             for e in entries], dtype=np.int64,
        ).reshape(n, 10).T.copy()
        table.flags.writeable = False  # read-only, as everything in a batch
        lens = table[2]
        total = int(lens.sum())
        if total == n:
            token_ids = np.fromiter((e.token_ids[0] for e in entries), np.int64, n)
        else:
            token_ids = np.fromiter((t for e in entries for t in e.token_ids), np.int64, total)
        token_ids.flags.writeable = False
        plain = bool((table[5] == 1).all() and not table[6].any() and (table[7] < 0).all()
                     and not table[8].any())
        setups = tuple(np.flatnonzero(table[9]).tolist())
        return cls(table[0], table[1], lens, table[3], table[4], token_ids, setups, plain)


def columns_of(batch: Any) -> BatchColumns:
    """The batch's columns: the scheduler's, or built now."""
    columns = batch.columns
    return columns if columns is not None else BatchColumns.of(batch.entries)

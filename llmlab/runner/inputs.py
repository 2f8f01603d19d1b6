"""A batch's model inputs, built on the host: the flat token ids, their positions, and the
attention backend's description (query and sequence lengths, block tables, KV slots).

Index arithmetic runs in numpy: a few small arrays per step, where each torch op would cost
more in dispatch than in work; one pass over the entries. The block tables are the
runner's persistent ones (:class:`~llmlab.runner.block_tables.BlockTables`), sliced by row.
A row whose KV a feature rewrote (a KV press) caches fewer tokens than its positions
count: its KV is written and read at ``position - dropped`` (the runner's plugins say so:
``kv_offsets``), and layers that hold different counts read the paged cache directly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from llmlab.attention.backend import AttentionInputs, token_slots
from llmlab.scheduler.batch import ScheduledBatch
from llmlab.scheduler.columns import columns_of


def batch_inputs(
    runner: Any,
    batch: ScheduledBatch,
    attention_state: Any = None,
    block_tables: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs]:
    """Flat ``input_ids``, ``positions`` and the :class:`AttentionInputs` of ``batch`` on
    ``runner``'s device (see the module docstring)."""
    entries = batch.entries
    n = len(entries)
    columns = columns_of(batch)
    lens, start, entry_rows = columns.lens, columns.starts, columns.rows
    # A row a feature compacted (a KV press) holds fewer tokens than its positions
    # count: its KV is written and read at ``position - dropped``.
    dropped, layer_shift = kv_offsets(runner.plugins, batch)
    kv_start = start if dropped is None else start - dropped
    seq_lens = kv_start + lens
    bs = runner.block_size
    if block_tables is None:
        width = int(-(-seq_lens.max() // bs))
        block_tables = runner.block_tables.tables[entry_rows, :width]
    num_tokens = len(columns.token_ids)
    input_ids = columns.token_ids.copy()  # placeholders are filled in place
    if num_tokens == n:  # all decodes: one token at each start
        seq_index = np.arange(n)
        pos = start.copy()  # the batch's columns are read-only
        fill_placeholders(runner.last_tokens, input_ids, entry_rows)
    else:
        seq_index = np.repeat(np.arange(n), lens)
        # Position of each flat token: its sequence's start plus its offset in the span.
        first = np.cumsum(lens) - lens
        pos = np.arange(num_tokens) - first[seq_index] + start[seq_index]
        fill_placeholders(runner.last_tokens, input_ids, entry_rows, seq_index)
    kv_pos = pos if dropped is None else pos - dropped[seq_index]
    slots = torch.from_numpy(token_slots(block_tables, seq_index, kv_pos, bs))
    dev = runner.device
    inputs = AttentionInputs(
        query_lens=lens.tolist(),
        seq_lens=seq_lens.tolist(),
        block_tables=torch.from_numpy(block_tables),
        slot_mapping=slots.to(dev),
        block_size=bs,
        device=dev,
        rows=tuple(entry_rows.tolist()),
        # Layers holding different counts read the paged cache: no per-row copy.
        state=attention_state if layer_shift is None else None,
        layer_shift=layer_shift,
    )
    return (
        torch.from_numpy(input_ids).to(dev),
        torch.from_numpy(pos).to(dev),
        inputs,
    )


def kv_offsets(plugins: Any, batch: ScheduledBatch) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Per entry, positions its row no longer caches (a KV press compacted it: KV is
    written and read at ``position - dropped``), and per layer and entry how many fewer
    tokens that layer holds; None where no plugin says so."""
    dropped = layer_shift = None
    for plugin in plugins:
        d, shift = plugin.kv_offsets(batch)
        dropped = d if dropped is None else dropped
        layer_shift = shift if layer_shift is None else layer_shift
    return dropped, layer_shift


def fill_placeholders(last_tokens: np.ndarray, input_ids: np.ndarray, entry_rows: np.ndarray,
                      seq_index: np.ndarray | None = None) -> None:
    """Replace each :data:`~llmlab.scheduler.batch.PLACEHOLDER` in ``input_ids`` (in
    place) with the last token its row sampled (``last_tokens``, per row): the batch was
    planned while the previous one ran (overlapped scheduling), and that one sampled it.
    ``entry_rows``: each entry's row; ``seq_index``: each token's entry (None: one token
    per entry). (A speculative step's tokens are not in ``last_tokens``: the engine never
    plans ahead of one.)"""
    holes = input_ids < 0
    if holes.any():
        rows = entry_rows if seq_index is None else entry_rows[seq_index]
        input_ids[holes] = last_tokens[rows[holes]]

"""Rows starting: the runner's per-row state created from a batch's setups.

The runner keeps each row's state across steps (sampling state, block table, the
plugins' state) and a step changes only what its batch says changed: the entries that
start a row (``setup``) and the block tables that grew or shrank, found from the batch's
columns (:class:`~llmlab.scheduler.columns.BatchColumns`) without walking every entry.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llmlab.sampling.metadata import SamplingRow
from llmlab.sampling.params import SamplingParams
from llmlab.scheduler.batch import ScheduledBatch
from llmlab.scheduler.columns import BatchColumns


def start_rows(runner: Any, batch: ScheduledBatch, columns: BatchColumns) -> None:
    """Create the state of each row the batch starts (its sampling row, parameters
    column, grammar and the plugins' state); raise ``ValueError`` if an entry's row has
    no state and no setup."""
    rows, started, plugins, entries = runner.rows, runner._started, runner.plugins, batch.entries
    for i in columns.setups:
        e = entries[i]
        setup = e.setup
        params = setup.params
        if isinstance(params, SamplingParams):
            grammar = None
            if params.structured_outputs is not None:
                grammar = runner._grammars().new_state(
                    params.structured_outputs, setup.output_token_ids
                )
            rows[e.row] = SamplingRow(
                e.request_id, params, setup.prompt_token_ids,
                list(setup.output_token_ids), setup.eos_token_ids, grammar,
            )
            runner.param_columns.set(e.row, params)
        else:  # a row that does not sample (pooling): its plugin keeps its state
            rows[e.row] = None
        started[e.row] = True
        for plugin in plugins:
            side = batch.sides.get(plugin.name)
            plugin.start_row(e.row, e, None if side is None else side.get(e.request_id))
    missing = np.flatnonzero(~started[columns.rows])
    if missing.size:
        e = entries[int(missing[0])]
        raise ValueError(
            f"row {e.row} (request {e.request_id!r}) has no state: a row's first entry "
            "must carry its setup"
        )

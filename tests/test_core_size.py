"""The core stays small: the files to read to know the engine, counted.

``CORE`` is the list; docs/architecture.md states its total, read from the same list (a
test below checks the figure). Lines count as ``wc -l`` does: docstrings and comments
included. A feature plugs in (``llmlab/plugin.py``) instead of growing these files.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]

CORE = (
    "llmlab/engine/engine.py",  # the step
    "llmlab/plugin.py",  # the feature seam
    "llmlab/scheduler/scheduler.py",  # building a batch
    "llmlab/scheduler/admission.py",  # admitting waiting requests
    "llmlab/scheduler/running.py",  # running requests: order, growth, preemption
    "llmlab/scheduler/lifecycle.py",  # committing a step's outputs; transitions
    "llmlab/scheduler/rows.py",  # row allocation
    "llmlab/scheduler/policy.py",  # the policy interface
    "llmlab/scheduler/batch.py",  # the step contract
    "llmlab/cache/kv_cache_manager.py",  # device blocks and tables (roles beside it: cache/)
    "llmlab/cache/block_pool.py",  # the block pool
    "llmlab/runner/model_runner.py",  # executing a batch
    "llmlab/runner/executor.py",  # the executor contract
    "llmlab/attention/backend.py",  # the attention backend contract
)
CORE_LIMIT = 3000
FILE_LIMIT = 300
ENGINE_LIMIT = 250


def lines(path: str) -> int:
    return len((ROOT / path).read_text().splitlines())


def core_lines() -> int:
    return sum(lines(path) for path in CORE)


def test_the_core_is_at_most_3000_lines():
    sizes = {path: lines(path) for path in CORE}
    assert sum(sizes.values()) <= CORE_LIMIT, sizes


def test_each_core_file_is_at_most_300_lines_and_the_engine_250():
    too_long = {p: n for p in CORE if (n := lines(p)) > FILE_LIMIT}
    assert not too_long
    assert lines("llmlab/engine/engine.py") <= ENGINE_LIMIT


def test_architecture_md_states_the_core_from_this_list():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    stated = re.search(r"\*\*The core\*\*.*? is ([\d,]+) lines", doc, re.DOTALL)
    assert stated, "docs/architecture.md must state the core's size ('The core ... is N lines')"
    assert int(stated.group(1).replace(",", "")) == core_lines()
    for path in CORE:
        assert path.removeprefix("llmlab/") in doc, f"docs/architecture.md does not name {path}"

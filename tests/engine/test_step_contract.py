"""The step contract is plain, read-only, picklable data.

A real run (chunked prefill, prefix-cache hits, parallel samples, a grammar, prompt
logprobs) is recorded batch by batch; each batch is pickled, unpickled in a fresh process
and executed there by a second model runner over the same weights, which must produce the
same tokens. Everything an executor receives is immutable, and no ``Request`` is reachable
from it, so an executor has no way to change lifecycle state.
"""

from __future__ import annotations

import enum
import json
import pathlib
import pickle
import subprocess
import sys
import textwrap

import attrs
import numpy as np
import pytest

from llmlab import LLM, SamplingParams, StructuredOutputsParams
from llmlab.request import Request
from llmlab.scheduler.batch import ScheduledBatch
from tests.helpers import SUBPROCESS_KV, subprocess_env

SETTINGS = dict(dtype="float32", block_size=4, max_num_batched_tokens=24, max_num_seqs=8,
                max_model_len=96, seed=0, enable_prefix_caching=True)


class Recording:
    """An executor that pickles every batch it passes on, with the tokens it got back."""

    def __init__(self, inner):
        self.inner = inner
        self.batches: list[ScheduledBatch] = []
        self.pickled: list[bytes] = []
        self.outputs: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, batch):
        self.batches.append(batch)
        self.pickled.append(pickle.dumps(batch))
        out = self.inner.execute(batch)
        self.outputs.append(_tokens(out))
        return out


def _tokens(out) -> dict:
    forks = None if out.forks is None else [[t for t, _, _ in f] for f in out.forks]
    return {"tokens": [list(t) for t in out.token_ids], "forks": forks}


@pytest.fixture(scope="module")
def recorded(tiny_llama):
    pytest.importorskip("xgrammar")
    llm = LLM(tiny_llama, **SETTINGS)
    engine = llm.llm_engine
    recording = Recording(engine.executor)
    engine.executor = recording
    shared = list(range(30, 50))  # 20 tokens: 4 full blocks to share
    engine.add_request("a", {"prompt_token_ids": shared + [7, 8]}, SamplingParams(max_tokens=4))
    engine.step()
    engine.step()  # a's prompt (22 tokens) is computed and cached
    engine.add_request("b", {"prompt_token_ids": shared + [9]}, SamplingParams(max_tokens=5))
    engine.add_request("forked", {"prompt_token_ids": list(range(60, 90))},  # chunked
                       SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=6))
    engine.add_request("grammar", "p1", SamplingParams(
        seed=2, temperature=1.0, max_tokens=10,
        structured_outputs=StructuredOutputsParams(regex="(ab|cd){2,4}")))
    engine.add_request("scored", {"prompt_token_ids": list(range(100, 110))},
                       SamplingParams(max_tokens=3, prompt_logprobs=2, logit_bias={5: 3.0}))
    while engine.has_unfinished_requests():
        engine.step()
    return recording


def test_the_run_covers_what_the_contract_must_carry(recorded):
    entries = [e for b in recorded.batches for e in b.entries]
    assert any(e.setup is not None and e.start > 0 for e in entries)  # a prefix hit
    assert any(e.forks for e in entries)  # parallel samples
    assert any(e.num_scored == 0 for e in entries)  # a prefill chunk
    assert any(e.setup is not None and e.setup.params.structured_outputs is not None
               for e in entries)
    assert any(e.prompt_logprobs_from >= 0 for e in entries)
    assert any(b.block_copies for b in recorded.batches)  # copy-on-write after the fork
    assert any(b.freed_rows for b in recorded.batches)


def test_a_pickled_batch_runs_on_a_second_runner_in_a_fresh_process(recorded, tiny_llama,
                                                                   tmp_path):
    path = tmp_path / "batches.pkl"
    path.write_bytes(pickle.dumps(recorded.pickled))
    script = textwrap.dedent(f"""
        import json, pickle, sys
        from llmlab import LLM
        from tests.engine.test_step_contract import SETTINGS, _tokens
        runner = LLM({tiny_llama!r}, **SETTINGS, **{SUBPROCESS_KV!r}).llm_engine.executor
        outputs = [_tokens(runner.execute(pickle.loads(b)))
                   for b in pickle.loads(open({str(path)!r}, "rb").read())]
        json.dump(outputs, sys.stdout)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300, check=False,
                          cwd=pathlib.Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == recorded.outputs
    assert sum(len(t) for o in recorded.outputs for t in o["tokens"]) > 20


def test_batches_are_small(recorded):
    # What a worker in another process receives each step: a decode entry is a few ids.
    decodes = [(b, len(b.entries)) for b in recorded.batches
               if b.entries and all(e.is_decode and e.setup is None for e in b.entries)]
    batch, n = max(decodes, key=lambda d: d[1])
    assert n >= 3
    per_entry = (len(pickle.dumps(batch)) - len(pickle.dumps(attrs.evolve(batch, entries=())))) / n
    assert per_entry < 150, per_entry


_IMMUTABLE = (int, float, str, bytes, bool, type(None), range, enum.Enum)


def _walk(value, path, seen):
    """Every object reachable from ``value`` must be immutable data."""
    if id(value) in seen:
        return
    seen.add(id(value))
    assert not isinstance(value, Request), f"{path} is a live Request"
    if isinstance(value, _IMMUTABLE) or callable(value):
        return  # user callables (logits processors) are code, not engine state
    if isinstance(value, (tuple, frozenset)):
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]", seen)
        return
    if isinstance(value, np.ndarray):  # the batch's columns: read-only arrays
        assert not value.flags.writeable, f"{path} is a writeable array"
        return
    if type(value).__name__ == "FrozenDict":
        for k, v in value.items():
            _walk(v, f"{path}[{k!r}]", seen)
        return
    assert attrs.has(type(value)), f"{path} is a {type(value).__name__}"
    fields = attrs.fields(type(value))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(value, fields[0].name, getattr(value, fields[0].name))
    for field in fields:
        _walk(getattr(value, field.name), f"{path}.{field.name}", seen)


def test_what_an_executor_receives_is_read_only_data(recorded):
    for i, batch in enumerate(recorded.batches):
        _walk(batch, f"batch{i}", set())
    entry = next(e for b in recorded.batches for e in b.entries if e.setup is not None)
    with pytest.raises(AttributeError):  # a named tuple
        entry.start = 0
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        entry.setup.params.max_tokens = 10**6
    with pytest.raises(TypeError):
        next(e for b in recorded.batches for e in b.entries
             if e.setup and e.setup.params.logit_bias).setup.params.logit_bias[0] = 100.0

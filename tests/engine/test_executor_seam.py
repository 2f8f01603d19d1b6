"""The engine drives any ``Executor`` on any clock: a cost model in virtual time runs the
same scheduler and KV cache manager as the real model, unchanged."""

from __future__ import annotations

import attrs
import pytest

from llmlab import EngineConfig, SamplingParams
from llmlab.cache import KVCacheManager
from llmlab.engine.engine import Engine
from llmlab.runner.executor import Executor, VirtualClock
from llmlab.scheduler import FCFS, BatchOutput, ScheduledBatch, Scheduler


@attrs.define
class CostModelExecutor:
    """Emits ``last token + 1`` and charges ``fixed_s + per_token_s * tokens`` of virtual time."""

    clock: VirtualClock
    fixed_s: float = 0.010
    per_token_s: float = 0.001
    batches: list[ScheduledBatch] = attrs.field(factory=list)
    live_rows: set[int] = attrs.field(factory=set)

    def execute(self, batch: ScheduledBatch) -> BatchOutput:
        self.batches.append(batch)
        self.live_rows -= set(batch.freed_rows)
        for entry in batch.entries:
            # A row is either new (and unused) or continuing (and live): never guessed.
            assert (entry.row in self.live_rows) != entry.new_row
            self.live_rows.add(entry.row)
        for entry in batch.entries:
            # A parallel sample's row starts with its leader's sample (its state from then).
            for fork in entry.forks:
                assert fork.row not in self.live_rows
                self.live_rows.add(fork.row)
        self.clock.advance(self.fixed_s + self.per_token_s * batch.num_batched_tokens)
        return BatchOutput.from_lists(
            [[(e.token_ids[-1] + 1) % 100] * e.num_scored for e in batch.entries],
            [[-0.5] * e.num_scored for e in batch.entries],
        )


def make_engine(num_blocks=64, max_num_seqs=4, budget=32):
    clock = VirtualClock()
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4)
    scheduler = Scheduler(kv=kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=256, policy=FCFS())
    executor = CostModelExecutor(clock)
    engine = Engine(config=EngineConfig(model="cost-model"), scheduler=scheduler,
                    executor=executor, tokenizer=None, vocab_size=100, max_model_len=256,
                    eos_token_ids=frozenset(), clock=clock)
    return engine, executor, clock


def test_a_cost_model_executor_drives_the_real_scheduler_in_virtual_time():
    engine, executor, clock = make_engine()
    assert isinstance(executor, Executor)
    events = []
    engine.subscribe(events.append)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", [10 + i] * (20 + i), params, arrival_time=clock())
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert outputs == {f"r{i}": [(11 + i + k) % 100 for k in range(5)] for i in range(6)}
    # Time is virtual: each step cost exactly what the cost model charged.
    expected = [0.010 + 0.001 * b.num_batched_tokens for b in executor.batches if b.entries]
    assert [e.model_time_s for e in events if e.scheduled] == pytest.approx(expected)
    assert clock() == pytest.approx(sum(0.010 + 0.001 * b.num_batched_tokens
                                        for b in executor.batches))
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_rows_are_assigned_at_admission_and_released_explicitly():
    engine, executor, _ = make_engine(num_blocks=20, max_num_seqs=3, budget=64)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for i in range(7):
        engine.add_request(f"r{i}", [1 + i] * 9, params)
    while engine.has_unfinished_requests():
        engine.step()
    rows = {e.row for b in executor.batches for e in b.entries}
    assert rows <= {0, 1, 2}
    freed = [r for b in executor.batches for r in b.freed_rows]
    new = [e.row for b in executor.batches for e in b.entries if e.new_row]
    # Every admission got a row that was later released: the last releases wait for the
    # next batch to report them.
    pending = engine.scheduler._rows.drain_released()
    assert len(new) == len(freed) + len(pending) and sorted(pending) == sorted(executor.live_rows)
    assert engine.scheduler._rows.num_free == 3


def test_an_executor_can_return_several_tokens_per_request():
    """The contract carries token lists: a verifier may accept several drafts in one step."""
    engine, _, _ = make_engine()

    class TwoTokens:
        batches: list = []

        def execute(self, batch):
            self.batches.append(batch)
            return BatchOutput.from_lists(
                [[7, 8][: 2 * e.num_scored] for e in batch.entries],
                [[-0.1, -0.2][: 2 * e.num_scored] for e in batch.entries],
            )

    executor = engine.executor = TwoTokens()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=3, stop_token_ids=[8]))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    # Appended one by one, stopping at max_tokens or a stop token mid-list.
    assert outputs["a"].token_ids == [7, 8, 7, 8, 7] and outputs["a"].finish_reason == "length"
    assert outputs["b"].token_ids == [7, 8] and outputs["b"].stop_reason == 8
    # The next step computes both appended tokens (the span is 2 long).
    assert any(e.num_new_tokens == 2 for b in executor.batches for e in b.entries if e.start > 0)

"""Overlapped scheduling (``async_scheduling``): each batch is planned while the previous one
runs, with placeholders for the tokens it has not sampled yet. The same tokens, text and
finish reasons as the synchronous engine, over randomized workloads with stop strings,
aborts between steps, preemption, n > 1 and seeded sampling; features that decide from
committed state (speculation, KV presses, grammars, prompt logprobs) run those steps
synchronously and still match; a failed batch abandons the one planned after it, and
nothing leaks."""

from __future__ import annotations

import random
import types

import numpy as np

import pytest

from llmlab import LLM, EngineConfig, SamplingParams
from llmlab.cache import KVCacheManager
from llmlab.engine.engine import Engine
from llmlab.engine.overlap import Overlap
from llmlab.scheduler import FCFS, Scheduler
from llmlab.lora.schedule import LoRASchedule
from llmlab.plugin import SchedulerPlugin
from llmlab.scheduler.batch import PLACEHOLDER

COMMON = dict(dtype="float64", block_size=4, max_model_len=96, seed=0)


def workload(n: int, seed: int):
    """Random prompts and a mix of parameters: greedy and seeded sampling, stop strings and
    stop tokens, min_tokens, ignore_eos, logprobs, n > 1."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        prompts.append({"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))]})
        kind = rng.choice(["greedy", "seeded", "stop", "n", "logprobs"])
        common = dict(max_tokens=rng.randrange(1, 28), ignore_eos=rng.random() < 0.5,
                      min_tokens=rng.choice([0, 0, 2]))
        if kind == "greedy":
            p = SamplingParams(temperature=0.0, stop_token_ids=[rng.randrange(3, 500)], **common)
        elif kind == "seeded":
            p = SamplingParams(temperature=0.9, top_p=0.9, seed=1000 + i, **common)
        elif kind == "stop":
            p = SamplingParams(temperature=0.0, stop=[rng.choice(["e", "a", "th", "o"])], **common)
        elif kind == "n":
            p = SamplingParams(temperature=0.8, n=2, seed=2000 + i, **common)
        else:
            p = SamplingParams(temperature=0.0, logprobs=2, **common)
        params.append(p)
    return prompts, params


def count_placeholders(engine) -> list[int]:
    """Wrap the executor: the list counts the entries of each batch that carry a
    placeholder (a batch planned while the previous one ran)."""
    counts: list[int] = []
    inner = engine.executor.execute

    def execute(batch):
        counts.append(sum(PLACEHOLDER in e.token_ids for e in batch.entries))
        return inner(batch)

    engine.executor.execute = execute
    return counts


def completions(out) -> list:
    """What a finished output says, per sample: tokens, text, why it ended, logprobs."""
    return [(c.index, tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [sorted(d) for d in c.logprobs])
            for c in sorted(out.outputs, key=lambda c: c.index)]


def run(engine, prompts, params, aborts=None):
    """Step ``engine`` to the end, aborting ``aborts[step]`` request ids before that step;
    returns each request's final output and the outputs seen after its abort."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    final, after_abort, aborted = {}, [], set()
    step = 0
    while engine.has_unfinished_requests():
        if aborts and step in aborts:
            engine.abort_request(aborts[step])
            aborted.update(aborts[step])
        for out in engine.step():
            if out.request_id in aborted:
                after_abort.append(out.request_id)
            if out.finished:
                final[out.request_id] = completions(out)
        step += 1
    return final, after_abort


def run_through(engine, prompts, params, error: type[BaseException]):
    """Step ``engine`` to the end through steps that raise ``error`` (after each, nothing
    is in flight and the pool is consistent); its final outputs and how many raised."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    final, raised = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except error:
            raised += 1
            assert error is KeyboardInterrupt or not engine.overlap.in_flight
            engine.kv_cache.check()
            continue
        final.update((out.request_id, completions(out)) for out in outs if out.finished)
    return final, raised


def assert_clean(engine) -> None:
    kv = engine.kv_cache
    kv.check()
    assert not engine.has_unfinished_requests() and engine._requests == {}
    assert int(kv.pool.ref_counts.sum()) == 0 and kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlapped_matches_synchronous_token_for_token(tiny_llama, seed):
    """A small cache (preemption), few rows, random parameters, aborts between steps."""
    prompts, params = workload(24, seed)
    rng = random.Random(seed)
    aborts = {rng.randrange(2, 30): [str(rng.randrange(24))] for _ in range(3)}
    results = {}
    for overlapped in (False, True):
        llm = LLM(tiny_llama, max_num_seqs=6, num_gpu_blocks_override=28,
                  async_scheduling=overlapped, **COMMON)
        engine = llm.llm_engine
        assert (engine.overlap is not None) is overlapped
        placeholders = count_placeholders(engine)
        preempted = []
        engine.subscribe(lambda event: preempted.extend(event.preempted))
        results[overlapped] = run(engine, prompts, params, aborts)
        assert results[overlapped][1] == [], "an output came after its abort"
        assert_clean(engine)
        assert preempted, "the cache was meant to be small enough to preempt"
        if overlapped:
            assert sum(placeholders) > 0, "no batch was planned ahead"
        else:
            assert sum(placeholders) == 0
        llm.llm_engine.shutdown()
    sync, overlapped = results[False][0], results[True][0]
    assert sync.keys() == overlapped.keys()
    for rid in sync:
        assert overlapped[rid] == sync[rid], rid


def test_planned_and_synchronous_steps_alternate(tiny_llama):
    """Requests with a grammar arrive now and then (a batch holding one is not planned
    ahead of), and a small token budget chunks prompts and leaves some requests out of a
    step: what was marked in flight must never outlive its batch."""
    from llmlab.sampling.params import StructuredOutputsParams

    rng = random.Random(7)
    prompts, params = [], []
    for i in range(16):
        prompts.append({"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(4, 30))]})
        grammar = StructuredOutputsParams(regex="[a-e ]+") if i % 5 == 2 else None
        params.append(SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 20),
                                     structured_outputs=grammar))
    results = {}
    for overlapped in (False, True):
        llm = LLM(tiny_llama, max_num_seqs=5, max_num_batched_tokens=24,
                  enable_chunked_prefill=True, async_scheduling=overlapped, **COMMON)
        placeholders = count_placeholders(llm.llm_engine)
        results[overlapped], _ = run(llm.llm_engine, prompts, params)
        assert_clean(llm.llm_engine)
        if overlapped:
            assert 0 in placeholders[2:] and sum(placeholders) > 0  # both kinds of step
        llm.llm_engine.shutdown()
    assert results[True] == results[False]


def test_llm_generate_matches_and_leaves_nothing_in_flight(tiny_llama):
    prompts = ["the cat sat on the mat", "hello world hello", "one two three four"] * 3
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 2 * i, stop=["e"] if i % 3 == 0 else None)
              for i in range(len(prompts))]
    got = {}
    for overlapped in (False, True):
        llm = LLM(tiny_llama, async_scheduling=overlapped, **COMMON)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[overlapped] = [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]
        assert_clean(llm.llm_engine)
        assert not (llm.llm_engine.overlap and llm.llm_engine.overlap.in_flight)
        again = llm.generate(prompts[:2], params[:2], use_tqdm=False)  # the engine is reusable
        assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in again] == got[overlapped][:2]
        llm.llm_engine.shutdown()
    assert got[True] == got[False]


LORA_PROMPTS = [{"prompt_token_ids": [random.Random(i).randrange(3, 200) for _ in range(12)]}
                for i in range(6)]


@pytest.mark.parametrize("feature", ["speculation", "press", "grammar", "prompt_logprobs", "lora"])
def test_features_match_with_async_scheduling_on(tiny_llama, tmp_path, feature):
    """Features that decide from committed state run synchronous steps (nothing planned
    ahead: speculation, a KV press, a grammar); LoRA plans ahead. Either way the tokens
    are the synchronous engine's."""
    settings: dict = {}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = LORA_PROMPTS
    lora = None
    if feature == "speculation":
        settings["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 2,
                                          "prompt_lookup_max": 2}
    elif feature == "press":
        settings.update(kv_press="streaming_llm",
                        kv_press_config={"compression_ratio": 0.5, "n_sink": 2})
    elif feature == "grammar":
        from llmlab.sampling.params import StructuredOutputsParams

        params = SamplingParams(temperature=0.0, max_tokens=12,
                                structured_outputs=StructuredOutputsParams(regex="[a-d ]+"))
        prompts = ["the cat", "hello", "one two"]
    elif feature == "prompt_logprobs":
        params = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=1)
    else:
        from llmlab.lora.request import LoRARequest
        from tests.lora.conftest import build_adapter

        settings.update(enable_lora=True, max_loras=2)
        lora = LoRARequest("a", 1, build_adapter(tiny_llama, tmp_path / "a", seed=1))
    got = {}
    for overlapped in (False, True):
        llm = LLM(tiny_llama, async_scheduling=overlapped, max_num_seqs=4, **settings, **COMMON)
        placeholders = count_placeholders(llm.llm_engine)
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        got[overlapped] = [o.outputs[0].token_ids for o in outs]
        if overlapped:
            # Prompt logprobs are scored in prefill only: the decodes after it plan ahead.
            assert (sum(placeholders) > 0) is (feature in ("lora", "prompt_logprobs"))
        assert_clean(llm.llm_engine)
        llm.llm_engine.shutdown()
    assert got[True] == got[False]


class Boom(RuntimeError):
    pass


def matches_synchronous_through(monkeypatch, tiny_llama, prompts, params, fault, error,
                                **settings) -> int:
    """Run the workload on an overlapped engine whose executor calls ``fault(batch)``
    first, through every step that raises ``error``: its final outputs are the synchronous
    engine's, nothing leaks, and no batch planned ahead of a failed one ever reached the
    executor (it is queued behind it on the worker). Returns how many steps raised."""
    expected, _ = run(LLM(tiny_llama, async_scheduling=False, **settings, **COMMON).llm_engine,
                      prompts, params)
    engine = LLM(tiny_llama, async_scheduling=True, **settings, **COMMON).llm_engine
    inner = engine.executor.execute
    executed, failed, planned_after = [], [], {}
    schedule = Overlap._schedule

    def plan(self, now, ahead_of=None):
        batch = schedule(self, now, ahead_of)
        if ahead_of is not None:
            planned_after[id(ahead_of)] = batch
        return batch

    def execute(batch):
        executed.append(batch)
        try:
            fault(batch)
        except error:
            failed.append(batch)
            raise
        return inner(batch)

    monkeypatch.setattr(Overlap, "_schedule", plan)
    engine.executor.execute = execute
    final, raised = run_through(engine, prompts, params, error)
    assert final == expected
    assert_clean(engine)
    engine.shutdown()
    abandoned = [planned_after[id(b)] for b in failed if id(b) in planned_after]
    assert not any(a is b for a in abandoned for b in executed)
    return raised


def test_a_failed_batch_abandons_the_one_planned_after_it(monkeypatch, tiny_llama):
    prompts, params = workload(12, seed=5)
    planned = [0]

    def fault(batch):
        if any(PLACEHOLDER in e.token_ids for e in batch.entries):
            planned[0] += 1
            if planned[0] in (3, 9):  # a batch planned ahead fails in the forward
                raise Boom("the device fell over")

    assert matches_synchronous_through(monkeypatch, tiny_llama, prompts, params, fault, Boom,
                                       max_num_seqs=4, num_gpu_blocks_override=24) == 2


def test_async_scheduling_needs_an_executor_that_fills_placeholders():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(kv=kv, max_num_seqs=2, max_num_batched_tokens=16,
                          max_model_len=32, policy=FCFS())

    class Plain:
        def execute(self, batch):
            raise AssertionError("never run")

    def build(setting):
        return Engine(config=EngineConfig(model="cost-model", async_scheduling=setting),
                      scheduler=scheduler, executor=Plain(), tokenizer=None, vocab_size=100,
                      max_model_len=32, eos_token_ids=frozenset())

    assert build(None).overlap is None  # the default: synchronous where it cannot overlap
    with pytest.raises(ValueError, match="async_scheduling=True.*Plain"):
        build(True)

    class OnCuda(Plain):  # fills placeholders, on a CUDA device: overlapped by default
        plans_ahead = True
        device = types.SimpleNamespace(type="cuda")

    def on_cuda(plugins=()):
        sched = Scheduler(kv=KVCacheManager(num_blocks=8, block_size=4), max_num_seqs=2,
                          max_num_batched_tokens=16, max_model_len=32, plugins=plugins)
        return Engine(config=EngineConfig(model="cost-model"), scheduler=sched,
                      executor=OnCuda(), tokenizer=None, vocab_size=100, max_model_len=32,
                      eos_token_ids=frozenset())

    for plugins, overlapped in (((), True), ((LoRASchedule(2),), True),
                                # one never letting a batch be planned ahead: no thread
                                ((SchedulerPlugin(),), False)):
        engine = on_cuda(plugins)
        assert (engine.overlap is not None) is overlapped, plugins
        engine.shutdown()
    with pytest.raises(TypeError, match="async_scheduling must be a bool"):
        EngineConfig(model="m", async_scheduling="sometimes")


def test_the_runner_state_equals_one_rebuilt_from_the_scheduler_after_every_step(tiny_llama):
    """The runner keeps its rows across steps and applies only each batch's changes (rows
    started, block tables grown or shrunk, found from the batch's columns). After every
    step of a long randomized run (rows added, freed and reused, preempted, resumed,
    aborted; parallel samples) its state equals what the scheduler says from scratch."""
    prompts, params = workload(40, seed=11)
    llm = LLM(tiny_llama, max_num_seqs=6, num_gpu_blocks_override=30, max_num_batched_tokens=32,
              async_scheduling=False, **COMMON)
    engine = llm.llm_engine
    runner, sched = engine.executor, engine.scheduler
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    batches = []
    execute = runner.execute
    runner_execute = lambda batch: batches.append(batch) or execute(batch)  # noqa: E731
    engine.executor = type("Recording", (), {"execute": staticmethod(runner_execute),
                                             "__getattr__": lambda _, n: getattr(runner, n)})()
    rng = random.Random(3)
    steps = preempted = 0
    while engine.has_unfinished_requests():
        if rng.random() < 0.05 and sched.running:
            engine.abort_request(rng.choice(sched.running).request_id.split("_")[-1])
        engine.step()
        steps += 1
        preempted += sum(r.num_preemptions for r in sched.waiting)
        running = {r.row: r for r in sched.running}
        pending_release = set(sched._rows._released)
        started = set(np.flatnonzero(runner._started).tolist())
        assert set(running) <= started and started - set(running) <= pending_release
        # The rows this step ran (a parallel sample forked in it has its row started but
        # gets its table with its first entry, next step).
        ran = {e.row for e in batches[-1].entries} if batches else set()
        for row, request in running.items():
            if row not in ran:
                continue
            assert runner.block_tables.table(row) == sched.kv.block_table(request.request_id)
            state = runner.rows[row]
            assert state.request_id == request.request_id
            assert state.output_token_ids == request.output_token_ids
            if request.output_token_ids and request.num_computed_tokens == request.num_tokens - 1:
                # decoding: what a placeholder of its next entry would stand for
                assert runner.last_tokens[row] == request.output_token_ids[-1]
    assert steps > 50 and preempted, (steps, preempted)
    assert_clean(engine)


def test_streams_through_the_async_engine_match(tiny_llama):
    """The server's path: AsyncEngine's loop thread steps an overlapped engine; DELTA
    streams add up to the synchronous text, and a stream closed early aborts its request
    without disturbing the others."""
    import asyncio
    import time

    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.sampling.params import RequestOutputKind

    prompts = ["the cat sat on the mat", "hello world hello", "one two three four", "a b c"]

    def streams(overlapped: bool):
        engine = AsyncEngine.from_settings(tiny_llama, async_scheduling=overlapped, **COMMON)

        async def one(i, prompt):
            params = SamplingParams(temperature=0.0, max_tokens=16 + i, ignore_eos=True,
                                    output_kind=RequestOutputKind.DELTA)
            text, ids = "", []
            async for out in engine.generate(prompt, params, request_id=f"r{i}"):
                text += out.outputs[0].text
                ids += out.outputs[0].token_ids
                if i == 3 and len(ids) >= 5:
                    break  # closes the stream: aborts the request
            return text, ids

        async def main():
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        try:
            results = asyncio.run(main())
            inner = engine.engine
            for _ in range(200):  # the loop thread frees the aborted request's blocks
                if not inner.has_unfinished_requests():
                    break
                time.sleep(0.01)
            assert_clean(inner)
            return results
        finally:
            engine.shutdown()

    sync, overlapped = streams(False), streams(True)
    assert overlapped[:3] == sync[:3]
    assert overlapped[3][1][:5] == sync[3][1][:5]


def test_ctrl_c_during_an_overlapped_step_is_raised_after_its_commit(monkeypatch, tiny_llama):
    """A SIGINT while the executor thread runs a batch: the step still commits it (a batch
    cannot be stopped mid-forward), then raises KeyboardInterrupt; the engine goes on to
    the synchronous engine's tokens."""
    import signal
    import threading

    prompts, params = workload(8, seed=21)
    calls = [0]
    main = threading.main_thread().ident

    def fault(batch):
        calls[0] += 1
        if calls[0] == 4:
            signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C while this batch runs

    assert matches_synchronous_through(monkeypatch, tiny_llama, prompts, params, fault,
                                       KeyboardInterrupt) == 1


def test_step_events_say_what_a_synchronous_step_says(tiny_llama):
    """Planning a batch ahead touches KV blocks (allocations, swaps, preemptions) before
    the previous batch commits. A step's event covers one window of time: the batch it
    committed, and the batches planned meanwhile with their block events, so a swap-out
    comes in the event that lists its preemption."""
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(24)]} for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got = {}
    for overlapped in (False, True):
        llm = LLM(tiny_llama, num_gpu_blocks_override=40, preemption_mode="swap",
                  swap_space=1 / 4096, async_scheduling=overlapped, **COMMON)
        events = []
        llm.llm_engine.subscribe(events.append)
        got[overlapped] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                        use_tqdm=False)]
        swapped = [(e.step_index, rid) for e in events for rid, _ in e.swapped_out]
        assert swapped, "the cache was meant to be small enough to swap"
        assert all(rid in e.preempted for e in events for rid, _ in e.swapped_out)
        assert_clean(llm.llm_engine)
        llm.llm_engine.shutdown()
    assert got[True] == got[False]

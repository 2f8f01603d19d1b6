"""``AsyncEngine``: streaming outputs, abort, failures that end streams instead of hanging."""

from __future__ import annotations

import asyncio

import pytest

from llmlab import LLM, SamplingParams
from llmlab.entrypoints.async_engine import AsyncEngine, EngineDeadError, EngineError
from llmlab.errors import RequestFailedError
from llmlab.sampling.params import RequestOutputKind
from tests.helpers import run

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def test_generate_streams_what_llm_generate_returns(engine, tiny_llama):
    want = LLM(tiny_llama, dtype="float32").generate(["Hello", "Bye now"], GREEDY, use_tqdm=False)

    async def main():
        async def one(prompt, rid):
            outs = [o async for o in engine.generate(prompt, GREEDY, rid)]
            return outs

        return await asyncio.gather(one("Hello", "a"), one("Bye now", "b"))

    a, b = run(main())
    for outs, ref in ((a, want[0]), (b, want[1])):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert outs[-1].outputs[0].text == ref.outputs[0].text
        assert len(outs) > 1  # cumulative outputs, one per step
    assert engine.engine.kv_cache.usage == 0.0


def test_delta_outputs_concatenate(engine):
    params = SamplingParams(max_tokens=10, temperature=0.0, output_kind=RequestOutputKind.DELTA)

    async def main():
        deltas = [o async for o in engine.generate("Deltas", params)]
        final = [o async for o in engine.generate(
            "Deltas", SamplingParams(max_tokens=10, temperature=0.0,
                                     output_kind=RequestOutputKind.FINAL_ONLY))]
        return deltas, final

    deltas, final = run(main())
    assert len(final) == 1
    assert "".join(d.outputs[0].text for d in deltas if d.outputs) == final[0].outputs[0].text
    streamed = [t for d in deltas if d.outputs for t in d.outputs[0].token_ids]
    assert streamed == final[0].outputs[0].token_ids


def test_bad_input_raises_in_the_caller_and_queues_nothing(engine):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("x", {"prompt_token_ids": [1] * 600}, GREEDY)
        with pytest.raises(ValueError, match="prompt is empty"):
            await engine.add_request("y", "", GREEDY)
        stream = await engine.add_request("dup", "Hi", SamplingParams(max_tokens=50))
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("dup", "Hi", GREEDY)
        stream.abort()

    run(main())
    assert engine.num_open_requests == 0


def test_abort_and_closing_the_generator_free_blocks(engine):
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        gen = engine.generate("A long one", long, "g")
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()  # a client that went away
        stream = await engine.add_request("s", "Another", long)
        await stream.__anext__()
        while stream._queue.qsize() < 2:  # outputs delivered but not read yet
            await asyncio.sleep(0.001)
        await engine.abort("s")
        rest = [o async for o in stream]  # the stream just ends
        return rest

    assert run(main()) == []
    _wait_until(lambda: engine.engine.kv_cache.usage == 0.0 and
                not engine.engine.has_unfinished_requests())
    assert not engine.engine.has_request("g") and not engine.engine.has_request("s")


def test_a_failing_step_fails_requests_in_flight_and_the_engine_recovers(engine):
    inner = engine.engine.executor
    state = {"fail": False}

    class Flaky:
        def __getattr__(self, name):
            return getattr(inner, name)

        def execute(self, batch):
            if state["fail"]:
                raise RuntimeError("device lost")
            return inner.execute(batch)

    engine.engine.executor = Flaky()

    async def main():
        state["fail"] = True
        streams = [await engine.add_request(f"r{i}", "Hello", GREEDY) for i in range(3)]
        for stream in streams:
            with pytest.raises(EngineError, match="device lost"):
                async for _ in stream:
                    pass
        with pytest.raises(EngineError):
            await engine.check_health()
        state["fail"] = False
        outs = [o async for o in engine.generate("Hello", GREEDY)]
        await engine.check_health()
        return outs

    outs = run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
    assert engine.engine.kv_cache.usage == 0.0


def test_a_request_added_while_a_step_fails_is_not_failed_with_it(engine):
    """A step fails while a new request waits in the inbox (added after that step began):
    the failure ends the requests the engine held, not the newcomer, which then runs."""
    import threading

    inner = engine.engine.executor
    failing, added = threading.Event(), threading.Event()

    class FailsOnceAfterTheNewcomer:
        def __getattr__(self, name):
            return getattr(inner, name)

        def execute(self, batch):
            if failing.is_set():
                failing.clear()
                assert added.wait(30)  # the newcomer is queued while this step runs
                raise RuntimeError("device lost")
            return inner.execute(batch)

    engine.engine.executor = FailsOnceAfterTheNewcomer()

    async def main():
        failing.set()
        held = await engine.add_request("held", "Hello", GREEDY)
        while failing.is_set():  # the failing step has begun
            await asyncio.sleep(0.001)
        newcomer = await engine.add_request("newcomer", "Bye now", GREEDY)
        added.set()
        with pytest.raises(EngineError, match="device lost"):
            async for _ in held:
                pass
        return [o async for o in newcomer]

    try:
        outs = run(main())
    finally:
        engine.engine.executor = inner
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
    assert engine.engine.kv_cache.usage == 0.0


def test_a_request_the_engine_fails_ends_its_stream_with_the_reason(engine):
    # The builder sizes the cache for max_model_len, so make the scheduler fail one request
    # mid-step as it would one that can never fit.
    scheduler, inner = engine.engine.scheduler, engine.engine.executor

    class FailsBig:
        def __getattr__(self, name):
            return getattr(inner, name)

        def execute(self, batch):
            for entry in batch.entries:
                request = engine.engine._requests.get(entry.request_id)
                if entry.request_id == "big" and not request.is_finished:
                    scheduler._fail(request, "request 'big' can never be scheduled")
            return inner.execute(batch)

    engine.engine.executor = FailsBig()

    async def main():
        big = await engine.add_request("big", "Hello", SamplingParams(max_tokens=60))
        small = await engine.add_request("small", "Hello", GREEDY)
        with pytest.raises(RequestFailedError, match="never be scheduled"):
            async for _ in big:
                pass
        return [o async for o in small]

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    _wait_until(lambda: engine.engine.kv_cache.usage == 0.0)


def test_shutdown_ends_open_streams_and_refuses_new_requests(tiny_llama):
    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")

    async def main():
        stream = await engine.add_request(
            "s", "Hi", SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("t", "Hi", GREEDY)
        with pytest.raises(EngineDeadError):
            await engine.check_health()

    run(main())
    assert not engine.is_running
    assert engine.engine.kv_cache.usage == 0.0


def _wait_until(condition, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_failure_raised_before_a_partial_output_still_ends_its_stream(tiny_llama):
    """A data-parallel front end raises a dead replica's failure first, then hands over what
    the replica reported before it died *and* the final "abort" output in one batch: the
    stream ends with that failure, not a generic abort (seen on an H100, where a replica's
    last report and its death were read together)."""
    from llmlab.outputs import CompletionOutput, RequestOutput

    inner = LLM(tiny_llama, dtype="float32").llm_engine

    class DiesMidway:
        def __init__(self):
            self.state, self.held = "running", None

        def __getattr__(self, name):
            return getattr(inner, name)

        def step(self):
            if self.state == "raise":
                self.state = "deliver"
                raise RequestFailedError("r", "replica 1 (pid 7) died (killed by SIGKILL)")
            if self.state == "deliver":
                self.state = "done"
                inner.abort_request("r")
                final = RequestOutput("r", self.held.prompt, self.held.prompt_token_ids,
                                      [CompletionOutput(0, "", [], None, finish_reason="abort")],
                                      finished=True)
                return [self.held, final]
            outputs = inner.step()
            held = [o for o in outputs if o.request_id == "r" and not o.finished]
            if self.state == "running" and held:
                self.state, self.held = "raise", held[0]
                return [o for o in outputs if o is not held[0]]
            return outputs

    engine = AsyncEngine(DiesMidway())
    try:
        async def main():
            stream = await engine.add_request(
                "r", "Hello", SamplingParams(max_tokens=50, ignore_eos=True))
            with pytest.raises(RequestFailedError, match="replica 1 .*SIGKILL"):
                async for _ in stream:
                    pass

        run(main())
    finally:
        engine.shutdown()

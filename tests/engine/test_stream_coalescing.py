"""``AsyncEngine``'s hand-off to asyncio: a DELTA stream whose reader falls behind gets its
pending outputs merged into one (``RequestOutput.add``, vLLM's), and the engine thread
wakes each event loop once per step, however many requests it serves."""

from __future__ import annotations

import asyncio
import threading

from llmlab import SamplingParams
from llmlab.engine.outputs import CompletionOutput, RequestOutput
from llmlab.sampling.logprobs import Logprob
from llmlab.sampling.params import RequestOutputKind
from tests.helpers import run


def _params(kind: RequestOutputKind, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, output_kind=kind,
                          **kwargs)


def _completion(index, text, ids, finish=None, logprobs=None) -> CompletionOutput:
    return CompletionOutput(index=index, text=text, token_ids=ids, cumulative_logprob=None,
                            logprobs=logprobs, finish_reason=finish)


def test_request_output_add_merges_deltas_per_choice():
    first = RequestOutput("r", "p", [1], [_completion(0, "a", [5], logprobs=[{5: Logprob(-1.0)}])],
                          finished=False, prompt_logprobs=[None, {1: Logprob(-2.0)}])
    second = RequestOutput("r", "p", [1], [
        _completion(1, "x", [7]),
        _completion(0, "b", [6], finish="length", logprobs=[{6: Logprob(-0.5)}]),
    ], finished=True, prompt_logprobs=None)
    first.add(second, aggregate=True)
    by_index = {c.index: c for c in first.outputs}
    assert (by_index[0].text, by_index[0].token_ids) == ("ab", [5, 6])
    assert [list(lp) for lp in by_index[0].logprobs] == [[5], [6]]
    assert by_index[0].finish_reason == "length"
    assert (by_index[1].text, by_index[1].token_ids) == ("x", [7])
    assert first.finished
    assert first.prompt_logprobs == [None, {1: Logprob(-2.0)}]  # the first delta's, kept
    # not aggregating (cumulative outputs): the newer completion replaces the older
    later = RequestOutput("r", "p", [1], [_completion(0, "abc", [5, 6, 8])], finished=True)
    first.add(later, aggregate=False)
    assert {c.index: c.text for c in first.outputs} == {0: "abc", 1: "x"}


def test_a_slow_delta_reader_gets_merged_outputs(engine):
    params = _params(RequestOutputKind.DELTA, logprobs=1)

    async def main():
        final = [o async for o in engine.generate("Slow", _params(RequestOutputKind.FINAL_ONLY,
                                                                   logprobs=1))]
        outs = []
        async for out in engine.generate("Slow", params):
            outs.append(out)
            await asyncio.sleep(0.05)  # a reader slower than the engine's steps
        return final[0], outs

    final, outs = run(main())
    assert len(outs) < 24 / 2  # one per read, not one per step
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    want = final.outputs[0]
    assert "".join(c.text for o in outs for c in o.outputs) == want.text
    assert [t for o in outs for c in o.outputs for t in c.token_ids] == want.token_ids
    assert [lp for o in outs for c in o.outputs for lp in c.logprobs] == want.logprobs
    assert outs[-1].outputs[0].finish_reason == want.finish_reason == "length"


def test_cumulative_outputs_are_not_merged(engine):
    async def main():
        stream = await engine.add_request("c", "Cumulative",
                                          _params(RequestOutputKind.CUMULATIVE))
        while not stream.finished:
            await asyncio.sleep(0.01)
        return [o async for o in stream]

    outs = run(main())
    assert len(outs) == 24  # every step's output, read late
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 25))


def test_the_engine_thread_wakes_each_loop_once_per_step(engine, monkeypatch):
    """All of a step's outputs for one event loop go in one ``call_soon_threadsafe``."""
    steps = []
    step = type(engine.engine).step

    def counted_step(self):
        outputs = step(self)
        steps.append(len(outputs))
        return outputs

    monkeypatch.setattr(type(engine.engine), "step", counted_step)
    wakeups = []

    async def main():
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            if threading.current_thread().name == "llmlab-engine-loop":
                wakeups.append(callback)
            return plain(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted
        params = _params(RequestOutputKind.DELTA)

        async def one(i):
            return [o async for o in engine.generate(f"Prompt {i}", params)]

        return await asyncio.gather(*(one(i) for i in range(8)))

    results = run(main())
    assert all(r[-1].finished for r in results)
    steps_with_outputs = sum(1 for n in steps if n)
    assert steps_with_outputs >= 24  # 8 requests x 24 tokens, batched
    assert len(wakeups) <= steps_with_outputs  # not one per request per step

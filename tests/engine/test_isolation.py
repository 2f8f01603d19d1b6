"""One request's own failure in execution fails that request only (issue 22).

A per-request logits processor that raises (or a grammar that breaks) sits in the same
sampler call as every other request of the step. The runner samples the rows again one by
one to find whose it was: that request ends with the reason, the others go on with
exactly the tokens they would have had; only a failure nothing per-request explains (the
sampler itself) still fails the step.
"""

from __future__ import annotations

import asyncio

import pytest

from llmlab import LLM, SamplingParams
from llmlab.entrypoints.async_engine import AsyncEngine
from llmlab.errors import ComponentError, RequestFailedError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def poisoned(after: int = 2):
    def processor(output_ids, logits):
        if len(output_ids) >= after:
            raise RuntimeError("poisoned processor")
        return logits

    return SamplingParams(max_tokens=6, temperature=0.0, logits_processors=[processor])


def test_a_raising_processor_fails_its_request_and_the_batch_goes_on(tiny_llama):
    prompts = [f"hello {i}" for i in range(6)]
    want = LLM(tiny_llama, dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
    engine = LLM(tiny_llama, dtype="float32").llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, poisoned() if i == 3 else GREEDY)
    failures, final = [], {}
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except RequestFailedError as err:
            failures.append(err)
            continue
        final.update({o.request_id: o for o in outputs if o.finished})
    assert [(e.request_id, "poisoned processor" in str(e)) for e in failures] == [("3", True)]
    final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final["3"].outputs[0].finish_reason == "abort"
    for i, ref in enumerate(want):
        if i != 3:
            assert final[str(i)].outputs[0].token_ids == ref.outputs[0].token_ids
    assert engine.kv_cache.usage == 0.0


def test_one_poisoned_request_among_40_concurrent_ones_under_the_async_engine(tiny_llama):
    prompts = [f"prompt number {i}" for i in range(40)]
    want = LLM(tiny_llama, dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")

    async def one(prompt, params, rid):
        outs = [o async for o in engine.generate(prompt, params, rid)]
        return outs[-1]

    async def main():
        jobs = [one(p, GREEDY, str(i)) for i, p in enumerate(prompts)]
        jobs.append(one("the poisoned one", poisoned(), "bad"))
        return await asyncio.gather(*jobs, return_exceptions=True)

    try:
        results = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        engine.shutdown()
    assert isinstance(results[-1], RequestFailedError) and "poisoned" in str(results[-1])
    for got, ref in zip(results[:-1], want, strict=True):
        assert not isinstance(got, BaseException), got
        assert got.finished and got.outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_sampler_that_fails_for_everyone_still_fails_the_step(tiny_llama):
    class Broken:
        def __call__(self, logits, metadata):
            raise RuntimeError("the sampler is broken")

    engine = LLM(tiny_llama, dtype="float32", sampler=Broken()).llm_engine
    engine.add_request("a", "hi", poisoned())  # even beside a request with its own code
    engine.add_request("b", "there", GREEDY)
    with pytest.raises(ComponentError, match="the sampler is broken"):
        while engine.has_unfinished_requests():
            engine.step()

"""A feature added as a plugin, without editing any engine file: a per-request "token
budget" that stops a request once its cumulative log-probability drops below a threshold
(the example in docs/components.md). Everything it needs is in this file."""

from __future__ import annotations

import attrs
import pytest

from llmlab import LLM, SamplingParams
from llmlab.plugin import SchedulerPlugin


@attrs.define
class TokenBudget(SchedulerPlugin):
    """Stop a request when its cumulative logprob falls below ``min_logprob`` (or the
    request's own ``extra_args["min_cumulative_logprob"]``)."""

    name = "token_budget"

    min_logprob: float = float("-inf")
    stopped: list[str] = attrs.field(factory=list)

    def commit(self, request, sent, returned):
        extra = request.sampling_params.extra_args or {}
        floor = extra.get("min_cumulative_logprob", self.min_logprob)
        if request.cumulative_logprob < floor:
            self.stopped.append(request.request_id)
            return "token_budget"
        return None


PROMPTS = ["Once upon a time", "The little dog", "A quiet morning in the", "She said"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)


def _run(tiny_llama, params=GREEDY, **kwargs):
    llm = LLM(tiny_llama, dtype="float32", seed=0, **kwargs)
    return llm.generate(PROMPTS, params, use_tqdm=False)


def _cumulative(completion):
    """The running sum of the chosen tokens' logprobs."""
    total, sums = 0.0, []
    for token, top in zip(completion.token_ids, completion.logprobs, strict=True):
        total += top[token].logprob
        sums.append(total)
    return sums


def test_a_budget_that_never_binds_changes_nothing(tiny_llama):
    plain = _run(tiny_llama)
    budget = TokenBudget()
    with_plugin = _run(tiny_llama, plugins=[budget])
    assert [o.outputs[0].token_ids for o in with_plugin] == [o.outputs[0].token_ids for o in plain]
    assert budget.stopped == []


def test_requests_stop_at_the_first_token_past_the_budget(tiny_llama):
    plain = _run(tiny_llama)
    sums = [_cumulative(o.outputs[0]) for o in plain]
    # A floor every request crosses somewhere in the middle of its output.
    floor = max(s[len(s) // 2] for s in sums)
    budget = TokenBudget(min_logprob=floor)
    outputs = _run(tiny_llama, plugins=[budget])
    for out, full, running in zip(outputs, plain, sums, strict=True):
        first_below = next(i for i, s in enumerate(running) if s < floor)
        completion = out.outputs[0]
        # The token that crossed the floor is kept, and nothing after it.
        assert completion.token_ids == full.outputs[0].token_ids[: first_below + 1]
        assert completion.finish_reason == "stop"
        assert completion.stop_reason == "token_budget"
    assert sorted(budget.stopped) == sorted(o.request_id for o in outputs)


def test_a_request_can_carry_its_own_budget(tiny_llama):
    plain = _run(tiny_llama)
    running = _cumulative(plain[0].outputs[0])
    own = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True,
                         extra_args={"min_cumulative_logprob": running[2]})
    llm = LLM(tiny_llama, dtype="float32", seed=0, plugins=[TokenBudget()])
    outputs = llm.generate(PROMPTS, [own, GREEDY, GREEDY, GREEDY], use_tqdm=False)
    first_below = next(i for i, s in enumerate(running) if s < running[2])
    assert outputs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids[: first_below + 1]
    assert [o.outputs[0].token_ids for o in outputs[1:]] == [
        o.outputs[0].token_ids for o in plain[1:]
    ]


def test_something_that_is_not_a_plugin_is_refused(tiny_llama):
    with pytest.raises(TypeError, match="must be a llmlab.plugin.SchedulerPlugin"):
        LLM(tiny_llama, plugins=[object()])


@attrs.define
class Broken(SchedulerPlugin):
    """A plugin whose commit raises on the third token of every request."""

    name = "broken"

    def commit(self, request, sent, returned):
        if len(request.output_token_ids) == 3:
            raise RuntimeError("boom")
        return None


def test_a_plugin_that_raises_is_reported_after_the_step_and_the_engine_stays_consistent(
        tiny_llama):
    from llmlab.errors import ComponentError

    plain = _run(tiny_llama)
    llm = LLM(tiny_llama, dtype="float32", seed=0, plugins=[Broken()])
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    raised, outputs = [], {}
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                outputs[out.request_id] = out
        except ComponentError as err:
            raised.append(err)
    assert raised and all("broken" in str(e).lower() and "commit" in str(e) for e in raised)
    # The hook answered "go on": every request ran to the end, token for token as without it.
    assert [outputs[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == [
        o.outputs[0].token_ids for o in plain
    ]
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    kv.check()

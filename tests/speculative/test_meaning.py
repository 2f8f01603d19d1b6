"""Speculation keeps every request feature's meaning: logprobs, parallel samples, stop
conditions inside an accepted run, structured outputs (not speculated), and the
synthetic proposer's rates."""

from __future__ import annotations

import pytest

from llmlab import LLM, SamplingParams

PROMPTS = ["the cat sat on the mat and the cat sat on the", "one two three one two three one"]


def _pair(model, config, params, **settings):
    plain = LLM(model, max_model_len=96, **settings).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model, max_model_len=96, speculative_config=config, **settings)
    events = []
    llm.llm_engine.subscribe(events.append)
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    assert sum(a for e in events for _, _, a in e.speculated) > 0, "nothing was accepted"
    return plain, spec


def _repeat_last():
    class RepeatLast:
        def propose(self, requests, k):
            return [[int(r.token_ids[-1])] * k for r in requests]

    return {"proposer": RepeatLast(), "num_speculative_tokens": 3, "speculation_length": "fixed"}


def test_logprobs_and_prompt_logprobs_are_unchanged(tiny_llama):
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    plain, spec = _pair(tiny_llama, _repeat_last(), params)
    for a, b in zip(plain, spec, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-4)
        for pa, pb in zip(ca.logprobs, cb.logprobs, strict=True):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert pa[t].logprob == pytest.approx(pb[t].logprob, abs=1e-4)
                assert pa[t].rank == pb[t].rank
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)


def test_parallel_samples_and_penalties(tiny_llama):
    params = SamplingParams(n=3, max_tokens=16, temperature=0.0, repetition_penalty=1.3,
                            frequency_penalty=0.4, ignore_eos=True)
    # The target as its own draft: right wherever the penalties do not change the argmax.
    config = {"model": tiny_llama, "num_speculative_tokens": 3, "speculation_length": "fixed"}
    plain, spec = _pair(tiny_llama, config, params)
    for a, b in zip(plain, spec, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_stop_conditions_inside_an_accepted_run(tiny_llama):
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    reference = LLM(tiny_llama, max_model_len=96).generate(PROMPTS, base, use_tqdm=False)
    # Stop on a token the output produces mid-way; a max_tokens that ends inside a run.
    stop_token = reference[0].outputs[0].token_ids[7]
    params = [SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_token],
                             ignore_eos=True),
              SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)]
    plain, spec = _pair(tiny_llama, _repeat_last(), params)
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        assert a.outputs[0].stop_reason == b.outputs[0].stop_reason
    assert len(spec[1].outputs[0].token_ids) == 13


def test_structured_outputs_are_not_speculated_and_unchanged(tiny_llama):
    pytest.importorskip("xgrammar")
    from llmlab.sampling.params import StructuredOutputsParams

    params = [SamplingParams(max_tokens=12, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(regex="(ab|cd)+")),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
    llm = LLM(tiny_llama, max_model_len=96, speculative_config=_repeat_last())
    events = []
    llm.llm_engine.subscribe(events.append)
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    plain = LLM(tiny_llama, max_model_len=96).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    assert all(rid != "0" for e in events for rid, _, _ in e.speculated)


def test_synthetic_acceptance_follows_the_given_rates(tiny_llama):
    rates = [0.8, 0.5, 0.25]
    llm = LLM(tiny_llama, max_model_len=96, speculative_config={
        "method": "synthetic", "synthetic_acceptance_rates": rates,
        "speculation_length": "fixed"})
    events = []
    llm.llm_engine.subscribe(events.append)
    llm.generate(["hello"] * 16, SamplingParams(max_tokens=60, ignore_eos=True),
                 use_tqdm=False)
    drafts = [(d, a) for e in events for _, d, a in e.speculated if d == 3]
    assert len(drafts) > 300
    for j, rate in enumerate(rates, 1):
        observed = sum(a >= j for _, a in drafts) / len(drafts)
        assert observed == pytest.approx(rate, abs=0.07)

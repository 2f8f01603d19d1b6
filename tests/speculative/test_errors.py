"""Hard edges: bad configs are refused at build time; a proposer that breaks its contract
fails the step with an error naming it, and no request loses anything."""

from __future__ import annotations

import pytest

from llmlab import LLM, SamplingParams
from llmlab.errors import ComponentError
from llmlab.speculative import SpeculativeConfig


class Flaky:
    """Drafts ``bad`` once (too long, or out of the vocabulary), then behaves."""

    def __init__(self, bad):
        self.bad = bad

    def propose(self, requests, k):
        if self.bad is not None:
            draft, self.bad = self.bad, None
            return [draft for _ in requests]
        return [[int(r.token_ids[-1])] * k for r in requests]


@pytest.mark.parametrize("bad, message", [
    ([5, 5, 5, 5, 5], "returned 5 tokens for request"),
    ([10**6], "outside the vocabulary"),
    ([-1], "outside the vocabulary"),
    (["x"], "not a sequence of token ids"),
])
def test_a_bad_draft_fails_the_step_naming_the_proposer_and_loses_nothing(
    tiny_llama, bad, message
):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["the cat sat on the mat", "hello world hello", "one two three"]
    expected = [o.outputs[0].token_ids
                for o in LLM(tiny_llama, max_model_len=64).generate(prompts, params,
                                                                   use_tqdm=False)]
    llm = LLM(tiny_llama, max_model_len=64, speculative_config={
        "proposer": Flaky(bad), "num_speculative_tokens": 3, "speculation_length": "fixed",
    })
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs = {}
    raised = None
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                outputs[out.request_id] = out
        except ComponentError as err:
            assert raised is None  # only the bad step fails
            raised = err
    assert raised is not None and "proposer Flaky" in str(raised) and message in str(raised)
    assert [outputs[str(i)].outputs[0].token_ids for i in range(3)] == expected
    engine.kv_cache.check()
    assert engine.kv_cache.usage == 0.0


@pytest.mark.parametrize("config, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "nope", "num_speculative_tokens": 2}, "unknown speculative_config method 'nope'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"},
     "unknown speculative_config key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "synthetic", "num_speculative_tokens": 2,
      "synthetic_acceptance_rates": [0.5, 0.9]}, "cannot increase"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculation_length": "greedy"},
     "speculation_length"),
    ({"method": "ngram", "num_speculative_tokens": 2,
      "num_speculative_tokens_per_batch_size": {0: 2}}, "batch sizes >= 1"),
    ("{not json", "not valid JSON"),
    (42, "speculative_config must be"),
])
def test_bad_configs_are_refused_when_built(tiny_llama, config, message):
    with pytest.raises(ValueError, match=None) as info:
        LLM(tiny_llama, max_model_len=64, speculative_config=config)
    assert message in str(info.value)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_llama, other_vocab_model):
    with pytest.raises(ValueError, match="vocabulary of 600 tokens but the target's has 512"):
        LLM(tiny_llama, max_model_len=64,
            speculative_config={"model": other_vocab_model, "num_speculative_tokens": 2})


def test_a_proposer_without_propose_is_refused(tiny_llama):
    class NotAProposer:
        def draft(self, requests, k):
            return []

    with pytest.raises((TypeError, ValueError), match="propose"):
        LLM(tiny_llama, max_model_len=64,
            speculative_config={"proposer": NotAProposer(), "num_speculative_tokens": 2})


def test_config_forms():
    a = SpeculativeConfig.of(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    )
    assert (a.method, a.num_speculative_tokens) == ("ngram", 4)
    assert dict(a.options) == {"prompt_lookup_max": 3}
    assert SpeculativeConfig.of({"model": "m", "num_speculative_tokens": 2}).method == "draft_model"
    p = SpeculativeConfig.of({"method": "synthetic", "synthetic_acceptance_rates": [0.8, 0.5]})
    assert p.num_speculative_tokens == 2
    assert SpeculativeConfig.of(None) is None


def test_abort_mid_speculation_leaves_the_others_exact(tiny_llama, spec_models):
    _, draft = spec_models("LlamaForCausalLM")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["the cat sat on the mat", "hello world hello", "one two three one two"]
    expected = [o.outputs[0].token_ids
                for o in LLM(tiny_llama, max_model_len=64).generate(prompts, params,
                                                                   use_tqdm=False)]
    llm = LLM(tiny_llama, max_model_len=64, speculative_config={
        "model": draft, "num_speculative_tokens": 3, "speculation_length": "fixed"})
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs = {}
    for _ in range(3):
        for out in engine.step():
            outputs[out.request_id] = out
    engine.abort_request("1")
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["0"].outputs[0].token_ids == expected[0]
    assert outputs["2"].outputs[0].token_ids == expected[2]
    engine.kv_cache.check()
    assert engine.kv_cache.usage == 0.0
    # A new request on the freed row starts its draft state afresh: still exact.
    again = llm.generate([prompts[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == expected[1]

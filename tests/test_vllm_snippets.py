"""vLLM users' everyday offline code, with ``vllm`` renamed to ``llmlab`` and a local model
path: each snippet below is written the way vLLM's documentation uses its API (the shapes
of the calls and of what they return), and must run unchanged otherwise."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


def test_batched_generation(model):
    from llmlab import LLM, SamplingParams

    prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=0)
    llm = LLM(model=model)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        assert isinstance(generated_text, str) and prompt in prompts
    assert [o.prompt for o in outputs] == prompts


def test_chat_with_a_conversation_and_several(model):
    from llmlab import LLM, SamplingParams

    llm = LLM(model=model)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    sampling_params = SamplingParams(temperature=0.5, max_tokens=6, seed=1)
    outputs = llm.chat(conversation, sampling_params=sampling_params, use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].outputs[0].text is not None
    outputs = llm.chat([conversation, conversation[:2]], sampling_params, use_tqdm=False)
    assert len(outputs) == 2


def test_logprobs_and_prompt_logprobs(model):
    from llmlab import LLM, SamplingParams

    llm = LLM(model=model)
    params = SamplingParams(max_tokens=4, logprobs=3, prompt_logprobs=2, temperature=0)
    out = llm.generate("Once upon a time", params)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token_id, top in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
        assert token_id in top and len(top) >= 3
        best = max(top.values(), key=lambda lp: lp.logprob)
        assert best.rank == 1 and top[token_id].logprob == best.logprob  # greedy
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(top[t].logprob for t, top in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)))


def test_prefix_caching_reuses_a_shared_prefix(model):
    from llmlab import LLM, SamplingParams

    prefix = "You are an expert school principal. " * 8
    prompts = [prefix + q for q in ("Who are you?", "What do you teach?")]
    sampling_params = SamplingParams(temperature=0.0, max_tokens=6)
    regular = LLM(model=model, enable_prefix_caching=False).generate(prompts, sampling_params)
    cached_llm = LLM(model=model, enable_prefix_caching=True)
    cached_llm.generate(prompts[0], sampling_params)  # warm up the cache
    cached = cached_llm.generate(prompts, sampling_params)
    assert [o.outputs[0].text for o in regular] == [o.outputs[0].text for o in cached]
    assert all(o.num_cached_tokens > 0 for o in cached)


def test_structured_outputs_choice_and_json(model):
    import json

    from llmlab import LLM, SamplingParams
    from llmlab.sampling_params import GuidedDecodingParams

    pytest.importorskip("xgrammar")
    llm = LLM(model=model)
    guided = GuidedDecodingParams(choice=["Positive", "Negative"])
    out = llm.generate("Classify this sentiment: llmlab is wonderful!",
                       SamplingParams(guided_decoding=guided, max_tokens=8))
    assert out[0].outputs[0].text in ("Positive", "Negative")
    # Bounded fields: random weights may never end an unbounded integer within max_tokens (the
    # H200 run of 2026-11-26 wrote 16 digits and hit the length limit mid-object).
    schema = {"type": "object", "properties": {"brand": {"type": "string", "maxLength": 5},
                                               "year": {"type": "string", "pattern": "^[0-9]{4}$"}},
              "required": ["brand", "year"]}
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json=schema), max_tokens=40)
    text = llm.generate("Generate a JSON with the brand and year of a car", params)[0]
    assert text.outputs[0].finish_reason == "stop"
    data = json.loads(text.outputs[0].text)
    assert set(data) == {"brand", "year"} and len(data["year"]) == 4


def test_beam_search(model):
    from llmlab import LLM
    from llmlab.sampling_params import BeamSearchParams

    llm = LLM(model=model)
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    outputs = llm.beam_search([{"prompt": "The quick brown fox"}], params)
    sequences = outputs[0].sequences
    assert len(sequences) == 3
    for seq in sequences:
        assert isinstance(seq.text, str) and seq.cum_logprob <= 0


def test_tokens_prompt_and_n_samples(model):
    from llmlab import LLM, SamplingParams
    from llmlab.inputs import TokensPrompt

    llm = LLM(model=model)
    prompt = TokensPrompt(prompt_token_ids=[11, 12, 13, 14])
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=3))
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert out[0].prompt_token_ids == [11, 12, 13, 14]

"""vLLM spellings that cost nothing: keywords, seed=None, priority, default sampling."""

from __future__ import annotations

import json
import shutil

import pytest

from llmlab import LLM, SamplingParams


def test_seed_none_and_harmless_vllm_keywords_are_accepted(tiny_llama, tmp_path):
    llm = LLM(
        tiny_llama,
        seed=None,
        trust_remote_code=True,
        tensor_parallel_size=1,
        enforce_eager=True,
        disable_log_stats=True,
        enable_chunked_prefill=True,
        max_logprobs=5,
        tokenizer_mode="auto",
        download_dir=str(tmp_path),
        swap_space=4,
        quantization=None,
        kv_cache_dtype="auto",
    )
    assert isinstance(llm.llm_engine.config.seed, int)  # drawn at random
    out = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pipeline_parallel_size=2), "pipeline_parallel_size=2 is not supported"),
        (dict(quantization="awq"), "quantization='awq' names a checkpoint format.*"
         "quant_method=None"),  # an AWQ checkpoint loads; a float one cannot be AWQ
        (dict(quantization="bitsandbytes"), "quantization must be one of 'int8', 'fp8'"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
        (dict(tokenizer_mode="mistral"), "tokenizer_mode"),
    ],
)
def test_what_llmlab_cannot_do_is_refused_clearly(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llama, **kwargs)


def test_slow_tokenizer_mode_and_no_chunked_prefill_still_generate(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    base = LLM(tiny_llama, dtype="float32").generate(prompt, params, use_tqdm=False)
    llm = LLM(tiny_llama, dtype="float32", max_model_len=64, max_num_batched_tokens=64,
              enable_chunked_prefill=False)
    events = []
    llm.llm_engine.subscribe(events.append)
    got = llm.generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == base[0].outputs[0].token_ids
    assert events[0].scheduled == (("0", 37),)  # the whole prompt in one step
    with pytest.raises(ValueError, match="enable_chunked_prefill=False"):
        LLM(tiny_llama, max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False)


def test_priority_is_accepted_per_prompt(tiny_llama):
    seen = []

    class Recorder:
        name = "recorder"

        def order(self, waiting, now):
            seen.extend(r.priority for r in waiting)
            return waiting

        def victim(self, candidates):
            return candidates[-1]

    llm = LLM(tiny_llama, dtype="float32", scheduling_policy=Recorder())
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[3, -1], use_tqdm=False)
    assert len(outs) == 2 and seen[:2] == [3, -1]
    with pytest.raises(ValueError, match="got 1 values for priority but 2 prompts"):
        llm.generate(["a", "b"], priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match=r"priority\[0\] must be an int, got float 1.5"):
        llm.generate(["a"], priority=[1.5], use_tqdm=False)


def test_no_sampling_params_means_the_models_generation_config(tiny_llama, tmp_path):
    model = tmp_path / "with-defaults"
    shutil.copytree(tiny_llama, model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=5)
    (model / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(model))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (
        0.6, 0.9, 20, 5)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) <= 5
    # Without those keys: vLLM's own defaults.
    plain = LLM(tiny_llama).get_default_sampling_params()
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (1.0, 1.0, 0, 16)

"""vLLM's public surface: mutable SamplingParams, RequestMetrics, LLM extras, module paths,
EngineArgs and the ``serve`` flags."""

from __future__ import annotations

import attrs
import pytest

from llmlab import LLM, SamplingParams

# -- 1. SamplingParams is mutable, checked on every assignment ----------------------------


def test_assignment_is_converted_and_checked_like_construction():
    params = SamplingParams(max_tokens=5)
    params.seed = 100
    assert params.seed == 100
    params.temperature = 0
    assert params.greedy
    with pytest.raises(TypeError, match="top_p"):
        params.top_p = "high"
    assert params.top_p == 1.0  # the old value stays
    with pytest.raises(ValueError, match="top_k"):
        params.top_k = -5
    assert params.top_k == 0
    # Cross-field checks run too: min_tokens <= max_tokens, best_of >= n.
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        params.min_tokens = 6
    assert params.min_tokens == 0
    params.n = 3
    with pytest.raises(ValueError, match="best_of must be >= n"):
        params.best_of = 2
    assert params.best_of is None


def test_list_fields_are_lists():
    params = SamplingParams(stop=["###"], stop_token_ids=(3, 4), bad_words=["bad"],
                            allowed_token_ids=[5, 6])
    assert params.stop == ["###"] and params.stop_token_ids == [3, 4]
    assert params.bad_words == ["bad"] and params.allowed_token_ids == [5, 6]
    params.stop.append("END")
    params.stop_token_ids.append(9)
    assert params.stop == ["###", "END"] and params.stop_token_ids == [3, 4, 9]
    params.stop = "one"
    assert params.stop == ["one"]
    with pytest.raises(ValueError, match=r"stop\[0\] is an empty string"):
        params.stop = [""]
    assert params.stop == ["one"]


def test_logit_bias_is_a_dict_checked_on_every_change():
    import pickle

    params = SamplingParams(logit_bias={5: 1.0, "6": -2})
    assert isinstance(params.logit_bias, dict) and params.logit_bias == {5: 1.0, 6: -2.0}
    params.logit_bias[7] = 3  # vLLM code adds to it in place
    params.logit_bias["8"] = 0.5
    params.logit_bias.update({9: 1})
    assert params.logit_bias == {5: 1.0, 6: -2.0, 7: 3.0, 8: 0.5, 9: 1.0}
    with pytest.raises(ValueError, match=r"logit_bias\[10\]"):
        params.logit_bias[10] = 500
    with pytest.raises(ValueError, match="logit_bias key"):
        params.logit_bias.update({11: 1, -1: 2})
    assert 10 not in params.logit_bias and 11 not in params.logit_bias  # nothing changed
    assert pickle.loads(pickle.dumps(params)).logit_bias == params.logit_bias
    # The engine's snapshot is read-only and does not follow later changes.
    snap = params.snapshot()
    params.logit_bias[12] = 1
    assert 12 not in snap.logit_bias
    with pytest.raises(TypeError, match="read-only"):
        snap.logit_bias[13] = 1


def test_a_logit_bias_added_in_place_reaches_the_sampler(llm):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={})
    params.logit_bias[42] = 100
    out = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [42] * 4


def test_use_beam_search_points_to_llm_beam_search():
    with pytest.raises(ValueError, match="LLM.beam_search"):
        SamplingParams(use_beam_search=True)
    assert SamplingParams(use_beam_search=False) == SamplingParams()
    with pytest.raises(TypeError, match="unexpected keyword argument.*'nonsense'"):
        SamplingParams(nonsense=1)


def test_evolve_and_clone_still_work_and_copy_lists():
    params = SamplingParams(stop=["x"], seed=1)
    evolved = attrs.evolve(params, seed=2)
    clone = params.clone()
    assert evolved.seed == 2 and clone == params
    params.stop.append("y")
    assert evolved.stop == ["x"] and clone.stop == ["x"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, enable_prefix_caching=True)


def test_mutating_submitted_params_does_not_reach_the_engine(llm):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    engine.add_request("mut", "Hello there", params)
    params.max_tokens = 1
    params.stop_token_ids.extend(range(200))  # every token would stop it
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert len(outputs["mut"].outputs[0].token_ids) == 6


# -- 2. RequestOutput.metrics ------------------------------------------------------------


def test_request_output_metrics_follow_the_engine_clock(llm):
    engine = llm.llm_engine
    engine.add_request("m", "Hello", SamplingParams(max_tokens=3, ignore_eos=True),
                       arrival_time=engine.clock())
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    first, final = seen[0].metrics, seen[-1].metrics
    assert first.arrival_time <= first.first_scheduled_time <= first.first_token_time
    assert first.time_in_queue == pytest.approx(first.first_scheduled_time - first.arrival_time)
    assert first.finished_time is None
    assert final.finished_time is not None and final.last_token_time <= final.finished_time
    assert final.first_token_time == first.first_token_time
    assert final.last_token_time >= first.last_token_time


def test_metrics_are_none_before_scheduling_and_in_generate(llm):
    from llmlab.engine.outputs import RequestMetrics

    metrics = RequestMetrics(arrival_time=1.0)
    assert (metrics.first_scheduled_time, metrics.first_token_time, metrics.time_in_queue,
            metrics.finished_time, metrics.last_token_time) == (None,) * 5
    out = llm.generate("Hi", SamplingParams(max_tokens=2, n=2, seed=0), use_tqdm=False)[0]
    assert out.metrics.finished_time >= out.metrics.first_token_time > 0


# -- 3. LLM: scalar priority, reset_prefix_cache, set_tokenizer, profiling ---------------


def test_scalar_priority_applies_to_every_prompt(tiny_llama):
    seen = []

    class Recorder:
        name = "recorder"

        def order(self, waiting, now):
            seen.extend(r.priority for r in waiting)
            return waiting

        def victim(self, candidates):
            return candidates[-1]

    llm = LLM(tiny_llama, scheduling_policy=Recorder())
    params = SamplingParams(max_tokens=2)
    assert len(llm.generate("a", params, priority=1, use_tqdm=False)) == 1
    assert seen[:1] == [1]
    seen.clear()
    llm.generate(["a", "b"], params, priority=-2, user="ann", use_tqdm=False)
    assert seen[:2] == [-2, -2]
    with pytest.raises(ValueError, match="priority"):
        llm.generate("a", params, priority=1.5, use_tqdm=False)


def test_reset_prefix_cache_frees_cached_blocks(llm):
    kv = llm.llm_engine.scheduler.kv
    prompt = {"prompt_token_ids": list(range(1, 40))}
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert kv.pool.num_cached_free_blocks > 0 and len(kv.index) > 0
    free_before = kv.num_free_blocks
    assert llm.reset_prefix_cache() is True
    assert kv.pool.num_cached_free_blocks == 0 and len(kv.index) == 0
    assert kv.num_free_blocks == free_before
    kv.check()
    out = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # nothing left to hit
    assert llm.reset_prefix_cache() is True


def test_set_tokenizer_is_used_for_new_requests(llm):
    original = llm.get_tokenizer()
    calls = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def encode(self, text, **kwargs):
            calls.append(text)
            return self.inner.encode(text, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    try:
        llm.set_tokenizer(Counting(original))
        assert isinstance(llm.get_tokenizer(), Counting)
        llm.generate("Hello", SamplingParams(max_tokens=1), use_tqdm=False)
        assert calls == ["Hello"]
    finally:
        llm.set_tokenizer(original)
    with pytest.raises(TypeError, match="tokenizer"):
        llm.set_tokenizer(None)


def test_profile_needs_a_directory_and_writes_a_trace(llm, tmp_path, monkeypatch):
    monkeypatch.delenv("LLMLAB_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="LLMLAB_TORCH_PROFILER_DIR"):
        llm.start_profile()
    with pytest.raises(RuntimeError, match="no profile is running"):
        llm.stop_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "trace"))
    llm.start_profile()
    try:
        llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        llm.stop_profile()
    assert list((tmp_path / "trace").iterdir())


# -- 4. vLLM module paths, EngineArgs, from_engine_args, int request ids ------------------


def test_vllm_module_paths():
    import llmlab
    from llmlab.inputs import TextPrompt, TokensPrompt
    from llmlab.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from llmlab.sampling_params import (
        BeamSearchParams,
        GuidedDecodingParams,
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )

    assert SamplingParams is llmlab.SamplingParams and RequestOutput is llmlab.RequestOutput
    assert RequestOutputKind.DELTA and BeamSearchParams and CompletionOutput and RequestMetrics
    assert issubclass(GuidedDecodingParams, StructuredOutputsParams)
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}
    assert TextPrompt(prompt="hi") == {"prompt": "hi"}


def test_typed_dict_prompts_are_accepted_by_generate(llm):
    from llmlab.inputs import TextPrompt, TokensPrompt

    params = SamplingParams(max_tokens=2, temperature=0)
    a, b = llm.generate([TextPrompt(prompt="Hello"), TokensPrompt(prompt_token_ids=[5, 6, 7])],
                        params, use_tqdm=False)
    assert a.prompt == "Hello" and b.prompt_token_ids == [5, 6, 7]


def test_engine_args_mirror_the_config(tiny_llama):
    from llmlab import EngineConfig
    from llmlab.entrypoints.arg_utils import AsyncEngineArgs, EngineArgs

    args = EngineArgs(model=tiny_llama, max_num_seqs=4, block_size=8)
    assert set(vars(args)) == {f.name for f in attrs.fields(EngineConfig)}
    config = args.create_engine_config()
    assert isinstance(config, EngineConfig) and config.max_num_seqs == 4
    assert AsyncEngineArgs(model=tiny_llama).disable_log_requests is False
    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(model=tiny_llama, block_size=0).create_engine_config()
    out = LLM(**vars(args)).generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    # AsyncEngineArgs' extra field is accepted too (it changes nothing offline).
    async_args = AsyncEngineArgs(model=tiny_llama, max_num_seqs=4, disable_log_requests=True)
    out = LLM(**vars(async_args)).generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_vllms_offline_llm_engine_example_runs(tiny_llama):
    # vLLM's examples/offline_inference/llm_engine_example.py with the import renamed.
    from llmlab import EngineArgs, LLMEngine, RequestOutput, SamplingParams

    def create_test_prompts():
        return [
            ("A robot may not injure a human being",
             SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1)),
            ("To be or not to be,",
             SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
            ("What is the meaning of life?",
             SamplingParams(n=2, best_of=5, temperature=0.8, top_p=0.95, frequency_penalty=0.1)),
        ]

    def process_requests(engine, test_prompts):
        request_id = 0
        finished = []
        while test_prompts or engine.has_unfinished_requests():
            if test_prompts:
                prompt, sampling_params = test_prompts.pop(0)
                engine.add_request(str(request_id), prompt, sampling_params)
                request_id += 1
            request_outputs: list[RequestOutput] = engine.step()
            for request_output in request_outputs:
                if request_output.finished:
                    finished.append(request_output)
        return finished

    engine_args = EngineArgs(model=tiny_llama)
    engine = LLMEngine.from_engine_args(engine_args)
    finished = process_requests(engine, create_test_prompts())
    assert sorted(o.request_id for o in finished) == ["0", "1", "2"]
    assert len(next(o for o in finished if o.request_id == "2").outputs) == 2


def test_async_engine_from_engine_args_and_int_request_id(tiny_llama):
    import asyncio

    from llmlab import AsyncEngine, AsyncEngineArgs, AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama))
    assert isinstance(engine, AsyncEngine)

    async def run():
        last = None
        async for out in engine.generate("Hello", SamplingParams(max_tokens=2), request_id=0):
            last = out
        return last

    try:
        last = asyncio.run(run())
    finally:
        engine.shutdown()
    assert last.request_id == "0" and last.finished


# -- 5. llmlab serve: vLLM's flags, generated from EngineConfig; --config FILE.yaml -------


def _serve_settings(argv, monkeypatch):
    """What ``llmlab serve ARGV`` would build: (engine settings, build_app keywords)."""
    import llmlab.entrypoints.server.app
    from llmlab.entrypoints import cli
    from llmlab.entrypoints.async_engine import AsyncEngine

    seen = {}

    class Stop(Exception):
        pass

    def fake_engine(model, **settings):
        seen["model"], seen["settings"] = model, settings
        return object()

    def fake_app(engine, **kwargs):
        seen["app"] = kwargs
        raise Stop

    monkeypatch.setattr(AsyncEngine, "from_settings", staticmethod(fake_engine))
    monkeypatch.setattr(llmlab.entrypoints.server.app, "build_app", fake_app)
    with pytest.raises(Stop):
        cli.main(["serve", *argv])
    return seen


def test_serve_accepts_vllms_engine_flags(tiny_llama, monkeypatch):
    seen = _serve_settings([
        tiny_llama, "--enforce-eager", "--trust-remote-code", "--max-logprobs", "7",
        "--no-enable-chunked-prefill", "--num-gpu-blocks-override", "64",
        "--disable-log-requests", "--uvicorn-log-level", "warning", "--max-num-seqs", "3",
        "--swap-space", "2", "--kv-cache-dtype", "auto",
    ], monkeypatch)
    settings = seen["settings"]
    assert seen["model"] == tiny_llama
    assert settings["enforce_eager"] is True and settings["trust_remote_code"] is True
    assert settings["max_logprobs"] == 7 and settings["enable_chunked_prefill"] is False
    assert settings["num_gpu_blocks_override"] == 64 and settings["max_num_seqs"] == 3
    assert settings["swap_space"] == 2.0
    # Every EngineConfig field but the model is a flag; the defaults are the config's.
    from llmlab.config import EngineConfig

    assert {f.name for f in attrs.fields(EngineConfig)} - {"model"} <= set(settings)
    defaults = _serve_settings([tiny_llama], monkeypatch)["settings"]
    for field in attrs.fields(EngineConfig):
        if field.name != "model":
            assert defaults[field.name] == field.default, field.name
    app = seen["app"]
    assert app["return_tokens_as_token_ids"] is False and app["response_role"] == "assistant"


def test_serve_passes_the_server_flags(tiny_llama, monkeypatch):
    app = _serve_settings([
        tiny_llama, "--return-tokens-as-token-ids", "--enable-tokenizer-info-endpoint",
        "--response-role", "bot", "--root-path", "/llm",
    ], monkeypatch)["app"]
    assert app["return_tokens_as_token_ids"] is True
    assert app["enable_tokenizer_info_endpoint"] is True
    assert app["response_role"] == "bot" and app["root_path"] == "/llm"


def test_serve_config_file_with_command_line_winning(tiny_llama, tmp_path, monkeypatch):
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {tiny_llama}\nmax-num-seqs: 5\nmax_logprobs: 3\nenforce-eager: true\n"
        "served-model-name: tiny\nport: 9001\n"
    )
    seen = _serve_settings(["--config", str(config), "--max-num-seqs", "9"], monkeypatch)
    settings = seen["settings"]
    assert seen["model"] == tiny_llama
    assert settings["max_num_seqs"] == 9 and settings["max_logprobs"] == 3
    assert settings["enforce_eager"] is True
    assert seen["app"]["served_model_names"] == ["tiny"]


def test_serve_config_file_errors_are_one_line(tmp_path, capsys):
    from llmlab.entrypoints import cli

    bad = tmp_path / "bad.yaml"
    bad.write_text("max-num-seqz: 5\n")
    assert cli.main(["serve", "--config", str(bad)]) == 2
    assert "unknown flag 'max-num-seqz'" in capsys.readouterr().err
    bad.write_text("- a list\n")
    assert cli.main(["serve", "--config", str(bad)]) == 2
    assert "mapping" in capsys.readouterr().err

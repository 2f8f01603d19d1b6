"""Pooling models (runner="pooling"): embeddings, classification and scores equal Hugging
Face's on the same weights; chunked prefill, the prefix cache and preemption give the same
output; blocks are freed when a request ends; bad input is refused before anything is
allocated; poolers are components."""

from __future__ import annotations

import asyncio
import json
import pickle
import shutil

import attrs
import pytest
import torch
import torch.nn.functional as F

from llmlab import (
    LLM,
    AsyncEngine,
    EmbeddingRequestOutput,
    PoolerConfig,
    PoolingParams,
    PoolingRequestOutput,
    SamplingParams,
    register,
)
from llmlab.errors import ComponentError
from llmlab.runner.pooling_rows import PoolingSchedule, pools_now
from llmlab.scheduler.batch import BatchOutput, ScheduledBatch, ScheduledRequest
from llmlab.validation import FrozenDict
from llmlab.testing import build_tiny_model

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "Once upon a time there was a little cat who liked to play in the garden",
    "The dog ran fast.",
    "Tom and Lily went to the park to see the big tree and the birds that lived in it",
]
# Long enough to be prefilled over several 16-token steps.
LONG = " ".join(PROMPTS * 2)

_LLMS: dict = {}


def _llm(path: str, **settings) -> LLM:
    """One LLM per (model, settings) for the module (each costs a model load)."""
    key = (path, tuple(sorted((k, json.dumps(v, default=str)) for k, v in settings.items())))
    if key not in _LLMS:
        settings.setdefault("dtype", "float32")
        settings.setdefault("runner", "pooling")
        settings.setdefault("max_num_seqs", 8)  # a small KV cache each
        _LLMS[key] = LLM(path, **settings)
    return _LLMS[key]


@pytest.fixture(scope="module", autouse=True)
def _release_llms():
    yield
    _LLMS.clear()


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory):
    """Tiny ``*ForSequenceClassification`` checkpoints: 3 labels, and a cross-encoder."""
    built = {}
    for arch, labels in [
        ("LlamaForSequenceClassification", 3),
        ("Qwen2ForSequenceClassification", 3),
        ("Qwen3ForSequenceClassification", 3),
        ("LlamaForSequenceClassification", 1),
    ]:
        path = tmp_path_factory.mktemp(f"{arch}-{labels}")
        built[arch, labels] = str(build_tiny_model(path, arch, seed=1, num_labels=labels))
    return built


@pytest.fixture(scope="module")
def hf_base():
    cache = {}

    def load(path):
        if path not in cache:
            cache[path] = transformers.AutoModel.from_pretrained(path).float().eval()
        return cache[path]

    return load


def _hidden_states(model, token_ids):
    with torch.no_grad():
        return model(torch.tensor([token_ids])).last_hidden_state[0]


def _pool_by_hand(hidden, pooling_type, normalize, dimensions=None):
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling_type]
    if dimensions is not None:
        vector = vector[:dimensions]
    return F.normalize(vector, dim=-1) if normalize else vector


# -- parity with Hugging Face ----------------------------------------------------------------


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_embeddings_equal_hf_hidden_states_pooled_by_hand(
    arch, pooling_type, tiny_model_factory, hf_base
):
    path = tiny_model_factory(arch)
    llm = _llm(path, pooler_config={"pooling_type": pooling_type})
    hf = hf_base(path)
    for normalize in (True, False):
        outs = llm.embed(PROMPTS, PoolingParams(normalize=normalize), use_tqdm=False)
        for out in outs:
            assert isinstance(out, EmbeddingRequestOutput) and out.finished
            want = _pool_by_hand(
                _hidden_states(hf, out.prompt_token_ids), pooling_type, normalize
            )
            got = torch.tensor(out.outputs.embedding)
            assert out.outputs.hidden_size == want.numel()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            if normalize:
                assert abs(got.norm().item() - 1) < 1e-5


def test_default_embedding_is_the_last_token_normalized(tiny_model_factory, hf_base):
    path = tiny_model_factory("LlamaForCausalLM")
    out = _llm(path).embed(PROMPTS[0], use_tqdm=False)[0]
    want = _pool_by_hand(_hidden_states(hf_base(path), out.prompt_token_ids), "last", True)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=1e-5)


def test_cls_pooling_and_matryoshka_dimensions(tiny_model_factory, hf_base):
    path = tiny_model_factory("LlamaForCausalLM")
    llm = _llm(path, pooler_config=PoolerConfig(pooling_type="CLS"))  # vLLM's spelling
    out = llm.embed(PROMPTS[1], PoolingParams(dimensions=16), use_tqdm=False)[0]
    # Truncated first, then normalized (vLLM's order).
    want = _pool_by_hand(_hidden_states(hf_base(path), out.prompt_token_ids), "cls", True, 16)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "arch", ["LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
             "Qwen3ForSequenceClassification"],
)
def test_classification_equals_hf_sequence_classification(arch, classifiers):
    path = classifiers[arch, 3]
    llm = _llm(path, runner="auto")  # auto: a *ForSequenceClassification pools
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).float().eval()
    logits_out = llm.classify(PROMPTS, PoolingParams(use_activation=False), use_tqdm=False)
    probs_out = llm.classify(PROMPTS, use_tqdm=False)
    for logits, probs in zip(logits_out, probs_out, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([logits.prompt_token_ids])).logits[0]
        assert logits.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(logits.outputs.probs), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            torch.tensor(probs.outputs.probs), want.softmax(-1), atol=1e-5, rtol=1e-5
        )


def test_cross_encoder_score_is_the_sigmoid_of_the_pair_encodings_logit(classifiers):
    path = classifiers["LlamaForSequenceClassification", 1]
    llm = _llm(path, task="score")  # vLLM's older spelling of runner="pooling"
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).float().eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    query = "Where does the cat play?"
    outs = llm.score(query, PROMPTS, use_tqdm=False)
    raw = llm.score([query] * 3, PROMPTS, PoolingParams(use_activation=False), use_tqdm=False)
    for doc, out, logit in zip(PROMPTS, outs, raw, strict=True):
        with torch.no_grad():
            want = hf(**tokenizer(query, doc, return_tensors="pt")).logits[0, 0]
        assert out.prompt_token_ids == tokenizer(query, text_pair=doc)["input_ids"]
        assert abs(out.outputs.score - torch.sigmoid(want).item()) < 1e-5
        assert abs(logit.outputs.score - want.item()) < 1e-5


def test_embedding_model_score_is_cosine_similarity(tiny_model_factory):
    llm = _llm(tiny_model_factory("LlamaForCausalLM"))
    outs = llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)
    embeddings = [torch.tensor(o.outputs.embedding) for o in llm.embed(PROMPTS, use_tqdm=False)]
    for out, other in zip(outs, embeddings[1:], strict=True):
        want = F.cosine_similarity(embeddings[0], other, dim=0).item()
        assert abs(out.outputs.score - want) < 1e-5


def test_encode_returns_pooling_outputs_with_a_tensor(tiny_model_factory, classifiers):
    embedder = _llm(tiny_model_factory("LlamaForCausalLM"))
    out = embedder.encode(PROMPTS[0], use_tqdm=False)[0]
    assert isinstance(out, PoolingRequestOutput) and isinstance(out.outputs.data, torch.Tensor)
    assert out.outputs.data.dtype == torch.float32 and out.outputs.data.shape == (64,)
    embedding = embedder.embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding
    assert out.outputs.data.tolist() == embedding
    classifier = _llm(classifiers["Qwen2ForSequenceClassification", 3], runner="auto")
    assert classifier.encode(PROMPTS[0], use_tqdm=False)[0].outputs.data.shape == (3,)


def test_sentence_transformers_config_sets_the_default_pooler(tiny_model_factory, hf_base,
                                                              tmp_path):
    source = tiny_model_factory("Qwen3ForCausalLM")
    path = tmp_path / "st"
    shutil.copytree(source, path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
    ]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}
    ))
    llm = LLM(str(path), dtype="float32", runner="pooling")
    assert llm.llm_engine.pooling.pooling_type == "mean"
    out = llm.embed(PROMPTS[0], use_tqdm=False)[0]
    # Mean pooling, and no Normalize module: not normalized.
    want = _pool_by_hand(_hidden_states(hf_base(source), out.prompt_token_ids), "mean", False)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=1e-5)


def test_truncate_prompt_tokens_keeps_the_prompts_end(tiny_model_factory, hf_base):
    path = tiny_model_factory("LlamaForCausalLM")
    llm = _llm(path)
    full = llm.embed(PROMPTS[0], use_tqdm=False)[0].prompt_token_ids
    out = llm.embed(PROMPTS[0], truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert out.prompt_token_ids == full[-5:]
    want = _pool_by_hand(_hidden_states(hf_base(path), full[-5:]), "last", True)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=1e-5)


def test_runner_auto_and_vllm_task_spellings(tiny_model_factory):
    from llmlab.config import EngineConfig

    assert EngineConfig(model="m").runner_type == "generate"
    assert EngineConfig(model="m", task="embed").runner_type == "pooling"
    assert EngineConfig(model="m", task="reward", runner="auto").runner_type == "pooling"
    with pytest.raises(ValueError, match="contradict"):
        EngineConfig(model="m", task="generate", runner="pooling")
    with pytest.raises(ValueError, match="one setting"):
        EngineConfig(model="m", pooler_config={}, override_pooler_config={})
    with pytest.raises(ValueError, match="task must be one of"):
        EngineConfig(model="m", task="rerank")
    # auto on a causal LM generates
    llm = _llm(tiny_model_factory("LlamaForCausalLM"), runner="auto")
    assert llm.llm_engine.pooling is None
    assert llm.generate(PROMPTS[1], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


# -- the engine's mechanisms -----------------------------------------------------------------


def _run(engine, prompt, params, request_id="r"):
    engine.add_request(request_id, prompt, params)
    steps, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        steps += 1
    (out,) = [o for o in outputs if o.request_id == request_id]
    return out, steps


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_chunked_prefill_gives_the_same_embedding_and_frees_every_block(
    pooling_type, tiny_model_factory
):
    path = tiny_model_factory("LlamaForCausalLM")
    whole = _llm(path, pooler_config={"pooling_type": pooling_type})
    chunked = _llm(path, pooler_config={"pooling_type": pooling_type},
                   max_num_batched_tokens=16, max_model_len=256)
    want = whole.embed(LONG, use_tqdm=False)[0].outputs.embedding
    engine = chunked.llm_engine
    out, steps = _run(engine, LONG, PoolingParams(task="embed"))
    assert steps >= len(out.prompt_token_ids) // 16
    torch.testing.assert_close(torch.tensor(out.outputs.data.tolist()), torch.tensor(want),
                               atol=1e-5, rtol=1e-5)
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    kv.check()


def test_blocks_are_freed_in_the_step_that_pools(tiny_model_factory):
    engine = _llm(tiny_model_factory("LlamaForCausalLM"), enable_prefix_caching=False).llm_engine
    kv = engine.kv_cache
    engine.add_request("a", PROMPTS[0], PoolingParams())
    engine.add_request("b", PROMPTS[2], PoolingParams())
    outputs = engine.step()  # both prompts fit one step
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    assert all(o.finished for o in outputs)
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    kv.check()


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_prefix_cache_hits_give_the_same_output(pooling_type, tiny_model_factory):
    """Last-token pooling takes the hit (its last position is always computed); mean
    pooling reads every position, so it takes none."""
    path = tiny_model_factory("Qwen3ForCausalLM")
    config = {"pooling_type": pooling_type}
    off = _llm(path, pooler_config=config, enable_prefix_caching=False)
    on = _llm(path, pooler_config=config, enable_prefix_caching=True)
    want = off.embed(LONG, use_tqdm=False)[0].outputs.embedding
    on.reset_prefix_cache()
    first = on.embed(LONG, use_tqdm=False)[0]
    second = on.embed(LONG, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    if pooling_type == "last":
        assert second.num_cached_tokens > 0
    else:
        assert second.num_cached_tokens == 0
    for out in (first, second):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), torch.tensor(want),
                                   atol=1e-5, rtol=1e-5)


def test_pooling_survives_preemption(tiny_model_factory):
    """A request preempted in the middle of its prefill (an urgent one needs its blocks)
    drops what its row collected and is recomputed: its embedding is still the one
    computed alone."""
    path = tiny_model_factory("LlamaForCausalLM")
    config = {"pooling_type": "mean"}
    prompts = [" ".join(PROMPTS[1:] * 3), " ".join(PROMPTS)]  # 168 and 92 tokens
    want = [o.outputs.embedding
            for o in _llm(path, pooler_config=config).embed(prompts, use_tqdm=False)]
    small = _llm(path, pooler_config=config, scheduling_policy="priority",
                 num_gpu_blocks_override=12, block_size=16, max_num_batched_tokens=128,
                 max_model_len=192)
    engine = small.llm_engine
    preempted, outputs = [], []
    engine.subscribe(lambda event: preempted.extend(event.preempted))
    engine.add_request("slow", prompts[0], PoolingParams(), priority=1)
    outputs += engine.step()  # 128 of its 168 tokens
    engine.add_request("urgent", prompts[1], PoolingParams(), priority=0)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert preempted == ["slow"]
    got = {o.request_id: o.outputs.data for o in outputs}
    for request_id, expected in zip(["slow", "urgent"], want, strict=True):
        torch.testing.assert_close(got[request_id], torch.tensor(expected), atol=1e-5,
                                   rtol=1e-5)
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    kv.check()


def test_async_engine_encode_streams_the_pooled_output(tiny_model_factory):
    path = tiny_model_factory("LlamaForCausalLM")
    want = _llm(path).embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding
    engine = AsyncEngine.from_settings(path, dtype="float32", runner="pooling")

    async def main():
        return [out async for out in engine.encode(PROMPTS[0], PoolingParams(), "x")]

    try:
        (out,) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert out.finished and out.request_id == "x"
    torch.testing.assert_close(out.outputs.data, torch.tensor(want), atol=1e-6, rtol=1e-6)


# -- hard edges ------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    ({"dimensions": 0}, "dimensions"),
    ({"dimensions": "8"}, "dimensions"),
    ({"normalize": 1}, "normalize"),
    ({"use_activation": "yes"}, "use_activation"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"task": "generate"}, "task"),
    ({"softmax": True, "use_activation": False}, "use_activation"),
])
def test_bad_pooling_params_are_refused_naming_the_field(kwargs, field):
    with pytest.raises((TypeError, ValueError), match=field):
        PoolingParams(**kwargs)
    params = PoolingParams()
    name, value = next(iter(kwargs.items()))
    if name not in ("softmax",):
        with pytest.raises((TypeError, ValueError), match=name):
            setattr(params, name, value)  # assignment is checked too


@pytest.mark.parametrize("params, match", [
    (PoolingParams(dimensions=65), "dimensions must be at most the model's hidden size 64"),
    (PoolingParams(task="classify"), "task='classify' is not supported"),
    (PoolingParams(task="score"), "task='score' is not supported"),
    (SamplingParams(max_tokens=4), "runner='pooling'"),
])
def test_requests_the_model_cannot_run_are_refused_with_nothing_allocated(
    params, match, tiny_model_factory
):
    engine = _llm(tiny_model_factory("LlamaForCausalLM")).llm_engine
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", PROMPTS[0], params)
    assert not engine.has_unfinished_requests() and not engine.has_request("bad")
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_generate_and_pool_are_refused_on_the_other_runner(tiny_model_factory, classifiers):
    path = tiny_model_factory("LlamaForCausalLM")
    with pytest.raises(ValueError, match="LLM.generate needs a generating model"):
        _llm(path).generate(PROMPTS[0], use_tqdm=False)
    generator = LLM(path, dtype="float32")
    for method in (generator.embed, generator.classify, generator.encode):
        with pytest.raises(ValueError, match="needs a pooling model"):
            method(PROMPTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="needs a pooling model"):
        generator.score("a", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="runner='pooling'"):
        generator.llm_engine.add_request("x", PROMPTS[0], PoolingParams())
    with pytest.raises(ValueError, match="cannot generate; build it with runner='pooling'"):
        LLM(classifiers["LlamaForSequenceClassification", 3], dtype="float32")
    with pytest.raises(ValueError, match="task='classify' needs a classifier head"):
        LLM(path, dtype="float32", task="classify")
    with pytest.raises(ValueError, match="task='score' needs a cross-encoder"):
        LLM(classifiers["LlamaForSequenceClassification", 3], dtype="float32", task="score")
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(path, runner="embed")
    with pytest.raises(ValueError, match="pooling_type.*unknown pooler 'max2'"):
        LLM(path, runner="pooling", pooler_config={"pooling_type": "max2"})
    with pytest.raises(ValueError, match="unknown key"):
        LLM(path, runner="pooling", pooler_config={"pool": "mean"})


def test_classify_on_an_embedding_model_and_score_with_several_labels_are_refused(
    tiny_model_factory, classifiers
):
    with pytest.raises(ValueError, match="task='classify' is not supported"):
        _llm(tiny_model_factory("LlamaForCausalLM")).classify(PROMPTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="score needs a cross-encoder"):
        _llm(classifiers["Qwen3ForSequenceClassification", 3], runner="auto").score(
            "a", "b", use_tqdm=False
        )


# -- the contract and the pooler seam --------------------------------------------------------


def _entry(**kwargs):
    fields = dict(request_id="p", row=0, start=0, token_ids=(1, 2, 3), blocks_from=0,
                  blocks=(0,), num_scored=0, num_prompt_tokens=3)
    fields.update(kwargs)
    return ScheduledRequest(**fields)


def _batch(entry, pooling=True):
    """A batch of one entry, marked as pooling in the pooling plugin's side map."""
    sides = FrozenDict({"pooling": FrozenDict({entry.request_id: True})} if pooling else {})
    return ScheduledBatch((entry,), sides=sides)


def _check(output, batch):
    """The contract's check and the pooling plugin's, as the scheduler runs them."""
    output.check(batch)
    PoolingSchedule().check(batch, output)


def test_batch_output_check_holds_pooling_entries_to_the_contract():
    final = _batch(_entry())
    partial = _batch(_entry(num_prompt_tokens=10))
    vector = torch.zeros(4)
    pooled = BatchOutput(((),), ((),)).with_side("pooling", (vector,))
    _check(pooled, final)
    _check(BatchOutput.empty(1), partial)
    with pytest.raises(ValueError, match="pooled output exactly when its span ends the prompt"):
        _check(BatchOutput.empty(1), final)  # the output is due
    with pytest.raises(ValueError, match="pooled output exactly when"):
        _check(pooled, partial)  # not yet
    with pytest.raises(ValueError, match="must return no tokens"):
        _check(BatchOutput(((5,),), ((0.0,),)).with_side("pooling", (vector,)), final)
    sampling = _batch(_entry(num_scored=1), pooling=False)
    with pytest.raises(ValueError, match="samples, but the executor returned a pooled output"):
        _check(BatchOutput(((5,),), ((0.0,),)).with_side("pooling", (vector,)), sampling)


def test_pooling_batches_are_plain_picklable_data(tiny_model_factory):
    engine = _llm(tiny_model_factory("LlamaForCausalLM"), max_num_batched_tokens=16,
                  max_model_len=256).llm_engine
    engine.add_request("p", LONG, PoolingParams(dimensions=8))
    batch = engine.scheduler.schedule(0.0)
    entry = batch.entries[0]
    assert batch.side("pooling") == {"p": True}
    assert entry.num_scored == 0 and not pools_now(entry)
    assert isinstance(entry.setup.params, PoolingParams) and entry.setup.params.task == "embed"
    assert pickle.loads(pickle.dumps(batch)) == batch
    engine.abort_request("p")
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@register("pooler", "test_max")
@attrs.frozen
class MaxPool:
    """Max over positions (a test pooler)."""

    uses_all_positions = True

    def pool(self, hidden_states):
        return hidden_states.max(dim=0).values


@register("pooler", "test_broken")
@attrs.frozen
class BrokenPool:
    """Returns the wrong shape (a test pooler)."""

    uses_all_positions = False

    def pool(self, hidden_states):
        return hidden_states


def test_a_registered_pooler_is_one_small_class(tiny_model_factory, hf_base):
    path = tiny_model_factory("LlamaForCausalLM")
    llm = _llm(path, pooler_config={"pooling_type": "test_max", "normalize": False},
               max_num_batched_tokens=16, max_model_len=256)
    out = llm.embed(LONG, use_tqdm=False)[0]  # chunked: every chunk's states are kept
    want = _hidden_states(hf_base(path), out.prompt_token_ids).max(dim=0).values
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=1e-5)


def test_a_pooler_returning_the_wrong_shape_is_named_and_leaves_no_blocks(tiny_model_factory):
    llm = _llm(tiny_model_factory("LlamaForCausalLM"),
               pooler_config={"pooling_type": "test_broken"})
    with pytest.raises(ComponentError, match="pooler.*BrokenPool.*hidden_size=64"):
        llm.embed(PROMPTS[0], use_tqdm=False)
    kv = llm.llm_engine.kv_cache
    assert not llm.llm_engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


def test_the_pooler_in_docs_pooling_runs(tiny_model_factory, hf_base):
    import pathlib
    import re

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "pooling.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "@register" in b]
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 - the documented example itself
    from llmlab import registry

    path = tiny_model_factory("Qwen3ForCausalLM")
    try:
        llm = _llm(path, pooler_config={"pooling_type": "max", "normalize": False})
    finally:  # the example registers "max" process-wide; docs/components.md's does too
        registry.table("pooler").pop("max", None)
    out = llm.embed(PROMPTS[2], use_tqdm=False)[0]
    want = _hidden_states(hf_base(path), out.prompt_token_ids).max(dim=0).values
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=1e-5)

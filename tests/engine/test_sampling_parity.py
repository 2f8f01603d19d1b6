"""vLLM sampling parity through the whole engine: logprobs against HF, n / best_of sharing
the prompt's blocks, stop strings, DELTA streaming, chat, truncation and bad input."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from llmlab import LLM, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", block_size=4, max_model_len=256, seed=0)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama, torch_dtype=torch.float32
    ).eval()


def token_prompts(n, length, seed=0, vocab=500):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(n)]


def hf_logprobs(model, token_ids):
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_all_blocks_free(engine):
    snap = engine.kv_cache.snapshot()
    assert snap.block_tables == {}
    assert all(c == 0 for c in snap.ref_counts)
    engine.kv_cache.check()


# -- logprobs --------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_hf_log_softmax(llm, hf_model, temperature):
    prompts = token_prompts(3, 9, seed=1)
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=6, logprobs=5,
                            ignore_eos=True, presence_penalty=0.5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        ids = prompt["prompt_token_ids"] + c.token_ids
        ref = hf_logprobs(hf_model, ids)
        n_prompt = len(prompt["prompt_token_ids"])
        assert len(c.logprobs) == len(c.token_ids)
        cumulative = 0.0
        for i, (tok, position) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[n_prompt - 1 + i]
            # Raw logprobs: the penalty and temperature change the draw, not the report.
            assert position[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
            assert position[tok].rank == int((row >= row[tok]).sum())
            top_lp, top_ids = row.topk(5)
            others = {t: lp for t, lp in position.items() if lp.rank <= 5 and t != tok}
            for rank, (t, lp) in enumerate(zip(top_ids.tolist(), top_lp.tolist()), start=1):
                if t == tok:
                    continue
                assert others[t].rank == rank
                assert others[t].logprob == pytest.approx(lp, abs=1e-4)
            assert len(position) in (5, 6)  # the sampled token, plus the top 5
            assert all(lp.decoded_token is not None for lp in position.values())
            cumulative += position[tok].logprob
        assert c.cumulative_logprob == pytest.approx(cumulative, abs=1e-3)


def test_prompt_logprobs_match_hf_and_skip_the_prefix_cache(llm, hf_model):
    prompt = token_prompts(1, 23, seed=2)[0]
    # Warm the prefix cache with the same prompt: prompt logprobs must still be computed.
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    ids = prompt["prompt_token_ids"]
    ref = hf_logprobs(hf_model, ids)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        position = out.prompt_logprobs[p]
        row = ref[p - 1]
        assert position[ids[p]].logprob == pytest.approx(row[ids[p]].item(), abs=1e-4)
        assert position[ids[p]].rank == int((row >= row[ids[p]]).sum())
        best = int(row.argmax())
        assert position[best].rank == 1
    assert out.num_cached_tokens == 0


def test_prompt_logprobs_across_chunked_prefill(tiny_llama, hf_model):
    llm = LLM(tiny_llama, dtype="float32", block_size=4, max_num_batched_tokens=8,
              max_model_len=128)
    prompt = token_prompts(1, 30, seed=5)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = prompt["prompt_token_ids"]
    ref = hf_logprobs(hf_model, ids)
    got = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert got == pytest.approx(want, abs=1e-4)
    assert all(len(d) == 1 for d in out.prompt_logprobs[1:])  # k=0: just the prompt token


def test_cumulative_logprob_only_when_logprobs_are_asked(llm):
    plain, asked = llm.generate(
        token_prompts(2, 5),
        [SamplingParams(max_tokens=3), SamplingParams(max_tokens=3, logprobs=0)],
        use_tqdm=False,
    )
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].logprobs is None
    assert asked.outputs[0].cumulative_logprob < 0
    assert [len(d) for d in asked.outputs[0].logprobs] == [1, 1, 1]


def test_max_logprobs_is_an_engine_limit(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_logprobs=3, max_model_len=64)
    with pytest.raises(ValueError, match=r"logprobs=4 is more than max_logprobs=3"):
        llm.generate("hi", SamplingParams(logprobs=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt_logprobs=5 is more than max_logprobs=3"):
        llm.generate("hi", SamplingParams(prompt_logprobs=5), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


# -- n and best_of -----------------------------------------------------------------------


def test_n_shares_the_prompt_blocks_by_reference(llm):
    engine = llm.llm_engine
    prompt = token_prompts(1, 18, seed=7)[0]  # 4 full blocks of 4 and a partial one
    events = []
    snapshots = []
    engine.subscribe(events.append)
    engine.subscribe(lambda e: snapshots.append(engine.kv_cache.snapshot()))
    try:
        out = llm.generate([prompt], SamplingParams(n=4, max_tokens=6, seed=1, ignore_eos=True),
                           use_tqdm=False)[0]
    finally:
        engine.observers.clear()
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # drawn independently
    fan_out = next(i for i, e in enumerate(events) if e.blocks_forked)
    event, snap = events[fan_out], snapshots[fan_out]
    # The prompt was computed once: its 5 blocks were allocated once, then shared 3 times.
    prompt_blocks = snap.block_tables["0_" + out.request_id][:4]
    assert sorted(event.blocks_forked) == sorted(list(event.blocks_forked[:5]) * 3)
    assert all(snap.ref_counts[b] == 4 for b in prompt_blocks)
    for i in range(1, 4):
        assert snap.block_tables[f"{i}_{out.request_id}"][:4] == prompt_blocks
    assert sum(len(e.blocks_allocated) for e in events[: fan_out + 1]) == 5
    assert_all_blocks_free(engine)


def test_seeded_n_is_reproducible_and_best_of_returns_the_best(llm):
    prompt = token_prompts(1, 10, seed=8)
    params = SamplingParams(n=4, max_tokens=5, seed=11, logprobs=0, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    # Other traffic in the batch does not change seeded samples.
    second = llm.generate(prompt + token_prompts(3, 6, seed=9), params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    best = llm.generate(prompt, params.evolve(n=2, best_of=4), use_tqdm=False)[0]
    ranked = sorted(first.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]


def test_n_survives_preemption_and_abort_frees_everything(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", block_size=4, kv_cache_memory_bytes=24 * 2048,
              max_model_len=48, seed=0)
    engine = llm.llm_engine
    params = SamplingParams(n=3, max_tokens=20, ignore_eos=True, seed=2)
    preempted = []
    engine.subscribe(lambda e: preempted.extend(e.preempted))
    outs = llm.generate(token_prompts(4, 12, seed=3), params, use_tqdm=False)
    assert preempted, "the cache was meant to be too small for all samples at once"
    assert all(len(o.outputs) == 3 and all(len(c.token_ids) == 20 for c in o.outputs) for o in outs)
    assert_all_blocks_free(engine)
    engine.add_request("g", token_prompts(1, 12)[0], params)
    engine.step()
    engine.step()
    engine.abort_request("g")
    assert not engine.has_request("g") and not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_greedy_n_matches_n1(llm):
    prompt = token_prompts(1, 8, seed=4)
    one = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    many = llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)[0]
    assert all(c.token_ids == one.outputs[0].token_ids for c in many.outputs)


# -- text: stop strings, DELTA, special tokens ------------------------------------------------


def forcing(targets):
    """A logits processor that makes the model produce ``targets`` in order."""

    def force(output_ids, logits):
        out = torch.full_like(logits, -1e9)
        out[targets[min(len(output_ids), len(targets) - 1)]] = 0.0
        return out

    return force


def test_stop_string_across_tokens(llm):
    tok = llm.get_tokenizer()
    targets = tok.encode("the cat sat on the mat", add_special_tokens=False)
    # The stop string is only ever split across tokens, never inside one.
    assert not any("t on t" in tok.decode([t]) for t in targets)
    base = dict(max_tokens=len(targets) + 5, logits_processors=[forcing(targets)], ignore_eos=True)
    out = llm.generate("x", SamplingParams(stop=["t on t"], **base), use_tqdm=False)[0].outputs[0]
    assert out.text == "the cat sa"
    assert out.finish_reason == "stop" and out.stop_reason == "t on t"
    kept = llm.generate("x", SamplingParams(stop="t on t", include_stop_str_in_output=True, **base),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == "the cat sat on t"
    assert kept.token_ids == out.token_ids  # tokens are kept whole either way
    none = llm.generate("x", SamplingParams(stop="zzz", **base), use_tqdm=False)[0].outputs[0]
    assert none.finish_reason == "length" and none.stop_reason is None


def test_delta_stream_concatenates_to_the_final_text_with_multibyte_chars(llm):
    tok = llm.get_tokenizer()
    text = "héllo 日本語 🎉 ok"
    targets = tok.encode(text, add_special_tokens=False)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=len(targets), logits_processors=[forcing(targets)],
                            output_kind=RequestOutputKind.DELTA, ignore_eos=True)
    engine.add_request("d", "x", params)
    pieces, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            assert "\ufffd" not in c.text
            pieces.append(c.text)
            tokens.extend(c.token_ids)
    assert "".join(pieces) == text
    assert tokens == targets
    assert len(pieces) > 3  # streamed, not sent at the end


def test_skip_special_tokens(llm):
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    targets = tok.encode("ab", add_special_tokens=False) + [eos] + tok.encode("cd", add_special_tokens=False)
    base = dict(max_tokens=len(targets), logits_processors=[forcing(targets)], ignore_eos=True)
    skipped = llm.generate("x", SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    kept = llm.generate("x", SamplingParams(skip_special_tokens=False, **base), use_tqdm=False)[0]
    assert skipped.text == "abcd"
    assert tok.eos_token in kept.outputs[0].text
    bare = llm.generate("x", SamplingParams(detokenize=False, **base), use_tqdm=False)[0].outputs[0]
    assert bare.text == "" and bare.token_ids == targets


# -- chat, truncation, defaults -------------------------------------------------------------


def test_chat_equals_generate_on_the_rendered_prompt(llm):
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("assistant:")
    direct = llm.generate(rendered, params, use_tqdm=False)[0]
    assert chat.prompt == rendered
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "I am"}]], params,
                   use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert len(two) == 2 and two[1].prompt.endswith("I am")
    custom = llm.chat(messages, params, use_tqdm=False,
                      chat_template="{{ messages[0]['content'] }}!{{ suffix }}",
                      chat_template_kwargs={"suffix": "?"})[0]
    assert custom.prompt == "Hello, who are you?!?"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(messages="hi"), "messages must be a non-empty list"),
        (dict(messages=[{"content": "x"}]), "must be a dict with 'role'"),
        (dict(add_generation_prompt=True, continue_final_message=True), "exclude each other"),
    ],
)
def test_chat_bad_input(llm, kwargs, match):
    kwargs = {"messages": [{"role": "user", "content": "x"}], **kwargs}
    with pytest.raises(ValueError, match=match):
        llm.chat(use_tqdm=False, **kwargs)


def test_truncate_prompt_tokens_keeps_the_end(llm):
    prompt = token_prompts(1, 30, seed=6)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, truncate_prompt_tokens=7),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt["prompt_token_ids"][-7:]


def test_default_sampling_params_come_from_generation_config(tiny_llama, tmp_path):
    import json
    import shutil

    path = tmp_path / "model"
    shutil.copytree(tiny_llama, path)
    (path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
         "max_new_tokens": 7}
    ))
    llm = LLM(str(path), dtype="float32", max_model_len=64)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (
        0.6, 0.9, 20, 1.1, 7
    )
    out = llm.generate("hello", use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) <= 7


# -- bad input at the edge ----------------------------------------------------------------


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(n=300), r"n=300 parallel samples cannot run at once with max_num_seqs=256"),
        (dict(stop_token_ids=[10**6]), "stop_token_ids contains 1000000"),
        (dict(allowed_token_ids=[10**6]), "allowed_token_ids contains 1000000"),
        (dict(logit_bias={10**6: 1.0}), "logit_bias has token id 1000000"),
        (dict(stop="x", detokenize=False), "stop strings need detokenize=True"),
    ],
)
def test_engine_rejects_params_it_cannot_honour(llm, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["a", "b"], SamplingParams(**params), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert_all_blocks_free(llm.llm_engine)


def test_status_reasons_match_vllm(llm):
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    out = llm.generate("x", SamplingParams(max_tokens=4, logits_processors=[forcing([eos])]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate("x", SamplingParams(max_tokens=4, stop_token_ids=[7],
                                           logits_processors=[forcing([7])]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == 7


# -- beam search ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_beam_search_matches_hf_generate(tiny_model_factory, arch):
    """HF settings: ``num_beams=4, num_return_sequences=4, do_sample=False,
    early_stopping=False, length_penalty=1.0`` and the same EOS ids: HF's default beam search,
    whose scoring (``sum logprobs / generated_len ** length_penalty``) and stopping rule
    ``LLM.beam_search`` follows. ``ignore_eos=False``; a random model may or may not emit EOS,
    and both paths must agree either way."""
    from llmlab import BeamSearchParams

    path = tiny_model_factory(arch)
    llm = LLM(path, dtype="float32", block_size=4, max_model_len=128)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    eos = sorted(llm.llm_engine.eos_token_ids)
    prompts = [p["prompt_token_ids"] for p in token_prompts(3, 7, seed=12, vocab=200)]
    params = BeamSearchParams(beam_width=4, max_tokens=6)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                num_beams=4, num_return_sequences=4, do_sample=False, max_new_tokens=6,
                early_stopping=False, length_penalty=1.0, eos_token_id=eos, pad_token_id=0,
            )
        want = []
        for row in ref.tolist():
            # HF pads finished beams after their EOS; drop the padding.
            gen = row[len(prompt):]
            cut = next((i + 1 for i, t in enumerate(gen) if t in eos), len(gen))
            want.append(prompt + gen[:cut])
        assert [s.tokens for s in out.sequences] == want
    assert_all_blocks_free(llm.llm_engine)


def test_beam_search_shares_prefix_blocks(llm):
    from llmlab import BeamSearchParams

    events = []
    llm.llm_engine.subscribe(events.append)
    try:
        llm.beam_search([{"prompt_token_ids": list(range(10, 30))}],
                        BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
    finally:
        llm.llm_engine.observers.clear()
    hits = sum(len(e.blocks_prefix_hit) for e in events)
    computed = sum(n for e in events for _, n in e.scheduled)
    # 4 steps x up to 3 beams of >= 20 tokens: without sharing, >= 200 tokens computed.
    assert hits >= 3 * 3 * 5 and computed < 120


# -- structured outputs -----------------------------------------------------------------------


def test_structured_outputs_validate_on_a_random_model_batched_with_free_requests(llm):
    import json
    import re

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    from llmlab import GuidedDecodingParams, StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "ok": {"type": "boolean"},
            "size": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "ok", "size"],
    }
    regex = r"[a-z]{2,6}@(foo|bar)\.(com|org)"
    choices = ["yes", "no", "maybe later"]
    kinds = [
        ("json", StructuredOutputsParams(json=schema)),
        ("regex", StructuredOutputsParams(regex=regex)),
        ("choice", GuidedDecodingParams(choice=choices)),  # vLLM's older spelling
    ]
    prompts, params = [], []
    for i in range(20):
        for name, constraint in kinds:
            prompts.append(f"{name} {i}:")
            kw = {"structured_outputs": constraint} if name != "choice" else {"guided_decoding": constraint}
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=120, **kw))
        prompts.append(f"free {i}")
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=8))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, out in zip(params, outs):
        c = out.outputs[0]
        constraint = p.structured_outputs
        if constraint is None:
            continue
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        if constraint.json is not None:
            jsonschema.validate(json.loads(c.text), schema)
        elif constraint.regex is not None:
            assert re.fullmatch(regex, c.text), c.text
        else:
            assert c.text in choices
    assert_all_blocks_free(llm.llm_engine)


def test_structured_output_state_survives_preemption(tiny_llama):
    pytest.importorskip("xgrammar")
    import re

    from llmlab import StructuredOutputsParams

    llm = LLM(tiny_llama, dtype="float32", block_size=4, kv_cache_memory_bytes=12 * 2048,
              max_model_len=48, seed=0)
    preempted = []
    llm.llm_engine.subscribe(lambda e: preempted.extend(e.preempted))
    regex = r"(ab|cd){5,12}"
    params = SamplingParams(seed=1, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(regex=regex))
    outs = llm.generate([f"p{i}" for i in range(6)], params, use_tqdm=False)
    assert preempted
    for out in outs:
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text


@pytest.mark.parametrize(
    "constraint, match",
    [
        (dict(regex="(unclosed"), "structured_outputs.regex"),
        (dict(json={"type": "no-such-type"}), "structured_outputs.json"),
        (dict(grammar="root ::= missing_rule"), "structured_outputs.grammar"),
    ],
)
def test_invalid_constraints_are_refused_at_the_edge(llm, constraint, match):
    pytest.importorskip("xgrammar")
    from llmlab import StructuredOutputsParams

    with pytest.raises(ValueError, match=match):
        llm.generate(["a"], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_conflicting_constraints_end_the_request_instead_of_drawing_nan(llm):
    tok = llm.get_tokenizer()
    a = tok.encode("a", add_special_tokens=False)
    # min_tokens bans EOS, and the only allowed token is EOS: nothing is left to draw.
    params = SamplingParams(min_tokens=3, max_tokens=5, allowed_token_ids=[tok.eos_token_id])
    out = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [tok.eos_token_id] * 3 and out.finish_reason == "stop"
    free = llm.generate("x", SamplingParams(max_tokens=2, allowed_token_ids=a), use_tqdm=False)
    assert free[0].outputs[0].token_ids == a * 2


@pytest.mark.parametrize("policy", ["fcfs", "priority", "spf", "sjf", "fair", "cache_aware", "mlfq"])
def test_every_scheduling_policy_runs_parallel_samples_under_preemption(tiny_llama, policy):
    from tests.helpers import builtin_names

    assert policy in builtin_names("scheduling_policy")
    llm = LLM(tiny_llama, dtype="float32", block_size=4, kv_cache_memory_bytes=16 * 2048,
              max_model_len=48, seed=0, scheduling_policy=policy)
    params = SamplingParams(n=2, best_of=3, max_tokens=16, ignore_eos=True, seed=5)
    outs = llm.generate(token_prompts(5, 10, seed=13), params, use_tqdm=False,
                        user=["a", "b", "a", "b", "c"], priority=[1, 0, 2, 0, 1])
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 16 for c in o.outputs)
               for o in outs)
    assert_all_blocks_free(llm.llm_engine)


def test_delta_with_n_streams_each_sample_by_index(llm):
    engine = llm.llm_engine
    prompt = token_prompts(1, 6, seed=14)[0]
    params = SamplingParams(n=3, max_tokens=7, seed=9, ignore_eos=True, logprobs=1)
    final = llm.generate([prompt], params, use_tqdm=False)[0]
    engine.add_request("s", prompt, params.evolve(output_kind=RequestOutputKind.DELTA))
    texts, tokens, logprobs = {}, {}, {}
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "s"
            last = out
            for c in out.outputs:
                texts[c.index] = texts.get(c.index, "") + c.text
                tokens.setdefault(c.index, []).extend(c.token_ids)
                logprobs.setdefault(c.index, []).extend(c.logprobs)
    assert last.finished
    for c in final.outputs:
        assert tokens[c.index] == c.token_ids and texts[c.index] == c.text
        assert [d.keys() for d in logprobs[c.index]] == [d.keys() for d in c.logprobs]


def test_aborting_every_sample_by_its_own_id_ends_the_group(llm):
    engine = llm.llm_engine
    engine.add_request("grp", token_prompts(1, 6)[0], SamplingParams(n=2, max_tokens=50))
    engine.step()
    engine.step()
    engine.abort_request(["0_grp", "1_grp"])
    assert not engine.has_request("grp") and not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_logprobs_minus_one_is_the_whole_vocabulary_when_unlimited(tiny_llama, llm):
    with pytest.raises(ValueError, match=r"logprobs=-1 is more than max_logprobs=20"):
        llm.generate("hi", SamplingParams(logprobs=-1), use_tqdm=False)
    unlimited = LLM(tiny_llama, dtype="float32", max_logprobs=-1, max_model_len=64)
    out = unlimited.generate("hi", SamplingParams(max_tokens=2, logprobs=-1, prompt_logprobs=-1),
                             use_tqdm=False)[0]
    vocab = unlimited.llm_engine.vocab_size
    assert all(len(d) == vocab for d in out.outputs[0].logprobs)
    assert all(len(d) == vocab for d in out.prompt_logprobs[1:])
    ranks = sorted(lp.rank for lp in out.outputs[0].logprobs[0].values())
    assert ranks == list(range(1, vocab + 1))


def test_the_policy_hears_each_sample_leave_once(tiny_llama):
    from llmlab.scheduler.policies import FCFS

    removed = []

    class Counting(FCFS):
        def remove(self, request):
            removed.append(request.request_id)
            super().remove(request)

    llm = LLM(tiny_llama, dtype="float32", max_model_len=64, scheduling_policy=Counting())
    # max_tokens=1: every sample finishes at its first token, the forks inside the fan-out.
    llm.generate(["a", "b"], SamplingParams(n=3, max_tokens=1), use_tqdm=False)
    assert sorted(removed) == sorted(f"{i}_{j}" for i in range(3) for j in ("0", "1"))

"""The official ``openai`` client against ``llmlab``'s server: same answers as ``LLM``."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from llmlab import SamplingParams

pytest.importorskip("openai")

GREEDY = dict(temperature=0.0)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


def test_models_are_listed(client, served):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert models.data[0].object == "model" and models.data[0].owned_by == "llmlab"


def test_greedy_completion_equals_llm_generate(client, reference):
    prompts = ["Hello, my name is", "The capital of France"]
    want = reference.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    got = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, **GREEDY)
    assert got.object == "text_completion" and got.id.startswith("cmpl-")
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [w.outputs[0].text for w in want]
    assert [c.finish_reason for c in got.choices] == [w.outputs[0].finish_reason for w in want]
    prompt_tokens = sum(len(w.prompt_token_ids) for w in want)
    completion_tokens = sum(len(w.outputs[0].token_ids) for w in want)
    assert got.usage.prompt_tokens == prompt_tokens
    assert got.usage.completion_tokens == completion_tokens
    assert got.usage.total_tokens == prompt_tokens + completion_tokens


def test_token_id_prompts_and_echo(client, reference):
    ids = reference.get_tokenizer().encode("Once upon a time")
    want = reference.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=6, **GREEDY),
                              use_tqdm=False)[0]
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=6, **GREEDY)
    assert got.choices[0].text == want.outputs[0].text
    assert got.usage.prompt_tokens == len(ids)
    echoed = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6,
                                       echo=True, **GREEDY)
    assert echoed.choices[0].text == "Once upon a time" + want.outputs[0].text


def test_greedy_chat_equals_llm_chat(client, reference):
    want = reference.chat(MESSAGES, SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)[0]
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, **GREEDY)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    choice = got.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want.outputs[0].text
    assert choice.finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    # max_completion_tokens (the newer name) means the same
    newer = client.chat.completions.create(model="tiny-alias", messages=MESSAGES,
                                           max_completion_tokens=10, **GREEDY)
    assert newer.choices[0].message.content == choice.message.content
    assert newer.model == "tiny-alias"


def test_streamed_chunks_concatenate_to_the_full_text(client):
    full = client.completions.create(model="tiny", prompt="Streaming is", max_tokens=20, **GREEDY)
    chunks = list(client.completions.create(
        model="tiny", prompt="Streaming is", max_tokens=20, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])

    chat_full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16,
                                               **GREEDY)
    stream = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert stream[0].object == "chat.completion.chunk"
    assert stream[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content == chat_full.choices[0].message.content
    assert stream[-1].usage.total_tokens == chat_full.usage.total_tokens


def test_stream_ends_with_done_marker(served):
    url, _ = served
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    for line in lines[:-1]:
        json.loads(line[len("data: "):])


def test_n_samples(client):
    got = client.completions.create(model="tiny", prompt="Pick a word:", max_tokens=8, n=2,
                                    temperature=1.0, seed=3)
    assert [c.index for c in got.choices] == [0, 1]
    assert got.usage.completion_tokens == 16
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, n=3,
                                          temperature=1.0, seed=1)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) > 1  # independent samples
    # two prompts x n=2: indices prompt * n + sample
    both = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=3, n=2, seed=0)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]


def test_completion_logprobs_match_llm(client, reference):
    want = reference.generate("Numbers:", SamplingParams(max_tokens=5, logprobs=3, **GREEDY),
                              use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model="tiny", prompt="Numbers:", max_tokens=5, logprobs=3,
                                    **GREEDY).choices[0].logprobs
    assert len(got.tokens) == len(got.token_logprobs) == len(got.top_logprobs) == 5
    for token_id, position, lp, top in zip(want.token_ids, want.logprobs, got.token_logprobs,
                                           got.top_logprobs, strict=True):
        assert math.isclose(lp, position[token_id].logprob, abs_tol=1e-4)
        # keyed by text: two byte tokens that both decode to "\ufffd" share a key, and the
        # more likely one is reported (greedy: the chosen token is the top one)
        expected = {}
        for entry in sorted(position.values(), key=lambda e: e.rank):
            if entry.rank <= 3:
                expected.setdefault(entry.decoded_token, entry.logprob)
        assert top == pytest.approx(expected, abs=1e-4)
        assert max(top.values()) == pytest.approx(lp, abs=1e-4)
    assert "".join(got.tokens) == want.text
    assert got.text_offset[0] == 0
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(5)]


def test_chat_logprobs_layout(client, reference):
    want = reference.chat(MESSAGES, SamplingParams(max_tokens=4, logprobs=2, **GREEDY),
                          use_tqdm=False)[0].outputs[0]
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                         logprobs=True, top_logprobs=2, **GREEDY)
    content = got.choices[0].logprobs.content
    assert len(content) == 4
    for token_id, position, entry in zip(want.token_ids, want.logprobs, content, strict=True):
        assert entry.logprob == pytest.approx(position[token_id].logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_stop_strings(client, reference):
    base = client.completions.create(model="tiny", prompt="The", max_tokens=16, **GREEDY)
    text = base.choices[0].text
    stop = text[3:6]
    assert stop and stop in text
    got = client.completions.create(model="tiny", prompt="The", max_tokens=16, stop=[stop],
                                    **GREEDY)
    choice = got.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_json_schema_response_format_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    got = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=64, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    jsonschema.validate(json.loads(got.choices[0].message.content), schema)
    obj = client.completions.create(model="tiny", prompt="JSON:", max_tokens=48, temperature=0.0,
                                    extra_body={"response_format": {"type": "json_object"}})
    # random weights rarely close a free-form object within the budget: check the grammar
    # held (an object was opened), and that a finished one parses
    assert obj.choices[0].text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
    choice = client.completions.create(model="tiny", prompt="Pick:", max_tokens=8,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")


def test_vllm_extras_are_honoured(client, reference):
    params = SamplingParams(max_tokens=6, temperature=0.8, top_k=5, min_p=0.05,
                            repetition_penalty=1.3, seed=7, min_tokens=6, ignore_eos=True)
    want = reference.generate("Extras", params, use_tqdm=False)[0].outputs[0]
    got = client.completions.create(
        model="tiny", prompt="Extras", max_tokens=6, temperature=0.8, seed=7,
        extra_body=dict(top_k=5, min_p=0.05, repetition_penalty=1.3, min_tokens=6,
                        ignore_eos=True, priority=1),
        user="alice",
    )
    assert got.choices[0].text == want.text


def test_tokenize_detokenize_version_health(served, reference):
    url, _ = served
    tok = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}).json()
    ids = reference.get_tokenizer().encode("Hello world")
    assert tok["tokens"] == ids and tok["count"] == len(ids) and tok["max_model_len"] == 512
    back = httpx.post(f"{url}/detokenize", json={"tokens": ids[1:]}).json()
    assert back["prompt"] == "Hello world"
    chat = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == reference.render_chat(MESSAGES)[0]["prompt_token_ids"]
    import llmlab

    assert httpx.get(f"{url}/version").json() == {"version": llmlab.__version__}
    assert httpx.get(f"{url}/health").status_code == 200
    schema = httpx.get(f"{url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
            "/detokenize", "/health", "/version", "/metrics"} <= set(schema["paths"])
    assert "422" not in schema["paths"]["/v1/completions"]["post"]["responses"]


def test_request_chat_template_and_kwargs(client, reference, served):
    import openai

    template = "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}]{% endfor %}{{ tail }}"
    params = SamplingParams(max_tokens=6, **GREEDY)
    want = reference.chat(MESSAGES, params, use_tqdm=False, chat_template=template,
                          chat_template_kwargs={"tail": ">>"})[0]
    extra = {"chat_template": template, "chat_template_kwargs": {"tail": ">>"}}
    # Off by default (a template is code the server runs): refused, naming the flag.
    with pytest.raises(openai.BadRequestError, match="trust-request-chat-template"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                       **GREEDY, extra_body=extra)
    serving = served[1].state.serving
    serving.trust_request_chat_template = True  # what --trust-request-chat-template sets
    try:
        got = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=6, **GREEDY, extra_body=extra)
    finally:
        serving.trust_request_chat_template = False
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert want.prompt.endswith("]>>")

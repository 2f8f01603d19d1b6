"""vLLM's extras the server had missed: prompt logprobs in responses, prompt scoring (echo
with max_tokens=0), continuous usage stats, token ids as logprob tokens, the tokenizer info
endpoint, the response role and root path, and token-exact random bench prompts."""

from __future__ import annotations

import json

import httpx
import pytest

from llmlab import SamplingParams
from tests.server.conftest import running

pytest.importorskip("openai")

GREEDY = dict(temperature=0.0)
MESSAGES = [{"role": "user", "content": "Hi there!"}]
KEY = "sk-gaps"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60, headers=AUTH, **kw)


def _events(response: httpx.Response) -> list[dict]:
    lines = [ln[6:] for ln in response.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


# -- 1. prompt_logprobs ------------------------------------------------------------------


def _check_prompt_logprobs(got, want, prompt_ids):
    assert len(got) == len(prompt_ids) == len(want)
    assert got[0] is None
    for token_id, position, entry in zip(prompt_ids[1:], want[1:], got[1:], strict=True):
        assert str(token_id) in entry  # JSON keys: token ids as strings
        assert set(entry) == {str(t) for t in position}
        for tid, lp in position.items():
            e = entry[str(tid)]
            assert set(e) == {"logprob", "rank", "decoded_token"}
            assert e["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert e["rank"] == lp.rank and isinstance(e["decoded_token"], str)


def test_prompt_logprobs_are_returned(served, reference):
    url, _ = served
    want = reference.generate("The capital of France",
                              SamplingParams(max_tokens=3, prompt_logprobs=2, **GREEDY),
                              use_tqdm=False)[0]
    body = _post(url, "/v1/completions", {"prompt": "The capital of France", "max_tokens": 3,
                                          "prompt_logprobs": 2, **GREEDY}).json()
    choice = body["choices"][0]
    _check_prompt_logprobs(choice["prompt_logprobs"], want.prompt_logprobs,
                           want.prompt_token_ids)
    assert choice["text"] == want.outputs[0].text
    plain = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None

    chat_want = reference.chat(MESSAGES, SamplingParams(max_tokens=2, prompt_logprobs=1,
                                                        **GREEDY), use_tqdm=False)[0]
    chat = _post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                               "prompt_logprobs": 1, **GREEDY}).json()
    _check_prompt_logprobs(chat["prompt_logprobs"], chat_want.prompt_logprobs,
                           chat_want.prompt_token_ids)
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_logprobs"])
    # as vLLM: not with stream (prompt_logprobs=0 is let through, as there)
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        r = _post(url, path, {**body, "max_tokens": 1, "stream": True, "prompt_logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


# -- 2. echo with max_tokens=0: prompt scoring ----------------------------------------------


def test_echo_with_max_tokens_0_scores_the_prompt(served, client, reference):
    url, _ = served
    prompt = "Once upon a time there was"
    want = reference.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY),
                              use_tqdm=False)[0]
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                    logprobs=1)
    choice = got.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert got.usage.completion_tokens == 0
    assert got.usage.prompt_tokens == got.usage.total_tokens == len(want.prompt_token_ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == \
        len(lp.text_offset) == len(want.prompt_token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens).endswith(prompt)  # after the BOS token
    assert lp.text_offset[0] == 0
    assert lp.text_offset[1:] == [sum(map(len, lp.tokens[:i]))
                                  for i in range(1, len(lp.tokens))]
    for token_id, position, value, top in zip(want.prompt_token_ids[1:],
                                              want.prompt_logprobs[1:], lp.token_logprobs[1:],
                                              lp.top_logprobs[1:], strict=True):
        assert value == pytest.approx(position[token_id].logprob, abs=1e-4)
        assert 1 <= len(top) <= 2
    # several prompts, n > 1, no logprobs: the prompts alone
    many = client.completions.create(model="tiny", prompt=["a b c", "d e"], max_tokens=0,
                                     echo=True, n=2, temperature=1.0)
    assert [c.text for c in many.choices] == ["a b c", "a b c", "d e", "d e"]
    assert all(c.logprobs is None for c in many.choices)
    # streamed: one chunk per choice, the same as the whole response
    events = _events(_post(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True,
        "stream_options": {"include_usage": True}}))
    chunks = [e for e in events if e["choices"]]
    assert len(chunks) == 1 and chunks[0]["choices"][0]["text"] == prompt
    assert chunks[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == lp.tokens
    assert events[-1]["usage"]["completion_tokens"] == 0
    # without echo, max_tokens=0 is still a 400
    r = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


def test_echo_only_takes_a_prompt_of_the_whole_context(served):
    url, app = served
    max_len = app.state.serving.max_model_len
    ids = [5 + i % 50 for i in range(max_len)]
    r = _post(url, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True,
                                       "logprobs": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == max_len
    r = _post(url, "/v1/completions", {"prompt": ids + [5], "max_tokens": 0, "echo": True})
    assert r.status_code == 400


# -- 3. stream_options.continuous_usage_stats -----------------------------------------------


def test_continuous_usage_stats_put_usage_in_every_chunk(served):
    url, _ = served
    for path, body in (("/v1/completions", {"prompt": "Streaming is"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        base = {**body, "max_tokens": 6, "ignore_eos": True, "stream": True, **GREEDY}
        events = _events(_post(url, path, {**base, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}))
        assert all(e["usage"] is not None for e in events), path
        prompt_tokens = events[-1]["usage"]["prompt_tokens"]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
        counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
        assert counts == sorted(counts) and counts[-1] == 6, counts
        for e in events:
            u = e["usage"]
            assert u["prompt_tokens"] == prompt_tokens
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        if "messages" in body:  # the role chunk: nothing generated yet
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            assert events[0]["usage"]["completion_tokens"] == 0
        # vLLM's include_usage defaults to true: continuous_usage_stats alone is enough
        alone = _events(_post(url, path, {**base, "stream_options": {
            "continuous_usage_stats": True}}))
        assert all(e["usage"] is not None for e in alone)
        off = _events(_post(url, path, {**base, "stream_options": {
            "include_usage": False, "continuous_usage_stats": True}}))
        assert all(e["usage"] is None for e in off)
        usual = _events(_post(url, path, {**base, "stream_options": {"include_usage": True}}))
        assert [e["usage"] is None for e in usual] == [True] * (len(usual) - 1) + [False]


# -- 4. return_tokens_as_token_ids -------------------------------------------------------------


@pytest.fixture(scope="module")
def custom(tiny_llama):
    """A server built with this module's ``build_app`` keywords (not their defaults)."""
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32", seed=0)
    app = build_app(engine, served_model_names=["tiny"], model_path=tiny_llama, api_key=KEY,
                    return_tokens_as_token_ids=True, enable_tokenizer_info_endpoint=True,
                    response_role="bot", root_path="/proxy")
    with running(app) as url:
        yield url, app


def _is_id(token: str) -> bool:
    return token.startswith("token_id:") and token[9:].isdigit()


def test_return_tokens_as_token_ids(served, custom, reference):
    want = reference.generate("Numbers:", SamplingParams(max_tokens=4, logprobs=2, **GREEDY),
                              use_tqdm=False)[0].outputs[0]
    body = {"prompt": "Numbers:", "max_tokens": 4, "logprobs": 2, **GREEDY}
    url, _ = served
    plain = _post(url, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert not any(_is_id(t) for t in plain["tokens"])
    for base, extra in ((url, {"return_tokens_as_token_ids": True}), (custom[0] + "/proxy", {})):
        lp = _post(base, "/v1/completions", {**body, **extra}).json()["choices"][0]["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in want.token_ids]
        assert lp["token_logprobs"] == pytest.approx(plain["token_logprobs"], abs=1e-4)
        assert all(_is_id(k) for top in lp["top_logprobs"] for k in top)
        assert lp["text_offset"] == plain["text_offset"]  # offsets into the text still
    # the server's default gives way to the request's
    lp = _post(custom[0] + "/proxy", "/v1/completions",
               {**body, "return_tokens_as_token_ids": False})
    assert lp.json()["choices"][0]["logprobs"]["tokens"] == plain["tokens"]
    chat = {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
            **GREEDY}
    for base, extra in ((url, {"return_tokens_as_token_ids": True}), (custom[0], {})):
        got = _post(base, "/v1/chat/completions", {**chat, **extra}).json()
        content = got["choices"][0]["logprobs"]["content"]
        assert content and all(_is_id(c["token"]) for c in content)
        assert all(_is_id(t["token"]) for c in content for t in c["top_logprobs"])
        assert content[0]["bytes"] == list(content[0]["token"].encode())
        # streamed too
        events = _events(_post(base, "/v1/chat/completions", {**chat, **extra,
                                                               "stream": True}))
        streamed = [c for e in events for ch in e["choices"]
                    for c in ((ch.get("logprobs") or {}).get("content") or [])]
        assert [c["token"] for c in streamed] == [c["token"] for c in content]


# -- 5. GET /tokenizer_info ----------------------------------------------------------------------


def test_tokenizer_info_serves_lm_evals_remote_tokenizer(served, custom, reference):
    assert httpx.get(f"{served[0]}/tokenizer_info").status_code == 404  # off by default
    url, _ = custom
    assert httpx.get(f"{url}/tokenizer_info").status_code == 401  # keyed like /tokenize
    r = httpx.get(f"{url}/tokenizer_info", headers=AUTH)
    assert r.status_code == 200, r.text
    info = r.json()
    tok = reference.get_tokenizer()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert isinstance(info["model_max_length"], int)
    assert info["chat_template"] == tok.chat_template
    assert not {"name_or_path", "vocab_file"} & set(info)  # no server paths
    json.dumps(info)
    # lm-eval's RemoteTokenizer: /tokenize without special tokens, /detokenize, and the chat
    # template rendered on the client with the special tokens from /tokenizer_info
    text = "Hello remote tokenizer"
    ids = _post(url, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert ids["tokens"] == tok.encode(text, add_special_tokens=False)
    back = _post(url, "/detokenize", {"tokens": ids["tokens"]}).json()["prompt"]
    assert back == text
    import jinja2

    rendered = jinja2.Environment().from_string(info["chat_template"]).render(
        messages=MESSAGES, add_generation_prompt=True, bos_token=info["bos_token"],
        eos_token=info["eos_token"])
    assert rendered == tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                               tokenize=False)


# -- 6. response_role and root_path ------------------------------------------------------------


def test_response_role_and_root_path(custom):
    url, _ = custom
    body = {"messages": MESSAGES, "max_tokens": 2, **GREEDY}
    for base in (url, f"{url}/proxy"):  # a proxy that strips the prefix, and one that does not
        got = _post(base, "/v1/chat/completions", body)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["message"]["role"] == "bot"
        events = _events(_post(base, "/v1/chat/completions", {**body, "stream": True}))
        assert events[0]["choices"][0]["delta"]["role"] == "bot"
        # the API key guards the prefixed paths too
        for path in ("/v1/models", "/tokenize", "/tokenizer_info"):
            assert httpx.get(f"{base}{path}").status_code == 401, (base, path)
        assert httpx.get(f"{base}/health").status_code == 200
    # continuing the last message: its role, as vLLM
    cont = _post(url, "/v1/chat/completions", {
        **body, "messages": MESSAGES + [{"role": "assistant", "content": "Well"}],
        "add_generation_prompt": False, "continue_final_message": True}).json()
    assert cont["choices"][0]["message"]["role"] == "assistant"
    spec = httpx.get(f"{url}/proxy/openapi.json", headers=AUTH).json()
    assert spec["servers"] == [{"url": "/proxy"}]
    assert "/tokenizer_info" in spec["paths"]
    # the defaults: "assistant", no prefix
    from llmlab.entrypoints.server.app import build_app

    with pytest.raises(ValueError, match="response_role"):
        build_app(custom[1].state.engine, response_role="")
    with pytest.raises(ValueError, match="root_path"):
        build_app(custom[1].state.engine, root_path="proxy")


def test_defaults_keep_the_assistant_role_and_no_prefix(served):
    url, _ = served
    got = _post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert got.json()["choices"][0]["message"]["role"] == "assistant"
    assert "servers" not in httpx.get(f"{url}/openapi.json").json()


# -- 7. bench serve: random prompts of so many tokens ----------------------------------------------


def test_random_prompts_count_tokens_with_a_tokenizer(reference):
    from llmlab.loadtest import random_requests
    from llmlab.loadtest.client import _LocalTokenizer

    tok = reference.get_tokenizer()
    requests = random_requests(30, 24, 4, range_ratio=0.5, prefix_len=5, seed=1,
                               tokenizer=_LocalTokenizer(tok))
    lens = [len(tok.encode(r.prompt, add_special_tokens=False)) for r in requests]
    assert [r.prompt_len for r in requests] == lens
    prefix = tok.decode(tok.encode(requests[0].prompt, add_special_tokens=False)[:5])
    assert all(r.prompt.startswith(prefix) for r in requests)
    # 5 + [12, 36] tokens, give or take one where the prefix meets the rest
    assert all(5 + 12 - 1 <= n <= 5 + 36 + 1 for n in lens)
    assert len(set(lens)) > 5  # the lengths vary
    exact = random_requests(20, 17, 4, seed=2, tokenizer=_LocalTokenizer(tok))
    assert all(len(tok.encode(r.prompt, add_special_tokens=False)) == 17 for r in exact)


def test_bench_serve_sends_prompts_of_input_len_tokens(served, tiny_llama):
    import asyncio

    from llmlab.loadtest import BenchConfig, benchmark

    url, _ = served
    for extra in ({}, {"tokenizer": tiny_llama}):  # the server's /tokenize, or a local one
        config = BenchConfig(base_url=url, num_prompts=3, random_input_len=20,
                             random_output_len=2, ignore_eos=True, disable_tqdm=True, **extra)
        result = asyncio.run(benchmark(config))
        assert result["completed"] == 3 and result["prompt_len_unit"] == "tokens"
        # the server's usage: 20 tokens and its BOS
        assert [r["prompt_tokens"] for r in result["requests"]] == [21] * 3

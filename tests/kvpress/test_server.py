"""A KV press behind ``llmlab serve``'s app: the official openai client gets the same tokens as
``LLM`` with the same press, a request's own budget travels in ``vllm_xargs`` (vLLM's field
for ``SamplingParams.extra_args``), and a bad budget is a 400 naming it."""

from __future__ import annotations

import pytest

from llmlab import LLM, SamplingParams

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

PRESS = dict(kv_press="knorm", kv_press_config={"compression_ratio": 0.5})


@pytest.fixture(scope="module")
def server(tiny_llama):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app
    from tests.server.conftest import running

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32", seed=0, **PRESS)
    app = build_app(engine, served_model_names=["tiny"], model_path=tiny_llama)
    with running(app) as url:
        yield url


def test_openai_client_with_a_press_and_a_per_request_budget(server, tiny_llama):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    prompt = list(range(5, 65))
    llm = LLM(tiny_llama, dtype="float32", seed=0, **PRESS)
    for xargs in (None, {"kv_budget": 0.25}, {"kv_press": False}):
        want = llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, extra_args=xargs),
            use_tqdm=False,
        )[0].outputs[0]
        extra = {"ignore_eos": True} | ({"vllm_xargs": xargs} if xargs else {})
        got = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, temperature=0, extra_body=extra
        )
        assert got.choices[0].text == want.text
    budgets = {
        str(x): llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
            max_tokens=10, temperature=0, ignore_eos=True, extra_args=x), use_tqdm=False
        )[0].outputs[0].token_ids
        for x in (None, {"kv_budget": 0.25})
    }
    assert len(set(map(tuple, budgets.values()))) == 2  # the budget reached the engine


def test_a_budget_outside_the_range_is_a_400_naming_it(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="hi", max_tokens=3,
                                  extra_body={"vllm_xargs": {"kv_budget": 2}})
    assert "kv_budget" in str(err.value) and "(0, 1]" in str(err.value)

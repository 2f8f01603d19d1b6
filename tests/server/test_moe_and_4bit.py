"""The server on a mixture-of-experts model and on a 4-bit checkpoint (a 4-bit MoE too):
the official openai client, streamed and not, gets ``LLM``'s greedy tokens."""

from __future__ import annotations

import pytest

from llmlab import LLM, SamplingParams
from tests.quantization.int4_reference import Case, write_checkpoint
from tests.server.conftest import running

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module", params=["moe", "gptq-moe", "awq-llama"])
def model_dir(request, tiny_model_factory, tiny_llama, tmp_path_factory) -> str:
    if request.param == "moe":
        return tiny_model_factory("Qwen3MoeForCausalLM")
    base = tiny_model_factory("Qwen3MoeForCausalLM") if "moe" in request.param else tiny_llama
    # Group 16: the tiny Qwen3-MoE's experts are 48 wide.
    case = Case("gptq", 16, act_order=True) if "gptq" in request.param else Case("awq", 32)
    return str(write_checkpoint(base, tmp_path_factory.mktemp(request.param) / "ckpt", case))


def test_the_openai_client_gets_the_engines_tokens(model_dir):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    prompt = "Once upon a time"
    want = LLM(model_dir, dtype="float32", seed=0).generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0].text
    engine = AsyncEngine.from_settings(model_dir, dtype="float32", seed=0)
    app = build_app(engine, served_model_names=["m"], model_path=model_dir)
    with running(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        args = dict(model="m", prompt=prompt, max_tokens=8, temperature=0.0,
                    extra_body={"ignore_eos": True})
        whole = client.completions.create(**args)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            **args, stream=True))
    assert whole.choices[0].text == want == streamed
    assert whole.usage.completion_tokens == 8

"""lm-evaluation-harness's ``local-completions`` model against the server, as users run it:
the remote tokenizer (``/tokenizer_info``, ``/tokenize``) instead of a hub lookup of the
served name, log-likelihoods from ``echo`` + ``logprobs`` compared with transformers on the
same weights, and greedy generation."""

from __future__ import annotations

import pytest
import torch

from tests.server.conftest import running

pytest.importorskip("lm_eval")

# Contexts without trailing spaces: lm-eval moves those into the continuation.
PAIRS = [("The cat sat on the", " mat"), ("Once upon a time", " there was a fox"),
         ("1 2 3 4", " 5 6")]


@pytest.fixture(scope="module")
def url(tiny_llama):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32", seed=0)
    # "tiny" is not a hub name: lm-eval can only get the tokenizer from the server.
    app = build_app(engine, served_model_names=["tiny"], enable_tokenizer_info_endpoint=True)
    with running(app) as base:
        yield base


def _hf_loglikelihood(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx_len = len(tok.encode(context, add_special_tokens=False))
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].double().log_softmax(-1)
    targets = whole[ctx_len:]
    rows = logits[ctx_len - 1:len(whole) - 1]
    total = sum(rows[i, t].item() for i, t in enumerate(targets))
    greedy = all(rows[i].argmax().item() == t for i, t in enumerate(targets))
    return total, greedy


@pytest.mark.parametrize("backend", ["remote", "auto"])
def test_local_completions_loglikelihood_matches_transformers(url, tiny_llama, backend):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model="tiny",
                             tokenizer_backend=backend, max_retries=1)
    assert lm.tokenizer_backend == "remote"  # "auto" found the server's tokenizer endpoints
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    got = lm.loglikelihood(requests, disable_tqdm=True)

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for (context, continuation), (logprob, greedy) in zip(PAIRS, got, strict=True):
        want, want_greedy = _hf_loglikelihood(model, tok, context, continuation)
        assert logprob == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy


def test_local_completions_generate_until(url, tiny_llama):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from llmlab import LLM, SamplingParams

    lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model="tiny",
                             tokenizer_backend="remote", max_retries=1)
    args = ("Once upon a time", {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False})
    got = lm.generate_until([Instance("generate_until", {}, args, 0)], disable_tqdm=True)
    want = LLM(tiny_llama, dtype="float32", seed=0).generate(
        {"prompt_token_ids": lm.tok_encode("Once upon a time")},
        SamplingParams(max_tokens=8, temperature=0, stop=["\n\n"]), use_tqdm=False)
    assert got == [want[0].outputs[0].text]

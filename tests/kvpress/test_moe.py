"""KV presses on mixture-of-experts models: a press acts on the attention's KV cache, which
MoE models share with the dense Llama family, so every press runs on them; checked against
the same HF reference as the dense tests (tests/kvpress/test_engine.py)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from tests.engine.test_hf_parity import assert_no_leaks
from tests.kvpress.hf_reference import hf_greedy_with_eviction, sinks_and_window
from tests.kvpress.test_engine import BACKENDS, PRESSES, _checked, _generate, _llm, _prompts, _vocab

# (The tiny Mixtral has a sliding window, which presses refuse by name.)
MOE = ["Qwen3MoeForCausalLM", "OlmoeForCausalLM"]


@pytest.mark.parametrize("arch", MOE)
def test_streaming_llm_on_an_moe_model_matches_hf(tiny_model_factory, arch):
    import torch

    path = tiny_model_factory(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = _llm(path, kv_press="streaming_llm",
               kv_press_config={"n_sink": 4, "window": 12, "compress_every": 3})
    _checked(llm)
    prompts = _prompts(_vocab(path))
    got = _generate(llm, prompts, max_tokens=16)
    assert got == [hf_greedy_with_eviction(hf, p, 16, sinks_and_window(4, 12), 3)
                   for p in prompts]
    assert got != _generate(_llm(path), prompts, max_tokens=16), "the press changed nothing"
    assert_no_leaks(llm)


@pytest.mark.parametrize("press", PRESSES)
def test_every_press_runs_on_an_moe_model(tiny_model_factory, press):
    """Ratio 0 keeps every token: the press runs and compacts, and the tokens do not move."""
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = _prompts(_vocab(path))
    llm = _llm(path, BACKENDS[0], kv_press=press, kv_press_config={"compression_ratio": 0.0})
    events = _checked(llm)
    assert _generate(llm, prompts) == _generate(_llm(path, BACKENDS[0]), prompts)
    compactions = [c for e in events for c in e.kv_compacted]
    assert len(compactions) == 3 and all(c.error is None for c in compactions)
    assert_no_leaks(llm)

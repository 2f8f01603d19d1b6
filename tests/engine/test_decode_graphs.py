"""Decode steps through static buffers and captured forwards (CUDA graphs).

On CPU the capture is emulated (``DecodeGraphs(emulate=True)``: "replay" re-runs the
forward on the same static buffers), which checks what a real graph relies on: inputs
refilled in place, padded rows that write and read nothing, per-size metadata reused
across steps. On CUDA the real graphs are checked the same way.
"""

from __future__ import annotations

import pytest
import torch

from llmlab import LLM, SamplingParams
from llmlab.attention.triton_backend import triton_unavailable_reason
from llmlab.runner.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tests.helpers import slow_after_first

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(
    triton_unavailable_reason(DEVICE) is not None, reason=str(triton_unavailable_reason(DEVICE))
)


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(256)[-1] == 256 and len(graph_batch_sizes(256)) == 35
    assert graph_batch_sizes(1000)[-1] == 512


def _llm(path, *, eager: bool):
    llm = LLM(path, dtype="float32", device=DEVICE.type, seed=0, attention_backend="triton",
              block_size=16, max_model_len=128, max_num_seqs=6, enforce_eager=True,
              gpu_memory_utilization=0.3)
    runner = llm.llm_engine.executor
    if not eager:
        runner.decode_graphs = DecodeGraphs(
            model=runner.model, backend=runner.attention, kv_caches=runner.kv_caches,
            device=DEVICE, max_num_seqs=6, max_model_len=128, block_size=16,
            emulate=DEVICE.type != "cuda",
        )
    return llm


PROMPTS = [[5, 9, 13] * k for k in (1, 4, 11)] + [[7, 3] * 9, [11] * 20]


@needs_triton
# In Triton's interpreter (no GPU) 15-45 s per architecture: Llama by default, both in CI.
@pytest.mark.parametrize("arch", slow_after_first(["LlamaForCausalLM", "Qwen3ForCausalLM"]))
def test_graph_decode_matches_eager(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    # Different lengths: requests finish at different steps, so the batch shrinks
    # through several padded sizes (5 -> padded to 6, 4 -> 4, 3 -> padded to 4, ...).
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (3, 9, 17, 12, 6)]
    want = [o.outputs[0].token_ids
            for o in _llm(path, eager=True).generate(
                [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    llm = _llm(path, eager=False)
    got = [o.outputs[0].token_ids
           for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                 use_tqdm=False)]
    graphs = llm.llm_engine.executor.decode_graphs
    assert got == want
    assert graphs.disabled is None
    assert set(graphs.captured) == {1, 2, 4, 6}  # padded sizes were replayed
    # A second run reuses the captured sizes and still agrees.
    again = [o.outputs[0].token_ids
             for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                   use_tqdm=False)]
    assert again == want


@needs_triton
def test_capture_failure_falls_back_to_eager(tiny_model_factory, monkeypatch, caplog):
    path = tiny_model_factory("LlamaForCausalLM")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    want = [o.outputs[0].token_ids for o in _llm(path, eager=True).generate(
        prompts, params, use_tqdm=False)]
    llm = _llm(path, eager=False)
    graphs = llm.llm_engine.executor.decode_graphs

    def broken(self, **kwargs):
        raise RuntimeError("capture exploded")

    monkeypatch.setattr(type(graphs.backend), "decode_graph_metadata", broken)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert "capture exploded" in graphs.disabled
    assert "running eagerly" in caplog.text

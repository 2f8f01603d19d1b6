"""int8 under tensor parallelism (gloo, CPU): each rank quantizes its own shard after its
load, or reads its slices of a saved checkpoint's weights and scales."""

from __future__ import annotations

import pytest

from llmlab import LLM
from llmlab.quantization import Int8Linear, save_quantized
from tests.quantization.agreement import agreement, greedy_continuations

SETTINGS = dict(device="cpu", seed=0, dtype="float32", cpu_threads=1)


def test_two_ranks_load_a_saved_int8_checkpoint_as_one_does(tiny_llama, tmp_path):
    """Column-parallel ranks read their rows of weights and scales; row-parallel ones
    their columns and the whole scale: the same math as one rank, so the same tokens."""
    path = str(save_quantized(tiny_llama, tmp_path / "int8", "int8"))
    expected = greedy_continuations(LLM(path, **SETTINGS))
    llm = LLM(path, tensor_parallel_size=2, **SETTINGS)
    try:
        model = llm.llm_engine.executor.runner.model
        qkv = model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, Int8Linear) and qkv.weight_scale.shape == (qkv.out_features,)
        assert greedy_continuations(llm) == expected
    finally:
        llm.llm_engine.executor.shutdown()


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_two_ranks_quantize_their_shards_at_load(tiny_model_factory, arch):
    """Scales come from each rank's shard (a row-parallel shard's rows are shorter, so its
    scales may differ from one rank's): still int8 within tolerance of float32."""
    path = tiny_model_factory(arch)
    llm = LLM(path, tensor_parallel_size=2, quantization="int8", **SETTINGS)
    try:
        assert agreement(LLM(path, **SETTINGS), llm) >= 0.9
    finally:
        llm.llm_engine.executor.shutdown()

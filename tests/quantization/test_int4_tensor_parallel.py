"""4-bit checkpoints under tensor parallelism (gloo, CPU): each rank reads its slices, a
column-parallel layer's output rows, a row-parallel layer's input channels (with their
act-order groups, regrouped where a rank holds part of one), so two ranks compute what one
does."""

from __future__ import annotations

import pytest

from llmlab import LLM
from llmlab.quantization import W4A16Linear
from tests.quantization.agreement import greedy_continuations
from tests.quantization.int4_reference import Case, write_checkpoint

SETTINGS = dict(device="cpu", seed=0, dtype="float32", cpu_threads=1)


@pytest.mark.slow
@pytest.mark.parametrize("case", [Case("gptq", 32, act_order=True),
                                  Case("compressed-tensors", 64)], ids=lambda c: c.name)
def test_two_ranks_decode_a_4_bit_checkpoint_as_one_does(tiny_llama, tmp_path, case):
    path = str(write_checkpoint(tiny_llama, tmp_path / "ckpt", case))
    expected = greedy_continuations(LLM(path, **SETTINGS))
    llm = LLM(path, tensor_parallel_size=2, **SETTINGS)
    try:
        model = llm.llm_engine.executor.runner.model
        attention = model.layers[0].self_attn
        assert isinstance(attention.qkv_proj, W4A16Linear)
        # Rank 0's halves: its query heads' rows, and half of o_proj's 64 input channels.
        assert attention.o_proj.in_features == 32
        if case.act_order:  # its channels come from both groups, in runs of any length
            assert attention.o_proj.perm is not None and attention.o_proj.group_size < 32
        else:  # half of one group of 64
            assert attention.o_proj.perm is None and attention.o_proj.group_size == 32
        assert greedy_continuations(llm) == expected
    finally:
        llm.llm_engine.executor.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_a_4_bit_moe_on_two_ranks_decodes_as_one_does(tiny_model_factory, tmp_path,
                                                      expert_parallel):
    """A GPTQ act-order Qwen3-MoE (experts 48 wide: group 16), experts split within the
    ranks or placed whole (expert parallelism: each rank reads only its experts)."""
    from llmlab.models.moe import SparseMoeBlock

    path = str(write_checkpoint(tiny_model_factory("Qwen3MoeForCausalLM"), tmp_path / "ckpt",
                                Case("gptq", 16, act_order=True)))
    expected = greedy_continuations(LLM(path, **SETTINGS))
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              **SETTINGS)
    try:
        model = llm.llm_engine.executor.runner.model
        block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
        assert isinstance(block.experts[0].down_proj, W4A16Linear)
        assert len(block.experts) == (2 if expert_parallel else 4)
        assert greedy_continuations(llm) == expected
    finally:
        llm.llm_engine.executor.shutdown()

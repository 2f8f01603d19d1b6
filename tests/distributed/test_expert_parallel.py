"""Expert parallelism on CPU (gloo): ``enable_expert_parallel=True`` places whole experts on
the tensor-parallel ranks; the tokens equal one rank's through the same workload as the
tensor-parallel tests (chunked prefill, prefix hits, preemption, seeded n > 1, a grammar).
"""

from __future__ import annotations

import pytest

from llmlab import LLM
from llmlab.distributed.parallel_state import TensorParallel
from llmlab.models.moe import SparseMoeBlock
from llmlab.testing import build_tiny_model
from tests.distributed.test_tensor_parallel import (
    SETTINGS,
    _earlier_children,  # noqa: F401 (autouse fixture)
    _tp_children,
    assert_same,
    workload,
)
from tests.helpers import slow_after_first


def test_experts_are_spread_as_evenly_as_they_divide():
    placed = [list(TensorParallel(r, 3, expert_parallel=True).expert_range(8)) for r in range(3)]
    assert placed == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert list(TensorParallel(1, 2, expert_parallel=True).expert_range(2)) == [1]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .* 3 experts"):
        TensorParallel(0, 4, expert_parallel=True).expert_range(3)


# An uneven split (5 experts on 2 ranks: 3 + 2) for Qwen3-MoE, whose tiny model also keeps a
# dense layer; Mixtral's 4 split 2 + 2.
MODELS = {
    "MixtralForCausalLM": {},
    "Qwen3MoeForCausalLM": {"num_experts": 5, "num_experts_per_tok": 3},
}


@pytest.mark.parametrize("arch", slow_after_first(list(MODELS)))
def test_two_expert_parallel_ranks_give_the_tokens_of_one(tmp_path, arch):
    path = str(build_tiny_model(tmp_path / arch, arch, **MODELS[arch]))
    reference = workload(LLM(path, **SETTINGS))[0]
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, **SETTINGS)
    try:
        model = llm.llm_engine.executor.model  # rank 0's
        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        assert blocks
        for block in blocks:  # rank 0 holds the first experts whole, nothing else
            local = block.expert_range
            assert local.start == 0 and len(block.experts) == len(local) < block.num_experts
            inner = block.experts[0].down_proj.in_features
            assert inner == model.moe.intermediate_size  # not split
        got, events = workload(llm)
        assert_same(reference, got)
        assert sum(len(e.preempted) for e in events) > 0
        assert llm.llm_engine.kv_cache.num_free_blocks == 32
    finally:
        llm.llm_engine.executor.shutdown()
    assert not _tp_children()


def test_expert_parallel_is_refused_where_it_cannot_run(tmp_path, tiny_llama):
    with pytest.raises(ValueError, match=r"enable_expert_parallel=True .* dense model"):
        LLM(tiny_llama, tensor_parallel_size=2, enable_expert_parallel=True, **SETTINGS)
    one = build_tiny_model(tmp_path / "one", "MixtralForCausalLM", num_local_experts=1,
                           num_experts_per_tok=1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 ranks, but the model has 1"):
        LLM(str(one), tensor_parallel_size=2, enable_expert_parallel=True, **SETTINGS)
    assert not _tp_children()  # refused before any worker started

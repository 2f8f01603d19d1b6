"""The fused MoE layer (``llmlab.kernels.triton_moe``) and the sparse block's two paths.

The kernels run on the GPU when there is one, else in Triton's interpreter on CPU tensors
(tests/conftest.py sets ``TRITON_INTERPRET=1``); the block's fused path is forced on CPU
the same way (:meth:`SparseMoeBlock.stack_experts` accepts any device under the
interpreter). Tolerances, as max |got - want| / max |want|:

* kernel vs :func:`fused_moe_reference` (float32 math on the same rounded inputs, no
  intermediate rounding): float32 1e-5 (sums in another order); float16 5e-3 and bfloat16
  3e-2: the kernel rounds where the model's torch chain does (gate/up, SiLU, the product,
  the down projection, the weighting, the sum: six roundings of 2^-11 or 2^-8 relative,
  and the interpreter truncates to bfloat16 rather than rounding, doubling that).
* fused block vs grouped block (both round at the same places): float32 1e-5, bfloat16
  3e-2 (the matmuls' sums in another order, then rounded; the interpreter's truncation).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from llmlab.kernels import triton_moe
from llmlab.kernels.triton_kernels import interpreting
from llmlab.models.moe import SparseMoeBlock, check_fused

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type != "cuda" and not interpreting(), reason="needs CUDA or Triton's interpreter"
)
MOE = ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"]
KERNEL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}



def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """:func:`fused_moe` from its definition, in float32 on the same values, pair by pair
    with no grouping (slow)."""
    num_experts, two_inner, _ = w13.shape
    inner = two_inner // 2
    xf, w13f, w2f = x.float(), w13.float(), w2.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for slot in range(chosen.shape[1]):
        experts = chosen[:, slot] - first_expert
        held = (experts >= 0) & (experts < num_experts)
        experts = experts.clamp(0, num_experts - 1)
        gate_up = torch.einsum("th,tnh->tn", xf, w13f[experts])
        hidden = F.silu(gate_up[:, :inner]) * gate_up[:, inner:]
        down = torch.einsum("ti,thi->th", hidden, w2f[experts])
        out += torch.where(held[:, None], weights[:, slot, None].float() * down, 0.0)
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def random_layer(tokens, experts, top_k, hidden, inner, dtype, *, seed=0, used=None,
                 float32_weights=True):
    """``(x, w13, w2, weights, chosen)``: random activations, experts scaled as a trained
    layer's (N(0, 1/fan_in)), and a softmax top-k routing, picked among ``used`` experts
    only when given (the others receive no token)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inner, hidden, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inner, generator=gen) * inner**-0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    if used is not None:
        blocked = torch.ones(experts, dtype=torch.bool)
        blocked[list(used)] = False
        logits[:, blocked] = float("-inf")
    weights, chosen = torch.topk(logits.softmax(-1), top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    if not float32_weights:
        weights = weights.to(dtype)
    return tuple(t.to(DEVICE) for t in (x, w13, w2, weights, chosen))


# (tokens, experts, top_k): a single decode token, a few, more pairs per expert than a
# 64-row block (several blocks per expert), Qwen3-MoE-like many narrow experts, top_k 1.
SHAPES = [(1, 8, 2), (5, 4, 2), (150, 4, 2), (40, 16, 4), (9, 8, 1), (70, 64, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k", SHAPES)
def test_fused_moe_matches_the_reference(tokens, experts, top_k, dtype):
    # hidden 96 and inner 40: neither a multiple of the 64-wide tiles.
    layer = random_layer(tokens, experts, top_k, 96, 40, dtype, seed=tokens + experts)
    got = triton_moe.fused_moe(*layer)
    assert got.dtype == dtype and got.shape == (tokens, 96)
    assert rel_err(got, fused_moe_reference(*layer)) < KERNEL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weights_in_the_activations_dtype_and_float16(dtype):
    layer = random_layer(33, 8, 2, 64, 64, dtype, float32_weights=False)
    assert rel_err(triton_moe.fused_moe(*layer),
                   fused_moe_reference(*layer)) < KERNEL_TOL[dtype]


def test_experts_without_tokens_are_skipped():
    # Only experts 1, 4 and 6 of 8 are picked: the others' weights are NaN, so reading
    # any of them (or a block assigned to the wrong expert) poisons the output.
    x, w13, w2, weights, chosen = random_layer(20, 8, 2, 64, 48, torch.float32,
                                               used=(1, 4, 6))
    for unused in (0, 2, 3, 5, 7):
        w13[unused] = float("nan")
        w2[unused] = float("nan")
    got = triton_moe.fused_moe(x, w13, w2, weights, chosen)
    assert not got.isnan().any()
    assert rel_err(got, fused_moe_reference(x, w13, w2, weights, chosen)) < 1e-5


@pytest.mark.parametrize("first_expert", [0, 3])
def test_a_rank_holding_some_experts_adds_only_theirs(first_expert):
    # Experts 3, 4 and 5 (or 0, 1, 2) of 8 held: the others' picks contribute nothing.
    x, w13, w2, weights, chosen = random_layer(30, 8, 2, 64, 48, torch.float32)
    held = slice(first_expert, first_expert + 3)
    got = triton_moe.fused_moe(x, w13[held].contiguous(), w2[held].contiguous(), weights,
                               chosen, first_expert=first_expert)
    keep = (chosen >= first_expert) & (chosen < first_expert + 3)
    want = fused_moe_reference(x, w13, w2, weights * keep, chosen)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 8, 2, 16), (150, 4, 2, 64),
                                                          (40, 16, 4, 16), (3, 64, 8, 16)])
def test_alignment_sorts_pairs_into_per_expert_blocks(tokens, experts, top_k, block_m):
    *_, chosen = random_layer(tokens, experts, top_k, 16, 16, torch.float32)
    pair_ids, block_expert, num_padded = triton_moe.align_pairs(chosen, experts, block_m)
    num_pairs = tokens * top_k
    rows = triton_moe.max_padded_rows(num_pairs, experts, block_m)
    assert pair_ids.shape == (rows,) and block_expert.shape == (rows // block_m,)
    used = int(num_padded)
    assert used % block_m == 0 and used <= rows
    assert (pair_ids[used:] == num_pairs).all()  # past the end: padding only
    real = pair_ids[:used][pair_ids[:used] < num_pairs].long()
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    flat = chosen.reshape(-1).cpu()
    counts = torch.bincount(flat, minlength=experts)
    for block in range(used // block_m):
        ids = pair_ids[block * block_m:(block + 1) * block_m].long().cpu()
        ids = ids[ids < num_pairs]
        assert len(ids) > 0  # no block is all padding
        assert (flat[ids] == int(block_expert[block])).all()
    # Each used expert's run is its count rounded up to whole blocks.
    runs = torch.bincount(block_expert[:used // block_m].long().cpu(), minlength=experts)
    assert torch.equal(runs, (counts + block_m - 1) // block_m)


# ------------------------------------------------------------------------- the model block


def _loaded(path: str, dtype: torch.dtype):
    """The model at ``path`` loaded as the engine loads it, minus CPU prepacking (plain
    ``nn.Linear`` experts, which the fused path takes)."""
    from transformers import AutoConfig

    from llmlab.models.loader import load_model

    return load_model(path, AutoConfig.from_pretrained(path), dtype, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", MOE)
def test_the_fused_block_equals_the_grouped_block(tiny_model_factory, arch, dtype):
    model = _loaded(tiny_model_factory(arch), dtype)
    block = model.moe_blocks()[0]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(80, model.spec.hidden_size, generator=gen).to(dtype).to(DEVICE)
    grouped = block(x)
    parameters = {n: p.clone() for n, p in block.named_parameters()}
    routed = []
    route = block.route
    block.route = lambda h: routed.append(1) or route(h)
    assert block.stack_experts()
    fused = block(x)
    assert len(routed) == 1  # route() runs once a forward, on either path
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert rel_err(fused, grouped) < tol
    # The experts' parameters keep their names and values, now as views of the stack.
    assert {n: p for n, p in block.named_parameters()}.keys() == parameters.keys()
    w13, w2 = block.stacked.w13, block.stacked.w2
    for index, expert in enumerate(block.experts):
        assert torch.equal(expert.gate_up_proj.weight,
                           parameters[f"experts.{index}.gate_up_proj.weight"])
        assert expert.gate_up_proj.weight.data_ptr() == w13[index].data_ptr()
        assert expert.down_proj.weight.data_ptr() == w2[index].data_ptr()
    # The grouped path still reads the same (shared) weights.
    assert rel_err(block.run_grouped(x, *route(x)), grouped) == 0


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_expert_parallel_shards_add_up_to_the_whole_block(tiny_model_factory, num_ranks):
    """Blocks built as ranks of an expert-parallel group (whole experts, a run each; 3 ranks
    over 4 experts: uneven) hold their experts' weights; each rank's grouped and fused
    partial sums agree, and the ranks' sums are the one-rank block's output."""
    import copy

    from llmlab.distributed.parallel_state import TensorParallel
    from llmlab.models.moe import SparseMoeBlock

    model = _loaded(tiny_model_factory("MixtralForCausalLM"), torch.float32)
    whole = model.moe_blocks()[0]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, model.spec.hidden_size, generator=gen).to(DEVICE)
    weights, chosen = whole.route(x)
    want = whole.run_grouped(x, weights, chosen)
    grouped_sum, fused_sum = torch.zeros_like(want), torch.zeros_like(want)
    for rank in range(num_ranks):
        tp = TensorParallel(rank, num_ranks, expert_parallel=True)
        with torch.device("meta"):
            part = SparseMoeBlock(model.spec, model.moe, tp)
        part = part.to_empty(device=DEVICE)
        held = part.expert_range
        assert len(part.experts) == len(held) and held.stop <= whole.num_experts
        part.gate = whole.gate
        part.experts = copy.deepcopy(whole.experts[held.start:held.stop])
        grouped = part.run_grouped(x, weights, chosen)
        assert part.stack_experts()
        fused = part.run_fused(x, weights, chosen)
        assert rel_err(fused, grouped) < 1e-5
        grouped_sum += grouped
        fused_sum += fused
    assert rel_err(grouped_sum, want) < 1e-6
    assert rel_err(fused_sum, want) < 1e-5


def test_stacking_keeps_one_copy_of_the_weights(tiny_model_factory):
    model = _loaded(tiny_model_factory("MixtralForCausalLM"), torch.float32)

    def storage_bytes():
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                    for p in model.parameters()}
        return sum(storages.values())

    before = storage_bytes()
    assert model.stack_experts() == len(model.moe_blocks()) == model.spec.num_layers
    assert storage_bytes() == before


@pytest.mark.parametrize("arch", MOE)
def test_an_engine_on_the_fused_path_matches_hf_greedy(tiny_model_factory, arch):
    from llmlab import LLM, SamplingParams
    from tests.engine.test_hf_parity import NUM_NEW_TOKENS, hf_greedy

    path, prompts, expected = hf_greedy(tiny_model_factory(arch), seed=0)
    llm = LLM(path, dtype="float32", seed=0, cpu_linear="plain", device=str(DEVICE))
    model = llm.llm_engine.executor.model
    if DEVICE.type != "cuda":  # the engine builder stacks on CUDA only
        assert model.stack_experts() == len(model.moe_blocks())
    assert all(block.stacked is not None for block in model.moe_blocks())
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_a_failed_check_keeps_the_grouped_path(tiny_model_factory, monkeypatch, caplog):
    model = _loaded(tiny_model_factory("OlmoeForCausalLM"), torch.float32)
    monkeypatch.setattr(SparseMoeBlock, "run_fused",
                        lambda self, x, weights, chosen: torch.zeros_like(x))
    with caplog.at_level(logging.WARNING, logger="llmlab.models.moe"):
        assert model.stack_experts() == 0
    assert "differs from the grouped path" in caplog.text
    assert all(block.stacked is None for block in model.moe_blocks())


def test_the_check_passes_on_real_weights(tiny_model_factory):
    model = _loaded(tiny_model_factory("Qwen3MoeForCausalLM"), torch.bfloat16)
    block = model.moe_blocks()[0]
    assert block.stack_experts()
    assert check_fused(block) is None


# ------------------------------------------------------------------ what stays grouped


def test_on_cpu_the_experts_are_onednn_prepacked_like_the_dense_layers(tiny_model_factory):
    from llmlab import LLM
    from llmlab.kernels.cpu_linear import PackedLinear, onednn_unavailable_reason

    if onednn_unavailable_reason() is not None:
        pytest.skip(onednn_unavailable_reason())
    model = LLM(tiny_model_factory("MixtralForCausalLM"), dtype="float32",
                device="cpu").llm_engine.executor.model
    for block in model.moe_blocks():
        for expert in block.experts:
            assert isinstance(expert.gate_up_proj, PackedLinear)
            assert isinstance(expert.down_proj, PackedLinear)
        assert not block.fusable() and block.stacked is None
    assert isinstance(model.layers[0].self_attn.qkv_proj, PackedLinear)


def test_quantized_experts_keep_the_grouped_path(tiny_model_factory):
    from llmlab import LLM
    from llmlab.quantization.base import QuantizedLinear

    model = LLM(tiny_model_factory("Qwen3MoeForCausalLM"), dtype="float32",
                quantization="int8", cpu_linear="plain", device="cpu").llm_engine \
        .executor.model
    block = model.moe_blocks()[0]
    assert isinstance(block.experts[0].gate_up_proj, QuantizedLinear)
    assert not block.fusable()
    assert model.stack_experts() == 0
    assert block.stacked is None

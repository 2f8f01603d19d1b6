"""The simulator prices mixture-of-experts steps: model shapes with experts from the MoE
configs (parameter counts exact against transformers' models), FLOPs by active parameters
(a dense model of as many prices the same), weight bytes by the experts a step reads (one
token: top_k per layer; a long prefill: all; in between the expected number, checked by
sampling), the busiest expert's pace (more imbalance costs more), and the routing read
from recorded expert loads."""

from __future__ import annotations

import random

import pytest
import transformers

from llmlab.models.expert_load import ExpertLoad
from llmlab.sim import ExpertRouting, ModelShape, RooflineCostModel
from llmlab.sim.roofline import Hardware, HostCost
from llmlab.sim.shape import BatchShape

TINY = {"vocab_size": 100, "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 32,
        "intermediate_size": 48, "num_key_value_heads": 2}
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**TINY, num_local_experts=4,
                                                  num_experts_per_tok=2),
    # A dense first layer (mlp_only_layers) and narrower experts.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **TINY, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
        mlp_only_layers=[0]),
    # Sparse every second layer.
    "qwen3_moe-step": lambda: transformers.Qwen3MoeConfig(
        **TINY, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
        decoder_sparse_step=2),
    "olmoe": lambda: transformers.OlmoeConfig(**TINY, num_experts=8, num_experts_per_tok=2),
}
NO_HOST = HostCost(per_step_s=0, per_request_s=0, per_token_s=0, per_admission_s=0,
                   executor_per_step_s=0, executor_per_request_s=0)
HW = Hardware("toy", matmul_flops_per_s=1e9, memory_bytes_per_s=1e8, memory_bytes=1e12)

# By hand: 2 layers, both sparse, 6 experts of width 24 of which a token picks 2; hidden 8,
# 2 query heads and 1 KV head of 4: small enough to check every count on paper.
MOE = ModelShape(hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                 intermediate_size=24, vocab_size=16, num_experts=6, num_experts_per_tok=2)
ATTENTION = 8 * 8 + 2 * 8 * 4 + 8 * 8  # q, k, v, o
EXPERT = 3 * 8 * 24
ROUTER = 8 * 6


def prefill(tokens: int) -> BatchShape:
    return BatchShape(num_requests=1, num_prefill_tokens=tokens, num_prefill_requests=1,
                      num_sampled=1, context_tokens=tokens,
                      attention_positions=tokens * (tokens + 1) // 2, num_admitted=1)


def decode(contexts: list[int]) -> BatchShape:
    return BatchShape(num_requests=len(contexts), num_decode_requests=len(contexts),
                      num_sampled=len(contexts), context_tokens=sum(contexts),
                      attention_positions=sum(contexts))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_shapes_count_the_hf_models_weight_matrices(name):
    config = CONFIGS[name]()
    shape = ModelShape.from_hf_config(config)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert shape.num_parameters() == sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    assert ModelShape.from_hf_config(config.to_dict()) == shape
    sparse = {"mixtral": 4, "qwen3_moe": 3, "qwen3_moe-step": 2, "olmoe": 4}[name]
    assert shape.num_sparse_layers == sparse and shape.is_moe
    # What one token runs: every expert but top_k idle in each sparse layer.
    idle = shape.num_experts - shape.num_experts_per_tok
    assert shape.num_active_parameters() == (
        shape.num_parameters_read() - sparse * idle * shape.expert_parameters())


def test_a_qwen3_moe_config_of_older_transformers_names_its_experts_num_experts():
    as_dict = CONFIGS["qwen3_moe"]().to_dict()
    as_dict["num_experts"] = as_dict.pop("num_local_experts")
    assert ModelShape.from_hf_config(as_dict) == ModelShape.from_hf_config(CONFIGS["qwen3_moe"]())


def test_by_hand():
    assert MOE.expert_parameters() == EXPERT
    assert MOE.num_parameters() == 16 * 8 * 2 + 2 * (ATTENTION + ROUTER + 6 * EXPERT)
    assert MOE.num_active_parameters() == 16 * 8 + 2 * (ATTENTION + ROUTER + 2 * EXPERT)
    assert MOE.linear_flops_per_token() == 2 * 2 * (ATTENTION + ROUTER + 2 * EXPERT)
    assert MOE.expert_flops_per_token() == 2 * 2 * 2 * EXPERT


def test_a_dense_model_of_the_same_active_parameters_prices_the_same_flops():
    # The dense MLP's width that holds what a token runs in a sparse layer: 2 experts of 24
    # plus the router's 8 x 6 weights (3 * 8 * 2 = 48 of them: 2 more columns).
    dense = ModelShape(hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                       intermediate_size=2 * 24 + 2, vocab_size=16)
    assert dense.num_active_parameters() == MOE.num_active_parameters()
    moe_cost, dense_cost = (RooflineCostModel(m, HW, host=NO_HOST) for m in (MOE, dense))
    for shape in (prefill(1), prefill(300), decode([5, 9, 40])):
        assert moe_cost.flops(shape) == dense_cost.flops(shape)
    # ... but not the same bytes: the MoE model holds (and a long prefill reads) every expert.
    assert moe_cost.bytes(prefill(300)) > dense_cost.bytes(prefill(300))


def test_a_decode_of_one_token_reads_top_k_experts_and_a_long_prefill_reads_all():
    cost = RooflineCostModel(MOE, HW, host=NO_HOST, dtype_bytes=2)
    everything_else = MOE.num_parameters_read() - 2 * 6 * EXPERT
    one = decode([10])
    assert cost.weights_read_bytes(one) == pytest.approx(
        2 * (everything_else + 2 * 2 * EXPERT))  # 2 sparse layers x top_k 2
    assert MOE.expected_experts_read(1) == pytest.approx(2 * 2)
    assert cost.weights_read_bytes(prefill(512)) == pytest.approx(cost.weight_bytes)
    assert MOE.expected_experts_read(512) == pytest.approx(2 * 6)
    # In between, more tokens read more experts, never more than all of them.
    reads = [MOE.expected_experts_read(t) for t in (1, 2, 3, 5, 8, 16)]
    assert reads == sorted(reads) and reads[-1] < 12


def test_the_expected_experts_are_what_random_routing_reads():
    """Checked by sampling: each token picks top_k distinct experts uniformly at random."""
    rng = random.Random(0)
    for tokens in (1, 2, 3, 6):
        runs = 4000
        distinct = sum(
            len({e for _ in range(tokens) for e in rng.sample(range(6), 2)}) for _ in range(runs))
        assert MOE.expected_experts_read(tokens) / 2 == pytest.approx(distinct / runs, rel=0.03)


def test_more_imbalance_costs_more():
    times, flops = [], []
    for imbalance in (1.0, 1.5, 3.0):
        cost = RooflineCostModel(MOE, HW, host=NO_HOST, experts=ExpertRouting(imbalance=imbalance))
        flops.append(cost.flops(prefill(400)))
        times.append(cost.step_time(prefill(400)))  # compute-bound: the FLOPs decide
    assert flops[0] < flops[1] < flops[2] and times[0] < times[1] < times[2]
    # The experts' part alone is stretched: the rest of the step is not.
    assert flops[2] - flops[0] == pytest.approx(400 * 2.0 * MOE.expert_flops_per_token())
    # The busiest expert's bound: with a load's imbalance, the experts' FLOPs are the
    # busiest expert's tokens through every expert's share (as if each ran that many).
    load = ExpertLoad((0, 1), ((300, 100, 100, 100, 100, 100),) * 2, top_k=2)  # 400 tokens
    cost = RooflineCostModel(MOE, HW, host=NO_HOST,
                             experts=ExpertRouting(imbalance=max(load.imbalance())))
    balanced = RooflineCostModel(MOE, HW, host=NO_HOST)
    per_expert_token = 2 * EXPERT * MOE.num_sparse_layers
    assert cost.flops(prefill(400)) - balanced.flops(prefill(400)) == pytest.approx(
        (300 * 6 - 400 * 2) * per_expert_token)
    # A dense model has no experts: the routing changes nothing.
    dense = ModelShape(hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                       intermediate_size=50, vocab_size=16)
    a, b = (RooflineCostModel(dense, HW, experts=ExpertRouting(imbalance=i)) for i in (1, 4))
    assert a.step_time(prefill(64)) == b.step_time(prefill(64))


def test_recorded_loads_give_the_shares_and_the_imbalance():
    # Layer 0 always picks experts 0 and 1; layer 1 spreads evenly.
    loads = [ExpertLoad((0, 1), ((3, 3, 0, 0, 0, 0), (1, 1, 1, 1, 1, 1)), top_k=2),
             ExpertLoad((0, 1), ((1, 1, 0, 0, 0, 0), (0, 1, 0, 1, 0, 0)), top_k=2)]
    routing = ExpertRouting.from_loads(loads)
    assert routing.shares == ((1.0, 1.0, 0, 0, 0, 0), (0.25, 0.5, 0.25, 0.5, 0.25, 0.25))
    # Over the run's totals: layer 0 busiest 4 over a mean of 8/6; layer 1 2 over 8/6.
    assert routing.imbalance == pytest.approx((4 / (8 / 6) + 2 / (8 / 6)) / 2)
    # Layer 0 reads 2 experts however many tokens come; layer 1 fewer than uniform's.
    assert MOE.expected_experts_read(1000, routing.shares) == pytest.approx(2 + 6)
    assert MOE.expected_experts_read(3, routing.shares) < MOE.expected_experts_read(3)
    # Step events work too (those without a load are skipped).
    events = [type("Event", (), {"expert_load": load})() for load in (*loads, None)]
    assert ExpertRouting.from_loads(events) == routing
    cost = RooflineCostModel(MOE, HW, host=NO_HOST, experts=routing)
    uniform = RooflineCostModel(MOE, HW, host=NO_HOST)
    assert cost.bytes(prefill(1000)) < uniform.bytes(prefill(1000))


def test_bad_values_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"imbalance must be >= 1.0, got 0.5"):
        ExpertRouting(imbalance=0.5)
    with pytest.raises(ValueError, match="no expert load to read: record the run"):
        ExpertRouting.from_loads([])
    with pytest.raises(ValueError, match=r"expert shares must be 2 rows .* of 6"):
        RooflineCostModel(MOE, HW, experts=ExpertRouting(shares=[[0.5, 0.5]]))
    with pytest.raises(TypeError, match="experts must be an ExpertRouting"):
        RooflineCostModel(MOE, HW, experts=2.0)
    fields = {f.name: getattr(MOE, f.name) for f in MOE.__attrs_attrs__}
    with pytest.raises(ValueError, match="num_experts_per_tok=7 must be between 1 and "
                                         r"num_experts \(6\)"):
        ModelShape(**{**fields, "num_experts_per_tok": 7})
    with pytest.raises(ValueError, match="num_sparse_layers=3 must be between 1 and"):
        ModelShape(**{**fields, "num_sparse_layers": 3})
    with pytest.raises(ValueError, match="need experts: num_experts is 0"):
        ModelShape(**{**fields, "num_experts": 0})


def test_the_simulated_engine_prices_an_moe_model_and_refuses_recording_its_load(
        tiny_model_factory):
    from llmlab.experiments import mixed_long_short, run_workload
    from llmlab.sim import sim_engine

    path = tiny_model_factory("MixtralForCausalLM")
    engine = sim_engine(path, hardware="h100", num_gpu_blocks_override=64, max_num_seqs=4)
    assert engine.executor.cost_model.model.num_experts == 4
    workload = mixed_long_short(8, vocab_size=400, long_prompt_len=200, long_output_len=16,
                                rate=100.0, seed=0, low=2)
    records, _ = run_workload(engine, workload)
    assert len(records) == 8
    with pytest.raises(ValueError, match="does not model record_expert_load=True"):
        sim_engine(path, hardware="h100", record_expert_load=True)

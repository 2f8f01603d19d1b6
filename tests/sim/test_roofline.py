"""``llmlab.sim.roofline``: model shapes from Hugging Face configs (parameter counts exact
against the real models), the roofline arithmetic on hand-computed steps, hardware
presets, the measured "this_machine", and validation."""

from __future__ import annotations

import math
import types

import pytest
import transformers

from llmlab.sim.cost_model import CostModel, step_time
from llmlab.sim.roofline import (
    Hardware,
    HostCost,
    ModelShape,
    RateCurve,
    RooflineCostModel,
    hardware,
    hardware_names,
)
from llmlab.sim.shape import BatchShape

TINY = {"vocab_size": 100, "num_hidden_layers": 2, "num_attention_heads": 4}
LLAMA_LIKE = {**TINY, "hidden_size": 32, "intermediate_size": 48, "num_key_value_heads": 2}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**LLAMA_LIKE),
    "mistral": lambda: transformers.MistralConfig(**LLAMA_LIKE),
    "qwen2": lambda: transformers.Qwen2Config(**LLAMA_LIKE),
    "qwen3-tied": lambda: transformers.Qwen3Config(
        **LLAMA_LIKE, head_dim=16, tie_word_embeddings=True
    ),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    ),
    "opt": lambda: transformers.OPTConfig(
        **TINY, hidden_size=32, ffn_dim=48, max_position_embeddings=64
    ),
    "opt-projected": lambda: transformers.OPTConfig(  # OPT-350m's narrower embeddings
        **TINY, hidden_size=32, ffn_dim=48, max_position_embeddings=64, word_embed_proj_dim=16
    ),
}

# A toy model whose per-token costs are easy by hand: per layer q 4x4, k and v 4x2, o 4x4,
# gate/up/down 3 x 4x8 = 144 weights -> 288 FLOPs; two layers -> 576 FLOPs per token.
TOY = ModelShape(
    hidden_size=4, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2,
    intermediate_size=8, vocab_size=10,
)
TOY_WEIGHT_BYTES = (10 * 4 + 2 * 144) * 2  # untied: the LM head, not the embedding lookup
NO_HOST = HostCost(per_step_s=0, per_request_s=0, per_token_s=0, per_admission_s=0,
                   executor_per_step_s=0, executor_per_request_s=0)
TOY_HW = Hardware("toy", matmul_flops_per_s=1e6, memory_bytes_per_s=1e5, memory_bytes=1e9)


def prefill(tokens: int) -> BatchShape:
    return BatchShape(
        num_requests=1, num_prefill_tokens=tokens, num_prefill_requests=1, num_sampled=1,
        context_tokens=tokens, attention_positions=tokens * (tokens + 1) // 2, num_admitted=1,
    )


def decode(contexts: list[int]) -> BatchShape:
    """One decode per request; ``contexts``: each one's context after the step."""
    return BatchShape(
        num_requests=len(contexts), num_decode_requests=len(contexts),
        num_sampled=len(contexts), context_tokens=sum(contexts),
        attention_positions=sum(contexts),
    )


# ---------------------------------------------------------------------------- ModelShape


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_num_parameters_is_the_hf_models_weight_matrices(name):
    config = CONFIGS[name]()
    shape = ModelShape.from_hf_config(config)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # parameters() yields a tied matrix once; 1-D ones (norm scales, biases) are left out.
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    assert shape.num_parameters() == matrices
    assert shape.num_layers == 2 and shape.vocab_size == 100
    assert shape.tie_word_embeddings == config.tie_word_embeddings


def test_each_family_reads_its_own_config_names():
    gpt2 = ModelShape.from_hf_config(CONFIGS["gpt2"]())
    assert (gpt2.hidden_size, gpt2.num_heads, gpt2.num_kv_heads, gpt2.head_dim) == (32, 4, 4, 8)
    assert gpt2.intermediate_size == 4 * 32 and not gpt2.gated_mlp  # n_inner None: 4 * n_embd
    assert gpt2.num_position_embeddings == 64
    opt = ModelShape.from_hf_config(CONFIGS["opt-projected"]())
    assert (opt.num_kv_heads, opt.intermediate_size, opt.gated_mlp) == (4, 48, False)
    assert (opt.word_embed_dim, opt.num_position_embeddings) == (16, 64 + 2)
    qwen3 = ModelShape.from_hf_config(CONFIGS["qwen3-tied"]())
    assert (qwen3.num_kv_heads, qwen3.head_dim, qwen3.gated_mlp) == (2, 16, True)
    llama = ModelShape.from_hf_config(CONFIGS["llama"]())
    assert (llama.head_dim, llama.num_position_embeddings, llama.word_embed_dim) == (8, 0, 32)


def test_plain_dicts_attribute_objects_and_model_dirs_give_the_same_shape(tmp_path):
    for name in ("llama", "gpt2", "opt"):
        config = CONFIGS[name]()
        expected = ModelShape.from_hf_config(config)
        as_dict = config.to_dict()
        assert ModelShape.from_hf_config(as_dict) == expected
        assert ModelShape.from_hf_config(types.SimpleNamespace(**as_dict)) == expected
        # Without model_type the family comes from the key names.
        assert ModelShape.from_hf_config({**as_dict, "model_type": ""}) == expected
        config.save_pretrained(tmp_path / name)  # config.json only, no weights
        assert ModelShape.from_pretrained(tmp_path / name) == expected


def test_unknown_model_types_and_missing_keys_are_refused():
    with pytest.raises(ValueError, match="model_type 'mamba'.*known: gpt2, llama"):
        ModelShape.from_hf_config({**LLAMA_LIKE, "model_type": "mamba"})
    with pytest.raises(ValueError, match="no 'intermediate_size'"):
        ModelShape.from_hf_config({**TINY, "hidden_size": 32})


def test_per_token_costs_by_hand():
    assert TOY.layer_linear_flops_per_token() == 288
    assert TOY.linear_flops_per_token() == 576
    assert TOY.lm_head_flops_per_token() == 2 * 4 * 10
    assert TOY.kv_bytes_per_token(2) == 2 * 2 * 1 * 2 * 2  # K and V, 2 layers, 1 head of 2
    assert TOY.attention_flops_per_layer(5) == 4 * 5 * 2 * 2
    assert TOY.attention_flops_per_position() == 2 * 16
    assert TOY.num_parameters() == 40 + 288 + 40
    # A lookup table is not read in full: the untied embedding drops out, a tied one stays.
    assert TOY.num_parameters_read() == 288 + 40
    tied = ModelShape(**{**_fields(TOY), "tie_word_embeddings": True})
    assert tied.num_parameters() == tied.num_parameters_read() == 40 + 288
    # Not gated: up and down only; learned positions count as parameters, not as reads.
    plain = ModelShape(**{**_fields(TOY), "gated_mlp": False, "num_position_embeddings": 3})
    assert plain.layer_linear_flops_per_token() == 2 * (48 + 64)
    assert plain.num_parameters() - plain.num_parameters_read() == 40 + 3 * 4


def _fields(shape: ModelShape) -> dict:
    return {f.name: getattr(shape, f.name) for f in shape.__attrs_attrs__}


# ---------------------------------------------------------------------------- step times


def test_a_long_prefill_is_compute_bound():
    model = RooflineCostModel(TOY, TOY_HW, host=NO_HOST)
    assert model.weight_bytes == TOY_WEIGHT_BYTES == 656
    shape = prefill(100)
    flops = 100 * 576 + 1 * 80 + 5050 * 32
    assert model.flops(shape) == flops == 219_280
    assert model.bytes(shape) == 656 + (100 + 100) * 16  # weights, KV read, KV written
    assert model.step_time(shape) == pytest.approx(flops / 1e6)
    assert model.compute_time(shape) > model.memory_time(shape)


def test_a_decode_step_is_memory_bound_and_grows_with_context():
    model = RooflineCostModel(TOY, TOY_HW, host=NO_HOST)
    shape = decode([10, 20, 30, 40])
    assert model.flops(shape) == 4 * 576 + 4 * 80 + 100 * 32
    assert model.bytes(shape) == 656 + (100 + 4) * 16
    assert model.step_time(shape) == pytest.approx(2320 / 1e5)
    longer = model.step_time(decode([50, 50, 50, 50]))
    assert longer == pytest.approx((656 + 204 * 16) / 1e5) and longer > model.step_time(shape)


def test_host_time_is_added_and_an_empty_step_costs_only_host_time():
    host = HostCost(per_step_s=1.0, per_request_s=0.1, per_token_s=0.01, per_admission_s=0.5,
                    executor_per_step_s=0.2, executor_per_request_s=0.03)
    model = RooflineCostModel(TOY, TOY_HW, host=host)
    shape = prefill(100)
    assert host.hidden_time(shape) == pytest.approx(1.0 + 0.1 + 0.5)
    assert host.unhidden_time(shape) == pytest.approx(0.2 + 0.03 + 0.01 * 100)
    assert host.time(shape) == pytest.approx(1.6 + 1.23)
    assert model.step_time(shape) == pytest.approx(0.21928 + 2.83)
    idle = BatchShape(num_admitted=2, num_preempted=1)
    assert model.step_time(idle) == pytest.approx(1.0 + 2 * 0.5 + 0.2)
    assert RooflineCostModel(TOY, TOY_HW).host == HostCost()  # the defaults: a modelled term
    assert HostCost().time(BatchShape()) == pytest.approx(
        HostCost().per_step_s + HostCost().executor_per_step_s)


def test_efficiencies_scale_their_own_side():
    model = RooflineCostModel(TOY, TOY_HW, host=NO_HOST, compute_efficiency=0.5)
    assert model.step_time(prefill(100)) == pytest.approx(0.21928 / 0.5)
    assert model.step_time(decode([10, 20, 30, 40])) == pytest.approx(0.0232)  # memory side
    model = RooflineCostModel(TOY, TOY_HW, host=NO_HOST, memory_efficiency=0.25)
    assert model.step_time(decode([10, 20, 30, 40])) == pytest.approx(0.0232 / 0.25)


def test_a_rate_curve_prices_each_step_at_its_own_rows():
    curve = RateCurve((1, 100), (1e4, 1e6))
    slow_small = Hardware("curve", 1e6, 1e30, 1e9, flops_curve=curve)
    model = RooflineCostModel(TOY, slow_small, host=NO_HOST)
    assert model.step_time(prefill(100)) == pytest.approx(219_280 / 1e6)
    assert model.step_time(decode([10])) == pytest.approx((576 + 80 + 320) / curve(1))
    assert slow_small.matmul_rate(10) == pytest.approx(curve(10))


def test_weight_bytes_and_dtype_bytes_can_be_given():
    model = RooflineCostModel(TOY, TOY_HW, dtype_bytes=4, weight_bytes=1000, host=NO_HOST)
    assert model.bytes(decode([10])) == 1000 + 11 * TOY.kv_bytes_per_token(4)
    assert RooflineCostModel(TOY, TOY_HW, dtype_bytes=4).weight_bytes == 328 * 4


def test_it_is_a_cost_model_the_simulator_accepts():
    model = RooflineCostModel(TOY, "h100")
    assert isinstance(model, CostModel)
    assert step_time(model, decode([10, 20])) > HostCost().time(decode([10, 20]))


def test_the_benchmark_roofline_prices_a_step_the_same_way():
    from benchmarks.common import StepCostModel, StepWork

    costs = StepCostModel.for_model(TOY, TOY.num_parameters_read(), dtype_bytes=2)
    model = RooflineCostModel(TOY, TOY_HW)
    for shape in (prefill(7), decode([3, 9])):
        work = StepWork(
            shape.num_tokens, shape.num_sampled, shape.context_tokens,
            shape.attention_positions, shape.is_decode, 0.0,
        )
        assert (costs.flops(work), costs.bytes(work)) == (model.flops(shape), model.bytes(shape))


# ---------------------------------------------------------------------------- hardware


def test_presets_aliases_and_the_unknown_name_error(tmp_path):
    h100 = hardware("h100")
    assert h100 is hardware("h100_sxm") is hardware("H100")
    assert (h100.matmul_flops_per_s, h100.memory_bytes_per_s) == (989.4e12, 3.35e12)
    assert h100.memory_bytes == 80 * 2**30
    assert hardware("h200").memory_bytes_per_s == 4.8e12
    assert hardware("a100") is hardware("a100_80gb")
    assert hardware("a100").matmul_flops_per_s == 312e12
    assert (hardware("l4").matmul_flops_per_s, hardware("l4").memory_bytes_per_s) == (121e12, 3e11)
    assert hardware(h100) is h100
    assert set(hardware_names()) >= {"h100", "h100_sxm", "h200", "a100", "a100_80gb", "l4",
                                     "this_machine"}
    with pytest.raises(ValueError, match="unknown hardware 'tpu'; known: a100, a100_80gb, h100"):
        hardware("tpu")
    with pytest.raises(TypeError, match="hardware must be"):
        hardware(3)
    with pytest.raises(ValueError, match="unknown hardware 'b200'.*this_machine"):
        RooflineCostModel(TOY, "b200")

    # for_model: a model directory or a config, a preset, a dtype name.
    config = CONFIGS["qwen3-tied"]()
    config.save_pretrained(tmp_path)
    model = RooflineCostModel.for_model(tmp_path, "h200", dtype="float32", memory_efficiency=0.8)
    shape = ModelShape.from_hf_config(config)
    assert (model.model, model.hardware, model.dtype_bytes) == (shape, hardware("h200"), 4)
    assert model.weight_bytes == shape.num_parameters_read() * 4
    assert model.memory_efficiency == 0.8
    assert RooflineCostModel.for_model(config, "l4").dtype_bytes == 2  # bf16 on a GPU


def test_this_machine_is_measured_once_per_process():
    measured = hardware("this_machine")
    for rate in (measured.matmul_flops_per_s, measured.memory_bytes_per_s, measured.memory_bytes):
        assert rate > 0 and math.isfinite(rate)
    assert measured.flops_curve is not None
    assert measured.flops_curve.peak == measured.matmul_flops_per_s
    assert Hardware.measure() is measured and Hardware.measure("fp32", "cpu") is measured
    model = RooflineCostModel.for_model(TOY)  # this_machine, float32: the same measurement
    assert model.hardware is measured and model.dtype_bytes == 4
    assert 0 < model.step_time(decode([10])) < 1


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: HostCost(per_step_s=-1), "per_step_s must be >= 0, got -1.0"),
        (lambda: HostCost(per_request_s=math.nan), "per_request_s must be a finite"),
        (lambda: HostCost(per_token_s=math.inf), "per_token_s must be a finite"),
        (lambda: HostCost(per_admission_s=-1e-9), "per_admission_s must be >= 0"),
        (lambda: HostCost(executor_per_step_s=-1), "executor_per_step_s must be >= 0"),
        (lambda: HostCost(executor_per_request_s=math.nan), "executor_per_request_s must be"),
        (lambda: RooflineCostModel(TOY, TOY_HW, compute_efficiency=0),
         r"compute_efficiency must be in \(0, 1\], got 0.0"),
        (lambda: RooflineCostModel(TOY, TOY_HW, memory_efficiency=1.5),
         r"memory_efficiency must be in \(0, 1\], got 1.5"),
        (lambda: RooflineCostModel(TOY, TOY_HW, dtype_bytes=0), "dtype_bytes must be >= 1"),
        (lambda: RooflineCostModel(TOY, TOY_HW, weight_bytes=-1), "weight_bytes must be >= 0"),
        (lambda: Hardware("x", 0, 1, 1), "matmul_flops_per_s must be > 0, got 0.0"),
        (lambda: Hardware("x", 1, math.inf, 1), "memory_bytes_per_s must be a finite"),
        (lambda: Hardware("x", 1, 1, -5), "memory_bytes must be > 0"),
        (lambda: Hardware("", 1, 1, 1), "name must be a non-empty str"),
        (lambda: ModelShape(**{**_fields(TOY), "hidden_size": 0}), "hidden_size must be >= 1"),
        (lambda: RateCurve((1, 2), (1.0, -1.0)), "flops_per_s must be > 0"),
        (lambda: RooflineCostModel.for_model(TOY, "l4", dtype="int3"), "unknown dtype 'int3'"),
    ],
)
def test_bad_values_are_refused_naming_the_field(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_wrong_types_are_refused():
    with pytest.raises(TypeError, match="host"):
        RooflineCostModel(TOY, TOY_HW, host=0.001)
    with pytest.raises(TypeError, match="model"):
        RooflineCostModel("not a shape", TOY_HW)
    with pytest.raises(TypeError, match="compute_efficiency"):
        RooflineCostModel(TOY, TOY_HW, compute_efficiency="high")


def test_this_machine_is_measured_once_and_read_back_by_every_later_process(tmp_path,
                                                                            monkeypatch):
    """The CPU measurement is saved (keyed by CPU, cores, torch, threads, dtype): a later
    process reads the same numbers, so a "this_machine" simulation is the same in every
    process; refresh=True measures again and replaces them."""
    import json
    import subprocess
    import sys

    from llmlab.sim import roofline
    from tests.helpers import subprocess_env

    monkeypatch.setenv("LLMLAB_CACHE_DIR", str(tmp_path))
    roofline._measure.cache_clear()
    try:
        first = roofline.Hardware.measure()
        assert len(list((tmp_path / "hardware").glob("this_machine-*.json"))) == 1
        code = ("import json, torch; torch.set_num_threads(%d); "
                "from llmlab.sim.roofline import Hardware; h = Hardware.measure(); "
                "print(json.dumps([h.matmul_flops_per_s, h.memory_bytes_per_s, "
                "list(h.flops_curve.flops_per_s)]))" % __import__("torch").get_num_threads())
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, env=subprocess_env(LLMLAB_CACHE_DIR=str(tmp_path)))
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout) == [first.matmul_flops_per_s, first.memory_bytes_per_s,
                                           list(first.flops_curve.flops_per_s)]
        monkeypatch.setattr(roofline, "_measure_cpu", lambda dtype: pytest.fail("re-measured"))
        roofline._measure.cache_clear()
        assert roofline.Hardware.measure() == first  # read back, not measured
        monkeypatch.undo()
        monkeypatch.setenv("LLMLAB_CACHE_DIR", str(tmp_path))
        calls = []
        measure_cpu = roofline._measure_cpu
        monkeypatch.setattr(roofline, "_measure_cpu",
                            lambda dtype: calls.append(dtype) or measure_cpu(dtype))
        roofline.Hardware.measure(refresh=True)
        assert calls == ["float32"]
    finally:
        roofline._measure.cache_clear()

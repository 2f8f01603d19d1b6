"""``benchmarks/throughput.py``: argument defaults per device, the roofline arithmetic over
``StepEvent``s, the context tracking it rests on, the GPU-trace parsing, and the CUDA
report's glue, all on CPU (the GPU-only parts are the two rate measurements and the
profiler, which the last test replaces by stand-ins)."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from benchmarks import throughput
from benchmarks.common import (
    ContextTracker,
    ModelShape,
    RateCurve,
    StepCostModel,
    StepWork,
    checkpoint_numel,
    device_busy_us,
    device_gaps_us,
    device_kernel_table,
    measure_cpu_matmul_rates,
    measure_cpu_rate_curve,
    measure_cpu_read_bytes_per_s,
    roofline,
    step_work,
    weight_elements_read,
)
from llmlab import LLM, EngineConfig, SamplingParams
from llmlab.cache import KVCacheManager
from llmlab.engine.engine import Engine
from llmlab.observe.events import StepEvent
from llmlab.runner.executor import VirtualClock
from llmlab.scheduler import FCFS, BatchOutput, Scheduler
from llmlab.scheduler.batch import Admission

# ---------------------------------------------------------------------------- arguments


def test_cpu_defaults_are_the_documented_cpu_workload():
    args = throughput.parse_args([])
    assert args.device == "cpu"
    assert args.num_requests == 64
    assert args.prompt_len_range == (16, 256) and args.output_len_range == (16, 128)
    assert args.max_num_batched_tokens == 2048
    assert args.modes == ["llmlab", "hf", "hf-static", "hf-cb"]
    assert args.warmup is True  # on prompts outside the workload
    assert throughput.parse_args(["--no-warmup"]).warmup is False
    assert (args.dtype, args.torch_dtype) == ("float32", torch.float32)
    assert args.hf_batch_sizes == [16, 32, 64]
    assert (args.decode_batch, args.decode_steps) == (64, 16)  # host work at 64 sequences
    args = throughput.parse_args(["--dtype", "bfloat16", "--hf-batch-sizes", "8,24"])
    assert (args.torch_dtype, args.hf_batch_sizes) == (torch.bfloat16, [8, 24])


def test_warmup_prompts_are_outside_the_workload():
    args = throughput.parse_args(["--num-requests", "16"])
    workload = throughput.make_workload(16, args.seed, 8000, args.prompt_len_range)
    warm = throughput.warmup_workload("llmlab", workload, args, 8000)
    timed = {tuple(p[:16]) for p in workload.prompts}
    assert warm.num_requests == throughput.WARMUP_REQUESTS
    assert not any(tuple(p[:16]) in timed for p in warm.prompts)


def test_cuda_switches_the_defaults(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = throughput.parse_args(["--device", "cuda"])
    assert args.num_requests == 256
    assert args.prompt_len_range == (100, 1024) and args.output_len_range == (100, 1024)
    assert args.max_num_batched_tokens == 8192
    assert args.max_num_seqs == 256 and args.hf_batch_size == 64
    assert args.gpu_memory_utilization == 0.85
    assert args.modes == ["llmlab", "hf"]
    assert args.warmup is True
    assert args.torch_dtype == torch.bfloat16
    assert (args.decode_batch, args.decode_steps) == (256, 32)
    # Anything given explicitly wins over the device's default.
    args = throughput.parse_args(
        ["--device", "cuda", "--num-requests", "8", "--no-warmup", "--only", "hf-cb",
         "--prompt-len-range", "5", "9", "--max-num-batched-tokens", "512"]
    )
    assert (args.num_requests, args.warmup, args.modes) == (8, False, ["hf-cb"])
    assert args.prompt_len_range == (5, 9) and args.max_num_batched_tokens == 512


def test_cuda_is_refused_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        throughput.parse_args(["--device", "cuda"])


def test_decode_sweep_passes_through_every_batch_size():
    sweep = throughput.decode_sweep_workload(5, seed=1, vocab_size=100, prompt_len_range=(3, 7))
    assert sweep.output_lens == [12, 11, 10, 9, 8]
    assert all(3 <= len(p) <= 7 for p in sweep.prompts)
    assert all(2 <= t < 100 for p in sweep.prompts for t in p)


# ---------------------------------------------------------------------------- step events


def event(scheduled, *, admitted=(), preempted=(), finished=(), sampled=None, wall=0.01):
    """A StepEvent with only what the roofline reads; by default every entry samples."""
    if sampled is None:
        sampled = tuple((rid, 1) for rid, _ in scheduled)
    return StepEvent(
        step_index=0,
        scheduled=tuple(scheduled),
        scheduled_users=(None,) * len(scheduled),
        scheduled_priorities=(0,) * len(scheduled),
        num_batched_tokens=sum(n for _, n in scheduled),
        preempted=tuple(preempted),
        finished=tuple(finished),
        aborted=(),
        blocks_allocated=(),
        blocks_freed=(),
        blocks_prefix_hit=(),
        blocks_evicted=(),
        blocks_forked=(),
        num_free_blocks=0,
        num_total_blocks=0,
        kv_usage=0.0,
        num_waiting=0,
        num_running=len(scheduled),
        wall_time_s=wall,
        model_time_s=wall,
        admitted=tuple(admitted),
        sampled=tuple(sampled),
    )


def admission(request_id, prompt_len, cached=0, resumed=False):
    return Admission(request_id, 0.0, prompt_len, prompt_len, cached, resumed)


def test_context_tracker_follows_chunks_decodes_prefix_hits_and_preemption():
    tracker = ContextTracker()
    # a: 10-token prompt in chunks of 6 + 4; b: 8-token prompt with 4 tokens cached.
    assert tracker.advance(event([("a", 6)], admitted=[admission("a", 10)], sampled=())) == [
        ("a", 0, 6)
    ]
    assert tracker.advance(event([("a", 4), ("b", 4)], admitted=[admission("b", 8, 4)])) == [
        ("a", 6, 4),
        ("b", 4, 4),
    ]
    assert tracker.advance(event([("a", 1), ("b", 1)])) == [("a", 10, 1), ("b", 8, 1)]
    # b is preempted (KV dropped), then resumed with 8 of its 10 tokens still cached.
    assert tracker.advance(event([("a", 1)], preempted=["b"])) == [("a", 11, 1)]
    assert "b" not in tracker.context
    assert tracker.advance(
        event([("a", 1), ("b", 2)], admitted=[admission("b", 10, 8, resumed=True)])
    ) == [("a", 12, 1), ("b", 8, 2)]
    # Finished requests are forgotten after their last step.
    assert tracker.advance(event([("a", 1), ("b", 1)], finished=[("a", "length")])) == [
        ("a", 13, 1),
        ("b", 10, 1),
    ]
    assert tracker.context == {"b": 11}


def test_step_work_and_roofline_arithmetic():
    events = [
        event([("a", 6)], admitted=[admission("a", 10)], sampled=(), wall=0.5),
        event([("a", 4), ("b", 3)], admitted=[admission("b", 3)], wall=0.25),
        event([("a", 1), ("b", 1)], wall=0.125, finished=[("a", "length"), ("b", "length")]),
    ]
    work = step_work(events)
    assert work == [
        StepWork(6, 0, 6, 21, False, 0.5),  # positions 1..6 attended
        StepWork(7, 2, 10 + 3, (4 * 6 + 10) + 6, False, 0.25),  # 7..10 and 1..3
        StepWork(2, 2, 11 + 4, 11 + 4, True, 0.125),
    ]
    shape = ModelShape(
        hidden_size=4, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2,
        intermediate_size=8, vocab_size=10,
    )
    costs = StepCostModel.for_model(shape, weight_elements=1000, dtype_bytes=2)
    assert costs.weight_bytes == 2000
    assert costs.kv_bytes_per_token == 2 * 2 * 1 * 2 * 2
    assert costs.linear_flops_per_token == 2 * 2 * (4 * 4 + 2 * 4 * 2 + 4 * 4 + 3 * 4 * 8)
    assert costs.lm_head_flops_per_row == 2 * 4 * 10
    assert costs.attention_flops_per_position == 2 * 4 * 2 * 2
    assert costs.bytes(work[2]) == 2000 + (15 + 2) * 16  # weights, K/V read, K/V written
    assert costs.flops(work[2]) == 2 * 576 + 2 * 80 + 15 * 32

    # Bandwidth so high that every step is compute-bound, then a rate so high that every
    # step is memory-bound.
    compute = roofline(work, costs, bytes_per_s=1e30, flops_per_s=1e3)
    assert compute.total_s == pytest.approx(sum(costs.flops(w) for w in work) / 1e3)
    assert compute.memory_bound_steps == 0 and compute.compute_bound_steps == 3
    memory = roofline(work, costs, bytes_per_s=1e3, flops_per_s=1e30)
    assert memory.total_s == pytest.approx(sum(costs.bytes(w) for w in work) / 1e3)
    assert memory.memory_bound_steps == 3
    assert memory.decode_steps == 1
    assert memory.decode_floor_s == pytest.approx(costs.bytes(work[2]) / 1e3)
    assert memory.decode_wall_s == 0.125 and memory.other_wall_s == 0.75
    assert memory.total_bytes == sum(costs.bytes(w) for w in work)
    assert memory.total_flops == compute.total_flops
    # Each step is floored by the larger of the two.
    mixed = roofline(work, costs, bytes_per_s=2000 / 0.001, flops_per_s=1e6)
    assert mixed.total_s == pytest.approx(
        sum(max(costs.bytes(w) / 2e6, costs.flops(w) / 1e6) for w in work)
    )
    # A rate that depends on the step's rows: each step is floored at its own rate.
    curve = RateCurve((1, 4, 16), (1e3, 4e3, 8e3))
    assert [curve(r) for r in (1, 2, 4, 8, 16, 100)] == pytest.approx(
        [1e3, 2.5e3, 4e3, 6e3, 8e3, 8e3]
    )
    by_rows = roofline(work, costs, bytes_per_s=1e30, flops_per_s=curve)
    assert by_rows.total_s == pytest.approx(sum(costs.flops(w) / curve(w.num_tokens) for w in work))


def test_rate_curves_are_checked_and_measured_on_the_models_shapes():
    with pytest.raises(ValueError, match="increasing"):
        RateCurve((4, 1), (1.0, 2.0))
    with pytest.raises(ValueError, match="as many rates"):
        RateCurve((1, 4), (1.0,))
    shape = ModelShape(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=100,
    )
    curve = measure_cpu_rate_curve(shape, rows=(1, 64), trial_time_s=0.002)
    assert curve.rows == (1, 64) and all(r > 0 for r in curve.flops_per_s)
    assert measure_cpu_read_bytes_per_s(num_bytes=1 << 22, num_trials=2) > 0


SMALL_SHAPE = ModelShape(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=100,
)  # fmt: skip
# One layer's projections (inner, cols): fused q/k/v, o, gate+up, down.
SMALL_PROJECTIONS = [(64, 128), (64, 64), (64, 256), (128, 64)]


def _fake_rate(base: float, fast_inner: int | None = None):
    """A stand-in kernel measurement: ``base * rows`` FLOP/s, 4x that on projections of
    width ``fast_inner`` (so two kernels can each win some projections)."""

    def measure(rows, inner, cols, num_trials, trial_time_s, dtype):
        return base * rows * (4.0 if inner == fast_inner else 1.0)

    return measure


def _weighted_rate(rows: int, rate_of) -> float:
    flops = sum(2 * rows * k * n for k, n in SMALL_PROJECTIONS)
    return flops / sum(2 * rows * k * n / rate_of(k) for k, n in SMALL_PROJECTIONS)


def test_the_rate_curve_takes_each_projection_at_its_fastest_kernel():
    kernels = {"slow": _fake_rate(1e9), "packed": _fake_rate(2e9, fast_inner=128),
               "other": _fake_rate(3e9)}  # fmt: skip
    got = measure_cpu_matmul_rates(SMALL_SHAPE, rows=(1, 4), kernels=kernels)
    assert got.rows == (1, 4) and got.skipped == {}
    for rows, i in ((1, 0), (4, 1)):
        assert got.by_kernel["slow"][i] == pytest.approx(1e9 * rows)
        assert got.by_kernel["other"][i] == pytest.approx(3e9 * rows)
        packed = _weighted_rate(rows, lambda k, r=rows: 2e9 * r * (4 if k == 128 else 1))
        assert got.by_kernel["packed"][i] == pytest.approx(packed)
        # "other" wins the 64-wide projections, "packed" (8e9 * rows) the 128-wide ones: the
        # curve beats every kernel's own whole-layer rate.
        best = _weighted_rate(rows, lambda k, r=rows: (8e9 if k == 128 else 3e9) * r)
        assert got.curve.flops_per_s[i] == pytest.approx(best)
        assert best > max(got.by_kernel[name][i] for name in kernels)
    assert got.fastest() == ("other", "other")
    # measure_cpu_rate_curve is that curve.
    curve = measure_cpu_rate_curve(SMALL_SHAPE, rows=(1, 4), kernels=kernels)
    assert curve == got.curve
    # Two measurements (before and after the benchmark's runs): each point at the higher.
    again = measure_cpu_matmul_rates(
        SMALL_SHAPE, rows=(1, 4), kernels={name: _fake_rate(2.5e9) for name in kernels}
    )
    both = got.best_of(again)
    assert both.by_kernel["slow"] == pytest.approx((2.5e9, 10e9))
    assert both.by_kernel["other"] == got.by_kernel["other"]
    assert both.curve.flops_per_s == got.curve.flops_per_s
    with pytest.raises(ValueError, match="same kernels"):
        got.best_of(measure_cpu_matmul_rates(SMALL_SHAPE, rows=(1,), kernels=kernels))


def test_the_default_rate_curve_includes_llmlabs_packed_linear(monkeypatch):
    """By default the curve is the best of torch.mm and the engine's own oneDNN linear (a
    torch.mm-only curve was beaten by llmlab: 121% of the roofline)."""
    from llmlab.kernels import cpu_linear
    from llmlab.sim import measure

    monkeypatch.setattr(cpu_linear, "onednn_unavailable_reason", lambda: None)
    monkeypatch.setattr(measure, "measure_matmul_flops_per_s", _fake_rate(1e9))
    monkeypatch.setattr(measure, "measure_packed_linear_flops_per_s", _fake_rate(5e9))
    got = measure_cpu_matmul_rates(SMALL_SHAPE, rows=(1, 16))
    assert set(got.by_kernel) == {measure.TORCH_MM, measure.LLMLAB_ONEDNN}
    assert got.curve.flops_per_s == pytest.approx((5e9, 16 * 5e9))
    assert got.fastest() == (measure.LLMLAB_ONEDNN,) * 2
    assert measure_cpu_rate_curve(SMALL_SHAPE, rows=(1, 16)).peak == pytest.approx(16 * 5e9)

    # A torch without oneDNN: torch.mm alone, and the skipped kernel says why.
    monkeypatch.setattr(cpu_linear, "onednn_unavailable_reason", lambda: "no oneDNN here")
    got = measure_cpu_matmul_rates(SMALL_SHAPE, rows=(1, 16))
    assert set(got.by_kernel) == {measure.TORCH_MM}
    assert got.skipped == {measure.LLMLAB_ONEDNN: "no oneDNN here"}
    assert got.curve.flops_per_s == pytest.approx((1e9, 16e9))


def test_the_packed_linear_rate_runs_the_engines_kernel():
    from llmlab.kernels.cpu_linear import onednn_unavailable_reason
    from llmlab.sim.measure import measure_packed_linear_flops_per_s

    if onednn_unavailable_reason() is not None:
        pytest.skip(onednn_unavailable_reason())
    assert measure_packed_linear_flops_per_s(3, 64, 96, num_trials=2, trial_time_s=0.001) > 0


def test_a_run_faster_than_its_roofline_fails(capsys):
    assert throughput.roofline_fraction(0.5, 1.0) == 0.5
    assert throughput.roofline_fraction(1.0, 1.0) == 1.0
    with pytest.raises(throughput.RooflineBeatenError, match=r"121\.0% of it.*not a floor"):
        throughput.roofline_fraction(1.21, 1.0)
    rates = {
        "read_bytes_per_s": 1e10, "matmul_rows": [1, 64], "matmul_flops_per_s": [2e9, 9e10],
        "matmul_flops_per_s_by_kernel": {"torch.mm": [1e9, 6e10], "llmlab oneDNN linear":
                                         [2e9, 9e10]},
        "matmul_kernels_skipped": {},
    }  # fmt: skip
    line = {"total_s": 1.21, "num_steps": 3, "memory_bound_steps": 1, "decode_floor_s": 0.2,
            "decode_wall_s": 0.3, "other_floor_s": 1.01, "other_wall_s": 0.7}  # fmt: skip
    result = throughput.RunResult("llmlab", 1.0, 10, 10, 20)
    with pytest.raises(throughput.RooflineBeatenError):
        throughput.print_cpu_roofline({"llmlab": result}, rates, line)
    # Under the floor's time it prints the fraction, and each kernel's rates beside it.
    throughput.print_cpu_roofline({"llmlab": attrs.evolve(result, wall_s=2.0)}, rates, line)
    text = capsys.readouterr().out
    assert "llmlab achieves 60.5% of the per-step roofline" in text
    assert "  torch.mm: 1: 1, 64: 60" in text and "  llmlab oneDNN linear: 1: 2, 64: 90" in text
    assert "each projection at its fastest kernel): 1: 2, 64: 90" in text


@attrs.define
class NextTokenExecutor:
    """Cost-model executor that records what each request really had cached per step."""

    clock: VirtualClock
    starts: list = attrs.field(factory=list)

    def execute(self, batch):
        self.starts.append([(e.request_id, e.start, e.num_new_tokens) for e in batch.entries])
        self.clock.advance(0.001 * (1 + batch.num_batched_tokens))
        return BatchOutput.from_lists(
            [[(e.token_ids[-1] + 1) % 50] * e.num_scored for e in batch.entries],
            [[-0.5] * e.num_scored for e in batch.entries],
        )


def test_tracked_contexts_match_the_scheduler_under_preemption_and_prefix_hits():
    clock = VirtualClock()
    kv = KVCacheManager(num_blocks=14, block_size=4)
    scheduler = Scheduler(kv=kv, max_num_seqs=4, max_num_batched_tokens=16,
                          max_model_len=256, policy=FCFS())
    executor = NextTokenExecutor(clock)
    engine = Engine(config=EngineConfig(model="cost-model"), scheduler=scheduler,
                    executor=executor, tokenizer=None, vocab_size=100, max_model_len=256,
                    eos_token_ids=frozenset(), clock=clock)
    events = []
    engine.subscribe(events.append)
    shared = list(range(60, 72))  # a 12-token prefix several prompts share
    prompts = [shared + [i] * (3 + i) for i in range(6)] + [[90 + i] * 9 for i in range(3)]
    outputs = [12, 9, 14, 7, 11, 10, 13, 8, 6]
    for i, (prompt, n) in enumerate(zip(prompts, outputs)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()

    assert any(e.preempted for e in events), "the cache should be too small for all four rows"
    assert any(a.num_cached_tokens for e in events for a in e.admitted), "expected prefix hits"
    tracker = ContextTracker()
    ran = [e for e in events if e.scheduled]
    assert len(ran) == len(executor.starts)
    for ev, truth in zip(ran, executor.starts):
        assert tracker.advance(ev) == truth
    work = step_work(events)
    assert sum(w.num_sampled for w in work) == sum(outputs)


# ---------------------------------------------------------------------------- weights


def test_weight_elements_count_a_tied_embedding_once_and_skip_an_untied_table():
    assert weight_elements_read({"model.embed_tokens.weight": 100, "model.norm.weight": 4}) == 104
    untied = {"model.embed_tokens.weight": 100, "lm_head.weight": 100, "model.norm.weight": 4}
    assert weight_elements_read(untied) == 104


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_checkpoint_weight_count_matches_the_model(tiny_model_factory, architecture):
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(architecture)
    model = AutoModelForCausalLM.from_pretrained(path)
    params = dict(model.named_parameters())  # tied parameters appear once
    expected = sum(p.numel() for p in params.values())
    if not model.config.tie_word_embeddings:
        expected -= model.get_input_embeddings().weight.numel()
    assert weight_elements_read(checkpoint_numel(path)) == expected


# ---------------------------------------------------------------------------- GPU trace


def test_device_busy_time_is_the_union_of_device_activities():
    trace = [
        {"ph": "X", "cat": "kernel", "ts": 0.0, "dur": 10.0},
        {"ph": "X", "cat": "kernel", "ts": 5.0, "dur": 10.0},  # overlaps: +5
        {"ph": "X", "cat": "gpu_memcpy", "ts": 20.0, "dur": 2.0},
        {"ph": "X", "cat": "Kernel", "ts": 21.0, "dur": 1.0},  # inside the memcpy
        {"ph": "X", "cat": "gpu_memset", "ts": 30.0, "dur": 0.5},
        {"ph": "X", "cat": "cpu_op", "ts": 0.0, "dur": 100.0},
        {"ph": "X", "cat": "cuda_runtime", "ts": 0.0, "dur": 100.0},
        {"ph": "X", "cat": "gpu_user_annotation", "ts": 0.0, "dur": 100.0},
        {"ph": "f", "cat": "kernel", "ts": 50.0},  # a flow event, not an activity
        {"ph": "M", "name": "process_name"},
    ]
    assert device_busy_us(trace) == (15.0 + 2.0 + 0.5, 5)
    assert device_busy_us([]) == (0.0, 0)
    assert device_gaps_us(trace) == [5.0, 8.0]  # 15 -> 20, 22 -> 30
    assert device_gaps_us([]) == []


def test_the_kernel_table_ranks_device_time_by_name_and_sums_to_the_whole():
    trace = [{"ph": "X", "cat": "kernel", "name": n, "ts": 0.0, "dur": d}
             for n, d in [("gemm", 5.0), ("norm", 1.0), ("gemm", 5.0), ("rope", 2.0),
                          ("silu", 0.5)]]
    trace.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 99.0})
    table = device_kernel_table(trace, top=2)
    assert table == [{"name": "gemm", "total_us": 10.0, "calls": 2},
                     {"name": "rope", "total_us": 2.0, "calls": 1},
                     {"name": "(rest: 2 more)", "total_us": 1.5, "calls": 2}]


# ---------------------------------------------------------------------------- on a real engine


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_factory):
    return LLM(tiny_model_factory("LlamaForCausalLM"), device="cpu", dtype="float32",
               max_num_seqs=4, max_num_batched_tokens=48, skip_tokenizer_init=True)


def test_decode_split_reaches_a_full_decode_batch_and_cleans_up(tiny_llm):
    prompts = [[5 + i] * (20 + 7 * i) for i in range(4)]
    split = throughput.measure_decode_split(tiny_llm, prompts, num_steps=3, profile=False)
    assert split["batch"] == 4 and split["num_steps"] == 3
    assert split["wall_ms"] > 0 and split["model_ms"] > 0
    assert split["gpu_ms"] is None and split["host_ms"] is None
    assert (split["prompt_len_min"], split["prompt_len_max"]) == (20, 41)
    engine = tiny_llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.observers


def test_cpu_decode_split_times_the_model_math_and_restores_the_model(tiny_llm):
    model = tiny_llm.llm_engine.executor.model
    assert "forward" not in vars(model) and "compute_logits" not in vars(model)
    prompts = [[5 + i] * (20 + 7 * i) for i in range(4)]
    split = throughput.measure_decode_split(
        tiny_llm, prompts, num_steps=3, profile=False, time_math=True
    )
    assert split["batch"] == 4 and split["gpu_ms"] is None
    assert 0 < split["math_ms"] < split["wall_ms"]
    assert split["host_ms"] == pytest.approx(split["wall_ms"] - split["math_ms"])
    assert split["host_ms"] > 0 and split["engine_wall_ms"] > 0 and split["model_ms"] > 0
    # The model math is inside the model runner's time, which is inside the step's.
    assert split["math_ms"] <= split["model_ms"] <= split["engine_wall_ms"] <= split["wall_ms"]
    # The wrappers are gone: the class's own methods again.
    assert "forward" not in vars(model) and "compute_logits" not in vars(model)
    assert model.forward.__func__ is type(model).forward
    assert model.compute_logits.__func__ is type(model).compute_logits
    engine = tiny_llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.observers
    with pytest.raises(ValueError, match="pick one"):
        throughput.measure_decode_split(tiny_llm, prompts, 3, profile=True, time_math=True)


def test_cpu_decode_split_refuses_an_overlapped_engine(tiny_model_factory):
    llm = LLM(tiny_model_factory("LlamaForCausalLM"), device="cpu", dtype="float32",
              max_num_seqs=4, skip_tokenizer_init=True, async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling=False"):
        throughput.measure_decode_split(llm, [[5] * 20], 3, profile=False, time_math=True)
    llm.llm_engine.shutdown()


def test_model_math_timer_restores_the_methods_even_when_a_step_fails():
    class Model(torch.nn.Module):
        def forward(self, x):
            return x + 1

        def compute_logits(self, x):
            return x * 2

    model = Model()
    own_logits = model.compute_logits  # an instance attribute of its own is put back
    model.compute_logits = own_logits
    with pytest.raises(RuntimeError, match="boom"), throughput._timed_model_math(model) as math:
        assert model(torch.ones(1)).item() == 2 and model.compute_logits(3) == 6
        assert (math["forward"], math["compute_logits"]) == (1, 1)
        assert math["seconds"] > 0
        raise RuntimeError("boom")
    assert "forward" not in vars(model) and model.forward.__func__ is Model.forward
    assert vars(model)["compute_logits"] is own_logits


def test_cpu_kv_cache_holds_the_decode_split_batch():
    args = throughput.parse_args(["--num-requests", "8", "--decode-batch", "5"])
    workload = throughput.make_workload(8, 0, 100, (3, 9), (1, 2))
    split = throughput.decode_split_workload(workload, args)
    _, max_tokens = throughput.decode_split_lengths(
        split.prompts, args.decode_steps, args.max_num_batched_tokens
    )
    assert split.prompts == workload.prompts[:5] and split.output_lens == [max_tokens] * 5
    # Short outputs: the split needs more KV than the timed run does.
    assert throughput.kv_tokens_needed(split, 16) > throughput.kv_tokens_needed(workload, 16)
    skipped = throughput.parse_args(["--decode-batch", "0"])
    assert throughput.decode_split_workload(workload, skipped).num_requests == 0


def test_decode_split_refuses_a_batch_that_never_runs_at_once(tiny_llm):
    prompts = [[7] * 10 for _ in range(5)]  # max_num_seqs is 4
    with pytest.raises(RuntimeError, match="no step decoded all 5"):
        throughput.measure_decode_split(tiny_llm, prompts, num_steps=2, profile=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_the_cuda_report_prints_whatever_is_missing_or_failed(capsys):
    rates = {
        "copy_bytes_per_s": 3.0e12,
        "matmul_flops_per_s": {"[8x8]@[8x8]": 1.0e14},
        "rate_shape": "[8x8]@[8x8]",
        "best_matmul_flops_per_s": 1.0e14,
    }
    throughput.print_cuda_report({}, rates, None, None)
    text = capsys.readouterr().out
    assert "roofline: n/a" in text and "GPU/host split: n/a" in text
    throughput.print_cuda_report({}, rates, {"error": "ValueError: x"}, {"error": "skipped"})
    text = capsys.readouterr().out
    assert "roofline: FAILED: ValueError: x" in text and "GPU/host split: skipped" in text


def test_the_cuda_path_end_to_end_with_stand_ins_for_the_gpu(
    tiny_model_factory, monkeypatch, tmp_path, capsys
):
    """``main(["--device", "cuda", ...])`` on CPU: llmlab built on CPU, fixed device rates,
    a fixed profiler result; everything else (warmup sweep, StepEvent recording, roofline,
    decode split, report, JSON) runs as it would on a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in GPU")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    rates = {
        "copy_bytes_per_s": 3.0e12,
        "matmul_flops_per_s": {"[8192x8192]@[8192x8192]": 7.0e14},
        "rate_shape": "[8192x8192]@[8192x8192]",
        "best_matmul_flops_per_s": 7.0e14,
    }
    monkeypatch.setattr(throughput, "measure_device_rates", lambda shape, args: rates)
    built = []

    def build_on_cpu(model_dir, workload, args):
        llm = LLM(str(model_dir), device="cpu", dtype="float32", skip_tokenizer_init=True,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
        built.append(llm)
        return llm

    monkeypatch.setattr(throughput, "build_llmlab", build_on_cpu)

    def profile_steps(engine, num_steps):
        # 2 ms of device time over the 4 profiled steps, which took 4 ms of wall time: one
        # kernel of 500 us a step, then a 300 us gap (the last step's is outside the trace).
        for _ in range(num_steps):
            engine.step()
        trace = [{"ph": "X", "cat": "kernel", "name": "step", "ts": 800.0 * i, "dur": 500.0}
                 for i in range(num_steps)]
        return trace, 0.004

    monkeypatch.setattr(throughput, "_profile_steps", profile_steps)
    out = tmp_path / "cuda.json"
    throughput.main([
        "--device", "cuda", "--model-dir", tiny_model_factory("LlamaForCausalLM"),
        "--only", "llmlab", "--num-requests", "6", "--prompt-len-range", "8", "30",
        "--output-len-range", "4", "12", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "64", "--decode-steps", "4", "--json", str(out),
    ])
    text = capsys.readouterr().out
    assert "stand-in GPU" in text and "FAILED" not in text
    assert "roofline time" in text and "of the roofline (roofline time / llmlab time)" in text
    assert "GPU busy 0.50 ms" in text and "4 running" in text
    assert len(built) == 1

    payload = json.loads(out.read_text())
    assert payload["args"]["device"] == "cuda"
    assert payload["device_rates"] == rates
    line = payload["roofline"]
    assert line["num_steps"] >= line["decode_steps"] > 0
    assert line["total_bytes"] > line["num_steps"] * line["weight_bytes"]
    result = payload["results"]["llmlab"]
    assert result["useful_output_tokens"] == payload["workload"]["output_tokens"]
    decode = payload["decode_split"]
    assert decode["batch"] == 4 and decode["gpu_ms"] == 0.5
    assert decode["host_ms"] == pytest.approx(decode["wall_ms"] - 0.5)
    assert decode["profiled_wall_ms"] == pytest.approx(1.0)
    assert decode["profiled_gaps"]["ms_per_step"] == pytest.approx(0.3 * 3 / 4)
    assert decode["kernels"] == [{"name": "step", "total_us": 2000.0, "calls": 4,
                                  "us_per_step": 500.0}]
    assert "0.225 ms idle in them per step" in text


@pytest.mark.slow  # the whole benchmark on CPU, Hugging Face's generate included: 20-40 s
def test_the_cpu_path_end_to_end_prints_best_hf_and_the_roofline(tiny_llama, tmp_path, capsys):
    out = tmp_path / "cpu.json"
    throughput.main([
        "--model-dir", tiny_llama, "--num-requests", "4", "--only", "llmlab,hf,hf-static",
        "--hf-batch-size", "4", "--hf-batch-sizes", "2,4", "--prompt-len-range", "8", "16",
        "--output-len-range", "2", "6", "--json", str(out),
    ])
    text = capsys.readouterr().out
    assert "static cache, batch sizes 2: " in text and ", 4: " in text
    assert "llmlab / best HF (" in text
    assert "of the per-step roofline" in text
    assert "host work per decode step at 4 seqs: " in text and "target <= 1.0 ms" in text
    assert "FAILED" not in text
    payload = json.loads(out.read_text())
    decode = payload["decode_split"]
    assert decode["batch"] == 4 and decode["num_steps"] == 16 and decode["gpu_ms"] is None
    assert decode["math_ms"] > 0 and decode["host_target_ms"] == 1.0
    assert decode["host_ms"] == pytest.approx(decode["wall_ms"] - decode["math_ms"])
    # The host work by stage adds up to it, and every stage ran.
    stages = decode["host_stages_ms"]
    assert sum(stages.values()) == pytest.approx(decode["host_ms"])
    for stage in ("schedule", "metadata", "sampling", "update", "outputs", "events"):
        assert stages[stage] > 0, stage
    assert "by stage, ms per step: schedule " in text
    # The timers are gone afterwards: the classes have their own methods back.
    from llmlab.engine.engine import Engine as EngineClass
    from llmlab.scheduler import Scheduler as SchedulerClass

    assert EngineClass._commit.__qualname__ == "Engine._commit"
    assert SchedulerClass.schedule.__qualname__ == "Scheduler.schedule"
    assert set(payload["results"]) == {"llmlab", "hf", "hf-static"}
    line = payload["roofline"]
    assert line["num_steps"] > 0 and 0 < line["total_s"]
    assert payload["cpu_rates"]["read_bytes_per_s"] > 0
    assert payload["args"]["torch_dtype"] == "torch.float32"

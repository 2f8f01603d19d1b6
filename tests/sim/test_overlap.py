"""Overlapped scheduling in the simulator: priced, not run. A synchronous step costs device +
host, an overlapped one ``max(device, hidden host) + unhidden host``; the host term comes from
``benchmarks/host_overhead.py``'s JSON; the simulated engine's ``async_scheduling`` (resolved
as the real engine resolves it) switches the cost model. Every time here is virtual or
computed: nothing is timed."""

from __future__ import annotations

import json

import attrs
import pytest

from llmlab.experiments.driver import run_workload
from llmlab.sim import BatchShape, HostCost, ProfiledCostModel, RooflineCostModel, sim_engine
from llmlab.sim.cost_model import with_overlap
from llmlab.sim.profiled import Linear
from llmlab.sim.roofline import Hardware, ModelShape

TOY = ModelShape(
    hidden_size=4, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2,
    intermediate_size=8, vocab_size=10,
)
TOY_HW = Hardware("toy", matmul_flops_per_s=1e6, memory_bytes_per_s=1e5, memory_bytes=1e9)
# Hidden: 50 ms + 1 ms per request; unhidden: 2 ms + 0.1 ms per request.
HOST = HostCost(per_step_s=0.05, per_request_s=0.001, per_token_s=0.0, per_admission_s=0.0,
                executor_per_step_s=0.002, executor_per_request_s=1e-4)


def decode(contexts: list[int]) -> BatchShape:
    return BatchShape(
        num_requests=len(contexts), num_decode_requests=len(contexts),
        num_sampled=len(contexts), context_tokens=sum(contexts),
        attention_positions=sum(contexts),
    )


def prefill(tokens: int) -> BatchShape:
    return BatchShape(
        num_requests=1, num_prefill_tokens=tokens, num_prefill_requests=1, num_sampled=1,
        context_tokens=tokens, attention_positions=tokens * (tokens + 1) // 2, num_admitted=1,
    )


# -- pricing ------------------------------------------------------------------------------


def test_an_overlapped_step_costs_the_longer_of_device_and_hidden_host_plus_the_unhidden():
    sync = RooflineCostModel(TOY, TOY_HW, host=HOST, overlap=False)
    overlapped = attrs.evolve(sync, overlap=True)
    # Host-bound: a small decode's device time (23.2 ms) hides under the engine thread's 54.
    small = decode([10, 20, 30, 40])
    device = sync.device_time(small)
    assert device == pytest.approx(0.0232)
    hidden, unhidden = 0.05 + 4 * 0.001, 0.002 + 4 * 1e-4
    assert sync.step_time(small) == pytest.approx(device + hidden + unhidden)
    assert overlapped.step_time(small) == pytest.approx(hidden + unhidden)
    # Device-bound: a 100-token prefill's 219 ms hides the engine thread's 51 ms.
    long = prefill(100)
    device = sync.device_time(long)
    assert device == pytest.approx(0.21928)
    hidden, unhidden = 0.05 + 0.001, 0.002 + 1e-4
    assert sync.step_time(long) == pytest.approx(device + hidden + unhidden)
    assert overlapped.step_time(long) == pytest.approx(device + unhidden)
    # None (on its own) is synchronous, as is a step that verifies drafts.
    assert attrs.evolve(sync, overlap=None).step_time(small) == sync.step_time(small)
    drafting = attrs.evolve(small, num_draft_tokens=4, num_sampled=8)
    assert overlapped.step_time(drafting) == pytest.approx(sync.step_time(drafting))


def test_a_profiled_model_splits_its_fitted_cycle_with_the_host_term():
    fit = Linear(coefficients=(0.01,), intercept=0.1)  # 100 ms + 10 ms per request
    sync = ProfiledCostModel(("num_requests",), fit, fit)
    overlapped = ProfiledCostModel(("num_requests",), fit, fit, host=HOST, overlap=True)
    shape = decode([10, 20, 30, 40])
    cycle = 0.1 + 4 * 0.01
    hidden, unhidden = 0.05 + 4 * 0.001, 0.002 + 4 * 1e-4
    device = cycle - hidden - unhidden
    assert sync.step_time(shape) == pytest.approx(cycle)
    assert overlapped.step_time(shape) == pytest.approx(max(device, hidden) + unhidden)
    assert attrs.evolve(overlapped, overlap=False).step_time(shape) == pytest.approx(cycle)
    # A host term bigger than the cycle never makes the overlapped step the longer one.
    cheap = ProfiledCostModel(("num_requests",), Linear((0.0,), 0.01), Linear((0.0,), 0.01),
                              host=HOST, overlap=True)
    assert cheap.step_time(shape) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="overlap=True needs host"):
        ProfiledCostModel(("num_requests",), fit, fit, overlap=True)


# -- the host term from benchmarks/host_overhead.py ----------------------------------------


def report(points: dict[int, float], stages_at: int, executor_ms: float, engine_ms: float,
           loop: str = "sync") -> dict:
    """A ``benchmarks.host_overhead --json`` report as the file holds it (string keys)."""
    stages = {"running": stages_at, "schedule": engine_ms / 2, "batch": executor_ms / 4,
              "metadata": executor_ms / 4, "sampling": executor_ms / 4,
              "runner": executor_ms / 4, "update": 0.0, "text": 0.0, "outputs": 0.0,
              "events": 0.0, "commit": engine_ms / 2, "observers": 0.0, "rest": 0.0}
    section = {str(n): {"host_ms": ms, "repeats": [ms]} for n, ms in points.items()}
    return {"steps": 40, "repeats": 1, "null": {loop: {**section, "stages_ms": stages}},
            "fixed": {}}


def test_the_host_term_is_read_from_a_host_overhead_json(tmp_path):
    # 0.2 ms + 10 us per request, a quarter of it on the executor thread.
    points = {16: 0.36, 64: 0.84, 256: 2.76}
    path = tmp_path / "host.json"
    path.write_text(json.dumps(report(points, 256, executor_ms=0.5, engine_ms=1.5)))
    host = HostCost.from_host_overhead(path)
    assert host.per_step_s + host.executor_per_step_s == pytest.approx(2e-4)
    assert host.per_request_s + host.executor_per_request_s == pytest.approx(1e-5)
    assert host.executor_per_step_s == pytest.approx(0.25 * 2e-4)
    assert host.executor_per_request_s == pytest.approx(0.25 * 1e-5)
    assert (host.per_token_s, host.per_admission_s) == (HostCost().per_token_s,
                                                       HostCost().per_admission_s)
    assert HostCost.from_host_overhead(path, per_admission_s=1e-3).per_admission_s == 1e-3
    # Splits at two counts: the executor thread's own line (here 0.1 ms + 2 us per request).
    at_16 = report(points, 16, executor_ms=0.132, engine_ms=0.36 - 0.132)
    at_256 = report({}, 256, executor_ms=0.612, engine_ms=2.76 - 0.612)
    host = HostCost.from_host_overhead(at_16, at_256)
    assert host.executor_per_step_s == pytest.approx(1e-4)
    assert host.executor_per_request_s == pytest.approx(2e-6)
    assert host.per_step_s == pytest.approx(1e-4)
    assert host.per_request_s == pytest.approx(8e-6)


def test_a_host_overhead_report_that_cannot_give_the_term_is_refused(tmp_path):
    good = report({16: 0.4, 64: 0.9}, 64, executor_ms=0.2, engine_ms=0.7)
    with pytest.raises(ValueError, match="no null-model results for loop='overlap'"):
        HostCost.from_host_overhead(good, loop="overlap")
    with pytest.raises(ValueError, match="at least two counts"):
        HostCost.from_host_overhead(report({16: 0.4}, 16, 0.2, 0.2))
    no_stages = report({16: 0.4, 64: 0.9}, 64, 0.2, 0.7)
    del no_stages["null"]["sync"]["stages_ms"]
    with pytest.raises(ValueError, match="no stage split"):
        HostCost.from_host_overhead(no_stages)
    path = tmp_path / "bad.json"
    bad = report({16: -1.0, 64: 0.9}, 64, 0.2, 0.7)
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"bad.json: null.sync.16.host_ms must be >= 0"):
        HostCost.from_host_overhead(path)


def test_the_benchmarks_own_json_loads(tmp_path):
    """The real ``benchmarks.host_overhead`` on tiny sizes: its file is what the loader
    reads (the format is the benchmark's; this holds the two together)."""
    from benchmarks import host_overhead

    path = tmp_path / "host.json"
    host_overhead.main(["--running", "4", "8", "--steps", "2", "--repeats", "1",
                        "--model-kind", "null", "--loop", "sync", "--json", str(path)])
    host = HostCost.from_host_overhead(path)
    shape = decode([10] * 8)
    assert host.time(shape) > 0
    assert 0 < host.unhidden_time(shape) < host.time(shape)


# -- the config switch --------------------------------------------------------------------


def test_async_scheduling_switches_the_cost_models_overlap_as_the_real_engine_would(tiny_llama):
    roofline = RooflineCostModel(TOY, TOY_HW, host=HOST)
    assert roofline.overlap is None
    settings = {"max_num_seqs": 4, "max_model_len": 96, "num_gpu_blocks_override": 40}

    def priced(**kw):
        engine = sim_engine(tiny_llama, **{"cost_model": roofline, **settings, **kw})
        # The simulated engine itself always steps synchronously.
        assert engine.overlap is None and engine.config.async_scheduling is False
        return engine.executor.cost_model.overlap

    assert priced() is False  # this_machine: a CPU, where the real engine does not overlap
    assert priced(async_scheduling=True) is True
    assert priced(hardware="h100") is True  # a GPU preset: on unless set False
    assert priced(hardware="h100", async_scheduling=False) is False
    assert sim_engine(tiny_llama, hardware="l4", **settings).executor.cost_model.overlap is True
    # An explicit flag on the cost model stands, unless the config contradicts it.
    explicit = attrs.evolve(roofline, overlap=True)
    assert priced(cost_model=explicit) is True
    with pytest.raises(ValueError, match="async_scheduling=False but the cost model"):
        priced(cost_model=explicit, async_scheduling=False)
    # A profile without its host term prices its steps as recorded.
    fit = Linear((0.01,), 0.1)
    profile = ProfiledCostModel(("num_requests",), fit, fit)
    assert with_overlap(profile, None, "cuda") is profile
    with pytest.raises(ValueError, match="cannot price an overlapped step without its host"):
        with_overlap(profile, True, "cpu")
    assert with_overlap(attrs.evolve(profile, host=HOST), True, "cpu").overlap is True

    class Own:  # a user's cost model prices its steps itself
        def step_time(self, shape):
            return 0.01

    own = Own()
    assert with_overlap(own, True, "cuda") is own


def test_a_simulated_overlapped_run_steps_at_the_overlapped_price(tiny_llama):
    from llmlab.experiments import shared_prefix_chat

    model = ModelShape.from_pretrained(tiny_llama)
    # Rates at which its decodes are host-bound and its prefills device-bound.
    hardware = Hardware("slow", matmul_flops_per_s=1e8, memory_bytes_per_s=1e7,
                        memory_bytes=1e9)
    cost = RooflineCostModel(model, hardware, host=HOST)
    settings = {"max_num_seqs": 4, "max_model_len": 96, "num_gpu_blocks_override": 40,
                "seed": 0}
    workload = shared_prefix_chat(4, 2, vocab_size=model.vocab_size, system_prompt_len=16,
                                  user_turn_len=(2, 6), output_len=(3, 8), rate=None, seed=0,
                                  low=2)
    runs = {}
    for flag in (False, True):
        engine = sim_engine(tiny_llama, cost_model=cost, async_scheduling=flag, **settings)
        _, trace = run_workload(engine, workload)
        runs[flag] = [e for e in trace.events if e.scheduled]
    sync, overlapped = runs[False], runs[True]
    # Same decisions (the simulated engine steps synchronously either way), other times.
    assert [e.scheduled for e in sync] == [e.scheduled for e in overlapped]
    bound = set()
    for e_sync, e_over in zip(sync, overlapped, strict=True):
        shape = BatchShape.of_event(e_sync)
        device = cost.device_time(shape)
        bound.add("device" if device > HOST.hidden_time(shape) else "host")
        assert e_sync.end_time_s - e_sync.start_time_s == pytest.approx(
            device + HOST.time(shape), abs=1e-12)
        assert e_over.end_time_s - e_over.start_time_s == pytest.approx(
            max(device, HOST.hidden_time(shape)) + HOST.unhidden_time(shape), abs=1e-12)
    assert bound == {"device", "host"}
    assert overlapped[-1].end_time_s < sync[-1].end_time_s

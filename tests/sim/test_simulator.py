"""The simulator runs the engine's own scheduler and KV cache: the same decisions as the real
engine when fed the real step times, the same accounting for speculation and parallel
samples, bit-for-bit reproducible, and refusing cost models and inputs that are wrong."""

from __future__ import annotations

import json
import math
import pathlib

import attrs
import pytest

from llmlab import LLM, SamplingParams
from llmlab.runner.executor import VirtualClock
from llmlab.errors import ComponentError
from llmlab.experiments import (
    Workload,
    WorkloadRequest,
    bursts,
    compare,
    mixed_long_short,
    shared_prefix_chat,
)
from llmlab.experiments.driver import run_workload
from llmlab.sim import (
    BatchShape,
    ProfiledCostModel,
    ReplayCostModel,
    SimulatedExecutor,
    sim_engine,
    simulate,
)
from llmlab.sim.cost_model import as_shapes
from llmlab.sim.profiled import Linear

# A small pool (forcing preemption and eviction), small blocks (prefix hits), chunked prefill.
ENGINE = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_seqs": 4,
    "max_model_len": 96,
    "max_num_batched_tokens": 32,
    "num_gpu_blocks_override": 40,
    "seed": 0,
    # The simulator replays a synchronous engine's decisions (a GPU would default to overlap).
    "async_scheduling": False,
}


@attrs.define
class Fixed:
    """A step costs ``per_step + per_token * tokens``."""

    per_step: float = 0.002
    per_token: float = 1e-4
    name: str = "fixed"

    def step_time(self, shape: BatchShape) -> float:
        return self.per_step + self.per_token * shape.num_tokens


def vocab_size(model: str) -> int:
    return json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]


def chat(model: str, **kw) -> Workload:
    settings = dict(system_prompt_len=24, user_turn_len=(2, 8), output_len=(3, 10), rate=200.0,
                    seed=0, low=2)
    settings.update(kw)
    return shared_prefix_chat(6, 3, vocab_size=vocab_size(model), **settings)


def decisions(events):
    """What the scheduler decided, independent of time."""
    return {
        "admissions": [a.request_id for e in events for a in e.admitted],
        "preemptions": sum(len(e.preempted) for e in events),
        "prefix_hit_blocks": sum(len(e.blocks_prefix_hit) for e in events),
        "scheduled": [e.scheduled for e in events],
    }


# -- same decisions as the real engine ----------------------------------------------------


def test_replaying_the_real_step_times_gives_the_real_engines_decisions(tiny_llama):
    workload = chat(tiny_llama, rate=1000.0)
    engine = LLM(tiny_llama, **{**ENGINE, "num_gpu_blocks_override": 26}).llm_engine
    real_records, real_trace = run_workload(engine, workload)
    # The run's start on the engine clock: arrival times are given to the engine from it.
    first = real_trace.events[0].arrived[0]
    t0 = first.arrival_time - workload.requests[0].arrival_time
    real = decisions(real_trace.events)
    assert real["preemptions"] > 0 and real["prefix_hit_blocks"] > 0  # the case is exercised

    clock = VirtualClock()
    replay = ReplayCostModel.of(real_trace.events, t0, clock)
    sim = sim_engine(tiny_llama, cost_model=replay, clock=clock,
                     **{**ENGINE, "num_gpu_blocks_override": 26})
    sim_records, sim_trace = run_workload(sim, workload)
    assert decisions(sim_trace.events) == real
    assert [r.num_output_tokens for r in sim_records] == [r.num_output_tokens for r in real_records]
    assert [r.num_cached_tokens for r in sim_records] == [r.num_cached_tokens for r in real_records]
    # Each simulated step ends when the real one did, so the latencies are the real ones.
    for a, b in zip(real_records, sim_records, strict=True):
        assert b.first_token_s == pytest.approx(a.first_token_s, abs=1e-9)
        assert b.finish_s == pytest.approx(a.finish_s, abs=1e-9)
    sim.kv_cache.check()
    assert sim.kv_cache.num_free_blocks == sim.kv_cache.num_blocks


def test_the_executors_shape_of_a_batch_is_the_shape_of_its_step_event(tiny_llama):
    """What a cost model is fitted on (events) and priced with (batches) agree, step by
    step, through chunked prefill, prefix hits, preemption, parallel samples and drafts."""
    engine = LLM(tiny_llama, **ENGINE, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
    }).llm_engine
    runner = engine.executor
    seen = []

    class Spy:
        def execute(self, batch):
            out = runner.execute(batch)
            seen.append((batch, out))
            return out

    engine.executor = Spy()
    events = []
    engine.subscribe(events.append)
    vocab = vocab_size(tiny_llama)
    for i, request in enumerate(chat(tiny_llama)):
        repeat = [5, 6, 7, 8] * 4  # ngram drafts on a repetitive prompt
        prompt = list(request.prompt_token_ids) + (repeat if i % 2 else [])
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True,
                                n=2 if i % 5 == 0 else 1, seed=i, temperature=0.8)
        engine.add_request(str(i), {"prompt_token_ids": [t % vocab for t in prompt]}, params)
    while engine.has_unfinished_requests():
        engine.step()
    ran = [e for e in events if e.scheduled]
    assert len(ran) == len(seen)
    assert any(e.preempted for e in ran) and any(e.speculated for e in ran)
    assert any(e.blocks_forked for e in ran) and any(e.blocks_prefix_hit for e in ran)
    for (batch, out), event in zip(seen, ran, strict=True):
        assert BatchShape.of_batch(batch, out.num_drafted, len(event.finished)) == (
            BatchShape.of_event(event)
        )


# -- the simulated executor ---------------------------------------------------------------


def test_parallel_samples_fork_and_share_blocks_in_simulation(tiny_llama):
    engine = sim_engine(tiny_llama, cost_model=Fixed(), **ENGINE)
    events = []
    engine.subscribe(events.append)
    engine.add_request("a", {"prompt_token_ids": list(range(2, 22))},
                       SamplingParams(n=3, max_tokens=7, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    (out,) = outputs
    assert [len(c.token_ids) for c in out.outputs] == [7, 7, 7]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # the samples diverge
    assert sum(len(e.blocks_forked) for e in events) > 0
    engine.kv_cache.check()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize(("rates", "tokens_per_step"), [([1.0, 1.0, 1.0], 4), ([0.0], 1)])
def test_speculation_is_simulated_at_the_given_acceptance_rates(tiny_llama, rates,
                                                                tokens_per_step):
    spec = {"method": "synthetic", "synthetic_acceptance_rates": rates,
            "num_speculative_tokens": 3, "speculation_length": "fixed"}
    engine = sim_engine(tiny_llama, cost_model=Fixed(), speculative_config=spec, **ENGINE)
    events = []
    engine.subscribe(events.append)
    engine.add_request("a", {"prompt_token_ids": list(range(2, 10))},
                       SamplingParams(max_tokens=21, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    decode_steps = [e for e in events if e.scheduled and e.num_prefill_tokens == 0]
    sampled = [n for e in decode_steps for _, n in e.sampled]
    assert sum(sampled) == 20  # the prefill gave the first of the 21
    assert sampled[0] == tokens_per_step
    drafted = [d for e in decode_steps for _, d, _ in e.speculated]
    assert drafted[0] == 3 and all(d <= 3 for d in drafted)  # fewer only near max_tokens
    engine.kv_cache.check()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_speculation_with_a_drafter_is_refused_in_simulation(tiny_llama):
    with pytest.raises(ValueError, match="synthetic"):
        sim_engine(tiny_llama, speculative_config={"method": "ngram",
                                                   "num_speculative_tokens": 2})


@pytest.mark.parametrize("setting", [
    {"enable_lora": True}, {"quantization": "int8"}, {"preemption_mode": "swap"},
    {"kv_offloading_size": 0.5}, {"kv_press": "snapkv"},
])
def test_settings_the_simulator_does_not_model_are_refused_naming_them(tiny_llama, setting):
    (field, value), = setting.items()
    with pytest.raises(ValueError, match=f"does not model {field}={value!r}"):
        sim_engine(tiny_llama, **setting)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "1 ms", None])
def test_a_cost_model_answering_a_bad_time_is_refused_naming_it(tiny_llama, bad):
    @attrs.define
    class Broken:
        name: str = "broken"

        def step_time(self, shape):
            return bad

    engine = sim_engine(tiny_llama, cost_model=Broken(), **ENGINE)
    engine.add_request("a", {"prompt_token_ids": [2, 3, 4]},
                       SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(ComponentError, match="cost model 'broken'.*step_time"):
        engine.step()
    assert engine.clock() == 0.0  # the clock did not move
    # The engine is consistent: the same work runs once the model answers properly.
    engine.executor.cost_model = Fixed()
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache.check()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_an_executor_built_by_hand_runs_the_engine(tiny_llama):
    clock = VirtualClock()
    engine = sim_engine(tiny_llama, cost_model=Fixed(0.01, 0.0), clock=clock, **ENGINE)
    assert isinstance(engine.executor, SimulatedExecutor) and engine.clock is clock
    engine.add_request("a", {"prompt_token_ids": [2, 3, 4]},
                       SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert clock() == pytest.approx(0.05)  # five steps of 10 ms: prefill + 4 decodes


# -- the profiled model -------------------------------------------------------------------


def test_the_profiled_fit_recovers_a_known_linear_cost(tiny_llama):
    features = ("num_requests", "num_prefill_tokens", "context_tokens", "num_admitted")
    truth = ProfiledCostModel(
        features,
        decode=Linear((1e-4, 0.0, 2e-6, 0.0), 1e-3),
        prefill=Linear((5e-5, 3e-5, 1e-6, 4e-4), 2e-3),
    )
    engine = sim_engine(tiny_llama, cost_model=truth, **{**ENGINE, "num_gpu_blocks_override": 200})
    workload = mixed_long_short(60, vocab_size=vocab_size(tiny_llama), long_prompt_len=(30, 60),
                                short_prompt_len=(4, 12), long_output_len=(4, 20),
                                short_output_len=(2, 12), rate=300.0, seed=3, low=2)
    _, trace = run_workload(engine, workload)
    fitted = ProfiledCostModel.fit(trace.events, features)
    for want, got in ((truth.decode, fitted.decode), (truth.prefill, fitted.prefill)):
        assert got.intercept == pytest.approx(want.intercept, rel=1e-6, abs=1e-9)
        assert got.coefficients == pytest.approx(want.coefficients, rel=1e-6, abs=1e-9)
        assert got.residual_s < 1e-9


# A cost whose first step after an idle gap costs 5 ms more.
WAKE_FEATURES = ("num_requests", "num_prefill_tokens", "after_idle")
WAKE_COST = ProfiledCostModel(WAKE_FEATURES, decode=Linear((1e-4, 0.0, 0.0), 1e-3),
                              prefill=Linear((5e-5, 3e-5, 5e-3), 2e-3))


def bursty(model: str, gap_s: float = 0.5) -> Workload:
    return bursts(3, 3, vocab_size=vocab_size(model), gap_s=gap_s, prompt_len=(4, 10),
                  output_len=(2, 5), seed=1, low=2)


def test_the_first_step_after_an_idle_gap_is_flagged_alike_in_real_and_simulated_runs(
        tiny_llama):
    """Three bursts far apart: the engine idles between them. The shapes fitted on (from
    the real run's events) and the shapes priced (by the simulated executor) both flag the
    first step of each burst, and only those."""
    workload = bursty(tiny_llama)
    engine = LLM(tiny_llama, **ENGINE).llm_engine
    _, trace = run_workload(engine, workload)
    shapes, _ = as_shapes(trace.events)
    real = [s.after_idle for s in shapes]

    priced = []

    @attrs.define
    class Recording(Fixed):
        def step_time(self, shape: BatchShape) -> float:
            priced.append(shape.after_idle)
            return super().step_time(shape)

    _, sim_trace = run_workload(sim_engine(tiny_llama, cost_model=Recording(), **ENGINE), workload)
    assert real == priced
    assert sum(real) == 3 and real[0] == 1
    # Each flagged step admits a burst's first requests; no other step admits any.
    ran = [e for e in sim_trace.events if e.scheduled]
    assert [bool(flag) for flag in priced] == [bool(e.admitted) for e in ran]


def test_the_profiled_fit_recovers_a_wake_up_cost(tiny_llama):
    """A simulated run whose first step after each idle gap costs 5 ms more: the fit on
    its events gives the 5 ms back as the ``after_idle`` coefficient."""
    features, truth = WAKE_FEATURES, WAKE_COST
    engine = sim_engine(tiny_llama, cost_model=truth, **ENGINE)
    # Poisson arrivals among the bursts: prefill steps that did not wake the engine too.
    poisson = mixed_long_short(30, vocab_size=vocab_size(tiny_llama), long_prompt_len=(30, 60),
                               short_prompt_len=(4, 12), long_output_len=(4, 20),
                               short_output_len=(2, 12), rate=60.0, seed=3, low=2)
    workload = Workload("bursts", sorted([*bursty(tiny_llama).requests, *poisson.requests],
                                         key=lambda r: r.arrival_time))
    _, trace = run_workload(engine, workload)
    fitted = ProfiledCostModel.fit(trace.events, features)
    assert fitted.prefill.coefficients[2] == pytest.approx(5e-3, rel=1e-6)
    assert fitted.prefill.intercept == pytest.approx(2e-3, rel=1e-6)


@pytest.mark.filterwarnings("ignore:ProfiledCostModel.fit:RuntimeWarning")  # the 5 ms it misses
def test_a_feature_seen_on_too_few_steps_is_left_out_of_the_fit(tiny_llama):
    """One wake-up (the run's first step) cannot price every later one: its coefficient
    would be that one step's noise. The fit leaves such a feature out."""
    features, truth = WAKE_FEATURES, WAKE_COST
    engine = sim_engine(tiny_llama, cost_model=truth, **ENGINE)
    busy = mixed_long_short(30, vocab_size=vocab_size(tiny_llama), long_prompt_len=(30, 60),
                            short_prompt_len=(4, 12), long_output_len=(4, 20),
                            short_output_len=(2, 12), rate=2000.0, seed=3, low=2)
    _, trace = run_workload(engine, busy)
    shapes, _ = as_shapes(trace.events)
    assert sum(s.after_idle for s in shapes) == 1  # the first step alone
    fitted = ProfiledCostModel.fit(trace.events, features)
    assert fitted.prefill.coefficients[2] == 0.0 == fitted.decode.coefficients[2]


def test_the_profiled_fit_refuses_unknown_features_and_too_few_steps():
    with pytest.raises(ValueError, match="unknown feature"):
        ProfiledCostModel.fit([], ("num_requests", "num_blocks"))
    with pytest.raises(ValueError, match="needs more than"):
        ProfiledCostModel.fit([])


# -- simulate: determinism, cluster, routers ----------------------------------------------


def test_the_same_simulation_twice_gives_the_same_results_bit_for_bit(tiny_llama):
    workload = chat(tiny_llama, rate=400.0)
    runs = [
        simulate(workload, model=tiny_llama, replicas=3, router="prefix_aware",
                 cost_model=Fixed(), progress=False, keep_events=True, **ENGINE)
        for _ in range(2)
    ]
    a, b = runs
    assert a.table.equals(b.table) and a.requests.equals(b.requests)
    assert a.events == b.events


def test_one_replica_simulated_equals_a_simulated_engine_run_through_run_workload(tiny_llama):
    workload = chat(tiny_llama)
    result = simulate(workload, model=tiny_llama, cost_model=Fixed(), progress=False,
                      keep_events=True, **ENGINE)
    engine = sim_engine(tiny_llama, cost_model=Fixed(), **ENGINE)
    records, trace = run_workload(engine, workload)
    assert result.events[0] == tuple(trace.events)
    assert list(result.requests["finish_s"]) == [r.finish_s for r in records]


def test_prefix_aware_routing_beats_round_robin_on_prefix_hits(tiny_llama):
    workload = shared_prefix_chat(12, 4, vocab_size=vocab_size(tiny_llama), system_prompt_len=8,
                                  user_turn_len=(8, 16), output_len=(3, 8), rate=100.0, seed=1,
                                  low=2)
    settings = {**ENGINE, "num_gpu_blocks_override": 200, "max_model_len": 128}
    hit = {}
    for router in ("round_robin", "prefix_aware", "session_affinity"):
        result = simulate(workload, model=tiny_llama, replicas=4, router=router,
                          cost_model=Fixed(), progress=False, **settings)
        hit[router] = result.overall["prefix_hit_rate"]
        assert result.overall["num_requests"] == len(workload)
    assert hit["prefix_aware"] > 1.3 * hit["round_robin"]
    assert hit["session_affinity"] > 1.3 * hit["round_robin"]


def test_least_loaded_routing_evens_out_the_work(tiny_llama):
    workload = mixed_long_short(80, vocab_size=vocab_size(tiny_llama), long_fraction=0.25,
                                long_prompt_len=(40, 60), long_output_len=(30, 40),
                                short_prompt_len=(2, 6), short_output_len=(2, 4), rate=400.0,
                                seed=2, low=2)
    settings = {**ENGINE, "num_gpu_blocks_override": 200}
    spread = {}
    for router in ("round_robin", "least_loaded"):
        result = simulate(workload, model=tiny_llama, replicas=4, router=router,
                          cost_model=Fixed(), progress=False, **settings)
        served = result.table.drop(index="overall")["served[None]"]
        spread[router] = served.max() - served.min()
    assert spread["least_loaded"] < 0.5 * spread["round_robin"]


def test_a_streamed_workload_and_a_router_answering_out_of_range(tiny_llama):
    requests = [WorkloadRequest(0.01 * i, (2, 3, 4, 5), 3) for i in range(10)]
    result = simulate(iter(requests), model=tiny_llama, cost_model=Fixed(), progress=False,
                      **ENGINE)
    assert result.overall["num_requests"] == 10

    class Far:
        name = "far"

        def route(self, request, replicas):
            return len(replicas)

    with pytest.raises(ValueError, match="far"):
        simulate(requests, model=tiny_llama, replicas=2, router=Far(), cost_model=Fixed(),
                 progress=False, **ENGINE)


def test_a_workload_out_of_arrival_order_is_refused(tiny_llama):
    requests = [WorkloadRequest(1.0, (2, 3), 2), WorkloadRequest(0.5, (2, 3), 2)]
    with pytest.raises(ValueError, match="workload item 1 arrives at 0.5"):
        simulate(requests, model=tiny_llama, cost_model=Fixed(), progress=False, **ENGINE)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"replicas": 0}, "replicas"),
    ({"router": "nearest"}, "nearest"),
    ({"hardware": "tpu9"}, "h100"),
    ({"block_sizes": 4}, "block_sizes"),
    ({"cost_model": "vidur"}, "vidur"),
    ({"clock": VirtualClock(100.0)}, "one virtual clock per replica"),
])
def test_bad_simulation_settings_are_refused_naming_them(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate([WorkloadRequest(0.0, (2, 3), 2)], model=tiny_llama, progress=False,
                 **{"cost_model": Fixed(), **ENGINE, **kwargs})


# -- compare(executor="sim") --------------------------------------------------------------


def test_compare_in_simulation_has_the_real_tables_columns(tiny_llama):
    workload = chat(tiny_llama)
    configs = {"fcfs": {"scheduling_policy": "fcfs"}, "spf": {"scheduling_policy": "spf"}}
    real = compare(workload, configs, model=tiny_llama, engine_kwargs=ENGINE, progress=False)
    sim = compare(workload, configs, model=tiny_llama, engine_kwargs={**ENGINE,
                  "cost_model": Fixed()}, progress=False, executor="sim")
    assert list(sim.table.columns) == list(real.table.columns)
    assert list(sim.requests.columns) == list(real.requests.columns)
    assert (sim.table["num_requests"] == len(workload)).all()
    assert sim.table["prefix_hit_rate"].tolist() == pytest.approx(
        real.table["prefix_hit_rate"].tolist(), abs=0.1)
    with pytest.raises(ValueError, match="attention_backend"):
        compare(workload, {"x": {"attention_backend": "torch"}}, model=tiny_llama,
                progress=False, executor="sim")


def test_the_profiled_fit_reads_a_recording_file_as_it_reads_live_events(tiny_llama, tmp_path):
    from llmlab.observe.recording import load

    engine = sim_engine(tiny_llama, cost_model=Fixed(), **ENGINE)
    path = tmp_path / "run.jsonl.gz"
    events = []
    engine.subscribe(events.append)
    with engine.record(path):
        run_workload(engine, chat(tiny_llama))
    recording = load(path)
    assert ProfiledCostModel.fit(recording) == ProfiledCostModel.fit(events)


@pytest.mark.slow  # two fresh interpreters
def test_results_do_not_depend_on_the_process_hash_seed(tiny_llama):
    """Bit for bit across processes too: string hashing is randomized per process, so
    nothing the results depend on may iterate a set of users or sessions."""
    import subprocess
    import sys

    script = f"""
import hashlib
from llmlab.experiments import multi_tenant, shared_prefix_chat
from llmlab.sim import simulate
from llmlab.sim.profiled import Linear
from llmlab.sim import ProfiledCostModel
cost = ProfiledCostModel(("num_requests", "num_prefill_tokens"), Linear((1e-4, 2e-5), 1e-3),
                         Linear((1e-4, 5e-5), 2e-3))
digest = hashlib.sha256()
for workload, router in ((multi_tenant(40, vocab_size=100, rate=300.0, seed=1, low=2),
                          "least_loaded"),
                         (shared_prefix_chat(6, 3, vocab_size=100, system_prompt_len=12,
                                             rate=300.0, seed=1, low=2), "session_affinity")):
    result = simulate(workload, model={tiny_llama!r}, replicas=3, router=router,
                      cost_model=cost, progress=False, max_model_len=96, block_size=4,
                      num_gpu_blocks_override=60, max_num_seqs=4)
    digest.update(result.table.to_csv().encode())
    digest.update(result.requests.to_csv().encode())
print(digest.hexdigest())
"""
    digests = set()
    for seed in ("1", "2"):
        env = {**__import__("os").environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_the_rooflines_host_term_is_fitted_on_a_run(tiny_llama):
    """A run whose steps cost a roofline plus a known host term gives that term back; the
    device part stays the hardware's."""
    from llmlab.sim import HostCost, ModelShape, RooflineCostModel
    from llmlab.sim.roofline import Hardware

    gpu = Hardware("toy", matmul_flops_per_s=1e12, memory_bytes_per_s=1e11, memory_bytes=1e10)
    shape = ModelShape.from_pretrained(tiny_llama)
    host = HostCost(per_step_s=2e-3, per_request_s=4e-5, per_token_s=1e-6, per_admission_s=3e-4,
                    executor_per_step_s=5e-4, executor_per_request_s=1e-5)
    truth = RooflineCostModel(shape, gpu, host=host)
    engine = sim_engine(tiny_llama, cost_model=truth, **ENGINE)
    _, trace = run_workload(engine, chat(tiny_llama))
    # A step's time does not say which thread spent it: the split between the engine and
    # executor threads is the starting term's (here the truth's proportions, twice as big).
    start = HostCost(*(2 * v for v in attrs.astuple(host)))
    fitted = RooflineCostModel(shape, gpu, host=start).fit_host(trace.events)
    assert attrs.astuple(fitted.host) == pytest.approx(attrs.astuple(host), rel=1e-6)
    assert fitted.device_time(BatchShape(num_requests=1, num_decode_requests=1,
                                         context_tokens=10)) > 0
    # From the defaults: the same totals, split in the defaults' proportions.
    default = RooflineCostModel(shape, gpu).fit_host(trace.events).host
    assert default.per_step_s + default.executor_per_step_s == pytest.approx(2.5e-3, rel=1e-6)
    assert default.per_request_s + default.executor_per_request_s == pytest.approx(5e-5, rel=1e-6)
    assert default.executor_per_request_s / default.per_request_s == pytest.approx(
        HostCost().executor_per_request_s / HostCost().per_request_s)


def test_a_fit_to_noisy_times_warns_and_a_clean_one_does_not(tiny_llama, monkeypatch):
    import warnings

    import numpy as np

    from llmlab.sim import profiled

    features = ("num_requests", "num_prefill_tokens", "context_tokens")
    truth = ProfiledCostModel(features, decode=Linear((1e-4, 0.0, 2e-6), 1e-3),
                              prefill=Linear((5e-5, 3e-5, 1e-6), 2e-3))
    engine = sim_engine(tiny_llama, cost_model=truth, **{**ENGINE, "num_gpu_blocks_override": 200})
    workload = mixed_long_short(40, vocab_size=vocab_size(tiny_llama), long_prompt_len=(30, 60),
                                short_prompt_len=(4, 12), long_output_len=(4, 20),
                                short_output_len=(2, 12), rate=300.0, seed=4, low=2)
    _, trace = run_workload(engine, workload)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ProfiledCostModel.fit(trace.events, features)  # exact: silent
    as_shapes = profiled.as_shapes
    rng = np.random.default_rng(0)

    def noisy(events):  # a machine that swings each step by up to 2x either way
        shapes, times = as_shapes(events)
        return shapes, [t * rng.uniform(0.5, 2.0) for t in times]

    monkeypatch.setattr(profiled, "as_shapes", noisy)
    with pytest.warns(RuntimeWarning, match=r"fit is off by .* of their mean time"):
        ProfiledCostModel.fit(trace.events, features)

"""``benchmarks/simulator.py`` on tiny sizes: each measurement runs and reports what it
says it does (keys, counts, finite numbers, the replayed decisions). No timing is asserted:
the numbers are the benchmark's to report, not the test's to judge."""

from __future__ import annotations

import inspect
import math

from benchmarks import simulator
from llmlab.sim.report import ACCURACY_METRICS


def finite(values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_the_synthetic_stream_is_lazy_seeded_and_in_arrival_order():
    stream = simulator.synthetic_requests(300, 100.0, seed=5, chunk=64)
    assert inspect.isgenerator(stream)
    requests = list(stream)
    assert len(requests) == 300
    times = [r.arrival_time for r in requests]
    assert times[0] == 0.0 and times == sorted(times)
    assert all(50 <= r.num_prompt_tokens <= 150 and 5 <= r.max_tokens <= 30 for r in requests)
    assert all(simulator.LOW <= t < simulator.VOCAB_SIZE
               for r in requests for t in r.prompt_token_ids)
    again = list(simulator.synthetic_requests(300, 100.0, seed=5, chunk=64))
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in requests]
    at_once = list(simulator.synthetic_requests(10, None))
    assert {r.arrival_time for r in at_once} == {0.0}


def test_a_speed_run_reports_rates_speedup_and_memory(capsys):
    (row,) = simulator.speed([200], isolated=False)
    assert "requests" in capsys.readouterr().out
    assert row["num_requests"] == 200
    assert row["num_steps"] > 0 and row["num_tokens"] > 200 * (50 + 5)
    keys = ("wall_s", "requests_per_s", "steps_per_s", "us_per_step", "simulated_s",
            "speedup", "in_flight_mean", "ttft_mean_s", "ttft_p99_s", "peak_rss_mib",
            "rss_growth_mib")
    assert finite(row[k] for k in keys)


def test_the_pool_sweep_takes_the_same_decisions_with_every_pool():
    rows = simulator.pool_sweep([1024, 8192], n=200, verbose=False, isolated=False)
    assert [r["num_blocks"] for r in rows] == [1024, 8192]
    assert len({r["num_steps"] for r in rows}) == 1  # the pool is never short
    assert len({r["simulated_s"] for r in rows}) == 1
    assert finite(r["us_per_step"] for r in rows)


def test_the_queue_sweep_holds_the_queue_at_its_size():
    rows = simulator.queue_sweep([10, 40], steps=5, verbose=False, isolated=False)
    assert [r["num_waiting"] for r in rows] == [10, 40]
    for r in rows:
        assert 0 < r["num_running"] <= 16
        assert finite((r["us_per_step"], r["us_per_step_median"], r["us_per_add"]))


def test_accuracy_on_tiny_workloads_reports_every_metric_and_replays_the_decisions():
    targets = simulator.target_workloads(num_requests=8, num_conversations=3, num_turns=2)
    out = simulator.accuracy(
        repeats=1,
        calibration=simulator.calibration_workload(10),
        targets=targets,
        warmup=simulator.calibration_workload(6, seed=101, rate=None),
        short_warmup=simulator.calibration_workload(3, seed=102, rate=None),
        verbose=False,
    )
    assert set(out["workloads"]) == {"calibration", "bursty_decode", "long_prompt",
                                     "shared_prefix_chat"}
    assert set(out["profiled"]) == set(out["profiled_one_run"]) == {"decode", "prefill"}
    for name, w in out["workloads"].items():
        for key in ("real_mean", "real_spread", "profiled", "profiled_error",
                    "profiled_one_run", "profiled_one_run_error", "roofline", "roofline_error"):
            assert set(w[key]) == set(ACCURACY_METRICS), (name, key)
            assert finite(w[key].values()), (name, key, w[key])
        assert all(len(v) == 1 for v in w["real_runs"].values())
        for regime in ("decode", "prefill"):
            assert set(w["step_time_error"][regime]) == {"num_steps", "measured_mean_s", "error"}
        (check,) = w["replay"]
        assert check["identical"], (name, check["differences"])
        assert check["summary"]["num_admissions"] == w["num_requests"]
    assert out["workloads"]["shared_prefix_chat"]["replay"][0]["summary"][
        "prefix_hit_blocks"] > 0
    # The same draws on an overlapped engine, priced overlapped (and as sync, for contrast).
    assert set(out["overlapped"]["workloads"]) == set(out["workloads"])
    for name, w in out["overlapped"]["workloads"].items():
        for key in ("real_mean", "profiled", "profiled_error", "profiled_as_sync",
                    "profiled_as_sync_error", "roofline_error", "roofline_host_error"):
            assert set(w[key]) == set(ACCURACY_METRICS), (name, key)
            assert finite(w[key].values()), (name, key, w[key])
        assert all(len(v) == 1 for v in w["real_runs"].values())
        for regime in ("decode", "prefill"):
            assert set(w["step_time_error_baseline"][regime]) == {
                "num_steps", "measured_mean_s", "error"}
    assert set(out["host"]) >= {"per_step_s", "executor_per_step_s"}

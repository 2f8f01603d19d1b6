"""The simulator: how fast it runs (requests and steps per second) and how close it comes.

``speed``: a synthetic stream (prompts uniform in [50, 150] tokens, outputs in [5, 30]: about
118 tokens a request, so 10^4 requests is about a million tokens), generated lazily a chunk
at a time (never a ``Workload`` in memory), Poisson arrivals at ``--rate``, through
``simulate`` with 256 sequences, 8192 batched tokens and 16,384 KV blocks, priced by a
roofline of a Llama-3-8B-shaped model on an H100 preset (bf16): a cheap, fixed cost model,
and a deployment whose real time a simulation should beat. The default rate, 450 req/s, is
90% of what that model serves (about 500 req/s, compute-bound: all requests at once drain
at that rate), so the engine is busy every step and the queue still stable. The scheduler
runs the built-in model's settings (vocab, context). Each size runs in a fresh process, so
its peak RSS is its own. Reported: wall seconds, simulated requests/s and steps/s,
simulated seconds / wall seconds (the speed-up over real time), the mean requests in flight
(Little's law), TTFT p99 (a growing queue would show here), peak RSS and its growth over
the process's baseline. ``--full`` adds 10^6 requests (minutes).

Pool sweep: the 10^4-request stream with 10^4 .. 10^7 KV blocks
(``num_gpu_blocks_override``): wall per step (the decisions are the same: the pool is never
short), the engine's build time and peak RSS. Queue sweep: a simulated engine of 16
sequences with 10^2 .. 10^5 requests waiting, the queue held at its size (each finished
request replaced by a fresh one), wall per ``Engine.step`` (refilling timed apart). Each
size of a sweep runs in a fresh process too. ``profile``: cProfile of the 10^4 run, the top
functions per simulated step.

``accuracy``: the built-in model (float32, 16 sequences, blocks of 16, 512 blocks, seed 0,
``--threads`` torch threads, default 1: this 2-core machine is shared). One real engine
runs everything, warmed up first on every workload shape with other prompts (a fresh
engine's first steps meet each shape for the first time and run several times slower). It
records the calibration workload (``mixed_long_short``, 120 requests at 30/s; then 40 at
30/s on three long shared prefixes; then 12 short ones 0.25 s apart, each waking an
idle engine), then ``--repeats`` times runs the
calibration workload and three held-out shapes (``bursty_decode``: 5 bursts of 12
decode-heavy requests 0.8 s apart; ``long_prompt``: 60 prompts of 300-480 tokens with
4-16 output tokens at 15/s; ``shared_prefix_chat``: 16 chats x 5 turns at 40/s),
each repeat drawn with its own seed (so no run finds an earlier one's prompts in the prefix
cache), workloads interleaved so load drift hits all alike. ``ProfiledCostModel`` is fitted
on every recording of the calibration workload (the fit on the first recording alone is
shown as "1 run"). Each drawn workload is simulated once (deterministic) with the profiled
model and with the ``roofline`` model on ``this_machine``, as is and with its host term
fitted on the calibration recordings ("+host": ``RooflineCostModel.fit_host``); real and
simulated means over the repeats are compared. Reported per workload and metric
(``ACCURACY_METRICS``): the real mean, its spread over the repeats ((max - min) / mean: the
noise floor, which includes the different draws), each model's value and signed error; the
profiled model's error on the real runs' own step shapes (its error before queueing
amplifies it); and, for every real run, a replay (``ReplayCostModel``: each simulated step
ends when the real one did) whose decisions are compared with the real ones: per-request
output tokens, admission order, preemptions, prefix-hit blocks, steps.

Overlapped (on by default; ``--no-overlap`` skips it): a second real engine with
``async_scheduling=True`` (the engine thread schedules and commits while an executor thread
runs the batch; on a CPU torch releases the GIL inside its kernels), warmed up alike, runs
the same draws, each right after the synchronous run of the same workload. The simulator
prices those steps overlapped (``max(device, hidden host) + unhidden host``): the profiled
model (fitted on the synchronous calibration runs) given the host term (``HostCost``: this
machine's defaults from ``benchmarks.host_overhead``, or ``--host-overhead PATH`` for that
benchmark's ``--json``), and both rooflines; "as sync" is the profiled model priced
synchronously, as the simulator did before it learned overlap. No replay there: the
simulated engine steps synchronously, so its decisions are not the overlapped engine's.

    python -m benchmarks.simulator                      # speed, sweeps and accuracy
    python -m benchmarks.simulator speed --full         # adds 10^6 requests
    python -m benchmarks.simulator accuracy --repeats 5 --threads 1
    python -m benchmarks.simulator accuracy --host-overhead host.json   # its host term
    python -m benchmarks.simulator profile
    python -m benchmarks.simulator --json results.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import datetime
import itertools
import json
import math
import multiprocessing
import os
import pstats
import resource
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from llmlab.experiments.driver import run_workload, workload_params
from llmlab.experiments.metrics import summarize
from llmlab.experiments.workloads import (
    Workload,
    WorkloadRequest,
    bursts,
    chain,
    few_shot,
    mixed_long_short,
    shared_prefix_chat,
)
from llmlab.sim import ModelShape, RooflineCostModel, sim_engine, simulate
from llmlab.sim.report import ACCURACY_METRICS, errors

# -- speed -------------------------------------------------------------------------------

VOCAB_SIZE = 1536  # the built-in model's; prompts draw from [LOW, VOCAB_SIZE)
LOW = 2
PROMPT_LEN = (50, 150)
OUTPUT_LEN = (5, 30)
RATE = 450.0
HARDWARE = "h100"
SPEED_SETTINGS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192,
                  "num_gpu_blocks_override": 16384}
# Llama-3-8B's dimensions (its config.json): what the speed runs are priced as.
LLAMA3_8B = ModelShape(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, intermediate_size=14336, vocab_size=128256)
LLAMA3_8B_NAME = "Llama-3-8B shape"


def synthetic_requests(n: int, rate: float | None = RATE, *, seed: int = 0,
                       prompt_len: tuple[int, int] = PROMPT_LEN,
                       output_len: tuple[int, int] = OUTPUT_LEN,
                       chunk: int = 4096) -> Iterator[WorkloadRequest]:
    """``n`` requests, drawn a chunk at a time as they are read (memory stays flat in
    ``n``): Poisson arrivals at ``rate`` (None: all at 0), uniform lengths (inclusive)."""
    rng = np.random.default_rng(seed)
    now = 0.0
    for start in range(0, n, chunk):
        size = min(chunk, n - start)
        gaps = rng.exponential(1.0 / rate, size) if rate else np.zeros(size)
        if start == 0:
            gaps[0] = 0.0
        times = (now + np.cumsum(gaps)).tolist()
        now = times[-1]
        prompts = rng.integers(prompt_len[0], prompt_len[1] + 1, size).tolist()
        outputs = rng.integers(output_len[0], output_len[1] + 1, size).tolist()
        tokens = rng.integers(LOW, VOCAB_SIZE, sum(prompts)).tolist()
        at = 0
        for t, p, o in zip(times, prompts, outputs, strict=True):
            yield WorkloadRequest(t, tuple(tokens[at:at + p]), o)
            at += p


def speed_cost_model(hardware: str = HARDWARE) -> RooflineCostModel:
    return RooflineCostModel(LLAMA3_8B, hardware, dtype_bytes=2)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure_speed(n: int, rate: float | None = RATE, *, hardware: str = HARDWARE,
                  settings: Mapping[str, Any] = SPEED_SETTINGS, seed: int = 0) -> dict:
    """Simulate ``n`` streamed synthetic requests once; what it cost."""
    cost = speed_cost_model(hardware)
    # Imports, first-call costs: not part of the run (and the RSS baseline includes them).
    simulate(synthetic_requests(50, rate, seed=seed + 1), cost_model=cost, hardware=hardware,
             progress=False, **settings)
    rss_before = _rss_mib()
    started = time.perf_counter()
    result = simulate(synthetic_requests(n, rate, seed=seed), cost_model=cost,
                      hardware=hardware, progress=False, **settings)
    total_s = time.perf_counter() - started
    overall, requests = result.overall, result.requests
    sim_s = float(overall["makespan_s"])
    tokens = int(requests["num_prompt_tokens"].sum() + requests["num_output_tokens"].sum())
    return {
        "num_requests": n,
        "rate": rate,
        "num_tokens": tokens,
        "num_steps": result.num_steps,
        "wall_s": result.wall_s,
        "build_s": total_s - result.wall_s,
        "requests_per_s": n / result.wall_s,
        "steps_per_s": result.num_steps / result.wall_s,
        "us_per_step": result.wall_s / result.num_steps * 1e6,
        "simulated_s": sim_s,
        "speedup": sim_s / result.wall_s,
        "in_flight_mean": float(requests["e2e_s"].sum()) / sim_s,
        "ttft_mean_s": float(overall["ttft_mean_s"]),
        "ttft_p99_s": float(overall["ttft_p99_s"]),
        "peak_rss_mib": _rss_mib(),
        "rss_growth_mib": _rss_mib() - rss_before,
    }


def _run(isolated: bool, function, /, **kwargs):
    """``function(**kwargs)``, in a fresh process when ``isolated`` (spawned: its peak RSS
    is its own, and no earlier run's heap slows it down)."""
    if not isolated:
        return function(**kwargs)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(function, **kwargs).result()


def speed(sizes: Sequence[int], rate: float | None = RATE, *, hardware: str = HARDWARE,
          isolated: bool = True) -> list[dict]:
    """:func:`measure_speed` at each size, printed as a table."""
    print(f"\n== speed: synthetic stream at {rate} req/s, {LLAMA3_8B_NAME} on {hardware} "
          f"(roofline), {_settings_text(SPEED_SETTINGS)}")
    print(f"{'requests':>9} {'tokens':>10} {'steps':>7} {'wall s':>7} {'req/s':>8} "
          f"{'steps/s':>8} {'us/step':>7} {'sim s':>7} {'x real':>6} {'in flight':>9} "
          f"{'TTFT p99':>8} {'RSS MiB':>7} {'growth':>6}")
    rows = []
    for n in sizes:
        r = _run(isolated, measure_speed, n=n, rate=rate, hardware=hardware)
        rows.append(r)
        print(f"{n:>9,} {r['num_tokens']:>10,} {r['num_steps']:>7,} {r['wall_s']:>7.2f} "
              f"{r['requests_per_s']:>8,.0f} {r['steps_per_s']:>8,.0f} {r['us_per_step']:>7,.0f} "
              f"{r['simulated_s']:>7.1f} {r['speedup']:>6.1f} {r['in_flight_mean']:>9.0f} "
              f"{r['ttft_p99_s']:>8.3f} {r['peak_rss_mib']:>7.0f} {r['rss_growth_mib']:>6.0f}",
              flush=True)
    return rows


def pool_sweep(pools: Sequence[int], n: int = 10_000, rate: float | None = RATE, *,
               hardware: str = HARDWARE, verbose: bool = True,
               isolated: bool = True) -> list[dict]:
    """The same stream with each KV pool size: wall per step should not change."""
    if verbose:
        print(f"\n== pool sweep: {n:,} requests at {rate} req/s, KV blocks as given")
        print(f"{'blocks':>11} {'steps':>7} {'wall s':>7} {'us/step':>8} {'build s':>7} "
              f"{'RSS MiB':>7}")
    rows = []
    for num_blocks in pools:
        r = _run(isolated, measure_speed, n=n, rate=rate, hardware=hardware,
                 settings={**SPEED_SETTINGS, "num_gpu_blocks_override": num_blocks})
        r["num_blocks"] = num_blocks
        rows.append(r)
        if verbose:
            print(f"{num_blocks:>11,} {r['num_steps']:>7,} {r['wall_s']:>7.2f} "
                  f"{r['us_per_step']:>8,.0f} {r['build_s']:>7.2f} {r['peak_rss_mib']:>7.0f}",
                  flush=True)
    if verbose:
        _flatness(rows, "num_blocks")
    return rows


def measure_queue(num_waiting: int, *, steps: int = 300, warmup_steps: int = 50,
                  max_num_seqs: int = 16, hardware: str = HARDWARE) -> dict:
    """Wall per ``Engine.step`` of a simulated engine with ``num_waiting`` requests waiting
    (refilled after each step, so the queue stays at its size)."""
    engine = sim_engine(None, cost_model=speed_cost_model(hardware), hardware=hardware,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                        num_gpu_blocks_override=4096)
    source = synthetic_requests(10**9, None, seed=num_waiting)
    ids = itertools.count()
    add_s = 0.0
    num_added = 0

    def refill() -> None:
        nonlocal add_s, num_added
        started = time.perf_counter()
        while engine.scheduler.num_waiting < num_waiting:
            request = next(source)
            engine.add_request(str(next(ids)), {"prompt_token_ids": list(request.prompt_token_ids)},
                               workload_params(request.max_tokens), arrival_time=engine.clock())
            num_added += 1
        add_s += time.perf_counter() - started

    refill()
    for _ in range(warmup_steps):
        engine.step()
        refill()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
        refill()
    return {
        "num_waiting": num_waiting,
        "num_running": len(engine.scheduler.running),
        "steps": steps,
        "us_per_step": float(np.mean(times)) * 1e6,
        "us_per_step_median": float(np.median(times)) * 1e6,
        "us_per_add": add_s / num_added * 1e6,
    }


def queue_sweep(sizes: Sequence[int], *, steps: int = 500, verbose: bool = True,
                isolated: bool = True) -> list[dict]:
    """:func:`measure_queue` at each queue length: wall per step should not change."""
    if verbose:
        print(f"\n== queue sweep: 16 running, the waiting queue held at each size, {steps} steps")
        print(f"{'waiting':>9} {'running':>7} {'us/step':>8} {'median':>7} {'us/add':>7}")
    rows = []
    for size in sizes:
        r = _run(isolated, measure_queue, num_waiting=size, steps=steps)
        rows.append(r)
        if verbose:
            print(f"{size:>9,} {r['num_running']:>7} {r['us_per_step']:>8,.0f} "
                  f"{r['us_per_step_median']:>7,.0f} {r['us_per_add']:>7,.0f}", flush=True)
    if verbose:
        _flatness(rows, "num_waiting", "us_per_step_median")
    return rows


def _flatness(rows: list[dict], key: str, cost: str = "us_per_step") -> None:
    first, last = rows[0], rows[-1]
    print(f"per-step cost ({cost}) at {last[key]:,} relative to {first[key]:,} (1.00 = flat): "
          f"{last[cost] / first[cost]:.2f}")


def profile(n: int = 10_000, rate: float | None = RATE, *, hardware: str = HARDWARE,
            top: int = 25) -> list[dict]:
    """cProfile of one ``n``-request run: the top functions by own time, per simulated step."""
    cost = speed_cost_model(hardware)
    simulate(synthetic_requests(50, rate, seed=1), cost_model=cost, hardware=hardware,
             progress=False, **SPEED_SETTINGS)
    profiler = cProfile.Profile()
    profiler.enable()
    result = simulate(synthetic_requests(n, rate), cost_model=cost, hardware=hardware,
                      progress=False, **SPEED_SETTINGS)
    profiler.disable()
    steps = result.num_steps
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, calls, tottime, cumtime, _)}
    total = sum(tt for _, _, tt, _, _ in stats.values())
    rows = sorted(
        ({"function": f"{os.path.relpath(f) if f.startswith('/') else f}:{line}({name})",
          "calls_per_step": calls / steps, "own_us_per_step": tt / steps * 1e6,
          "cum_us_per_step": ct / steps * 1e6, "own_share": tt / total}
         for (f, line, name), (_, calls, tt, ct, _) in stats.items()),
        key=lambda r: -r["own_us_per_step"],
    )[:top]
    print(f"\n== profile: {n:,} requests, {steps:,} steps, {total:.1f} s under cProfile "
          f"({total / steps * 1e6:,.0f} us/step; unprofiled runs are ~3x faster)")
    print(f"{'own us/step':>11} {'cum us/step':>11} {'calls/step':>10} {'share':>6}  function")
    for r in rows:
        print(f"{r['own_us_per_step']:>11.1f} {r['cum_us_per_step']:>11.1f} "
              f"{r['calls_per_step']:>10.1f} {r['own_share']:>6.1%}  {r['function']}")
    return rows


def _settings_text(settings: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())


# -- accuracy ----------------------------------------------------------------------------

TARGET_ERROR = 0.10  # the simulator's bar on the held-out shapes (issue 42)
ACCURACY_SETTINGS = {"dtype": "float32", "max_num_seqs": 16, "block_size": 16,
                     "num_gpu_blocks_override": 512, "seed": 0}


def calibration_workload(num_requests: int = 120, seed: int = 1,
                         rate: float | None = 30.0, num_sparse: int | None = None,
                         num_prefixed: int | None = None) -> Workload:
    """Long and short requests at ``rate`` (Poisson); then ``num_prefixed`` (default: a
    third) at the same rate that share three long prefixes (short chunks computed over a
    cached prefix: a cost that uncached prompts cannot tell apart from their prefill
    tokens'); then ``num_sparse`` (default: a tenth) short ones 0.25 s apart, each waking an
    idle engine: a fit needs those steps to price the first step after an idle gap,
    which a busy stream rarely has. Each part draws its own seed, no target workload's (a
    shared draw would share prompt blocks, so a real engine's prefix cache would carry
    hits from one run into the next)."""
    mixed = mixed_long_short(
        num_requests, vocab_size=VOCAB_SIZE, long_fraction=0.3, long_prompt_len=(200, 400),
        long_output_len=(32, 96), short_prompt_len=(16, 64), short_output_len=(8, 48),
        rate=rate, seed=seed, low=LOW,
    )
    if rate is None:
        return mixed
    num_sparse = num_requests // 10 if num_sparse is None else num_sparse
    num_prefixed = num_requests // 3 if num_prefixed is None else num_prefixed
    parts = [mixed]
    if num_prefixed:
        parts.append(few_shot(
            num_prefixed, vocab_size=VOCAB_SIZE, num_templates=3, template_len=(150, 300),
            question_len=(8, 32), output_len=(8, 48), rate=rate, seed=20_000 + seed, low=LOW,
        ))
    if num_sparse:
        spaced = mixed_long_short(
            num_sparse, vocab_size=VOCAB_SIZE, long_fraction=0.0, short_prompt_len=(16, 64),
            short_output_len=(8, 48), rate=None, seed=10_000 + seed, low=LOW,
        )
        parts.append(Workload("spaced", [attrs.evolve(r, arrival_time=0.25 * i)
                                         for i, r in enumerate(spaced.requests)]))
    return chain(*parts, name="calibration")


def target_workloads(num_requests: int = 60, num_conversations: int = 16,
                     num_turns: int = 5, seed: int = 0) -> dict[str, Workload]:
    """The held-out shapes (issue 42): decode-heavy bursts with idle gaps between them,
    long prompts with short outputs (prefill-heavy), and multi-turn chats on a shared
    system prompt (prefix hits). None resembles the calibration workload's mix."""
    burst = min(12, num_requests)
    return {
        "bursty_decode": bursts(
            max(1, num_requests // burst), burst, vocab_size=VOCAB_SIZE, gap_s=0.8,
            spread_s=0.05, prompt_len=(16, 48), output_len=(48, 112), seed=2 + seed, low=LOW,
        ),
        "long_prompt": mixed_long_short(
            num_requests, vocab_size=VOCAB_SIZE, long_fraction=1.0,
            long_prompt_len=(300, 480), long_output_len=(4, 16), rate=15.0, seed=4 + seed,
            low=LOW,
        ),
        "shared_prefix_chat": shared_prefix_chat(
            num_conversations, num_turns, vocab_size=VOCAB_SIZE, system_prompt_len=96,
            user_turn_len=(8, 32), output_len=(8, 40), rate=40.0, seed=3 + seed, low=LOW,
        ),
    }


def _real_engine(settings: Mapping[str, Any], threads: int | None):
    from llmlab import LLM
    from llmlab.builtin import builtin_model_path

    return LLM(str(builtin_model_path()), cpu_threads=threads, **settings).llm_engine


def _real_run(engine, workload: Workload) -> dict:
    records, trace = run_workload(engine, workload)
    return {"metrics": summarize(records, trace, workload.users), "records": records,
            "events": list(trace.events)}


def _simulated(workload: Workload, settings: Mapping[str, Any]) -> dict:
    """``settings``: the engine's and the cost model's (``cost_model``, ``hardware``)."""
    from llmlab.builtin import builtin_model_path

    overall = simulate(workload, model=builtin_model_path(), progress=False,
                       **settings).overall
    return {m: float(overall[m]) for m in (*ACCURACY_METRICS, "prefix_hit_rate",
                                           "num_preemptions")}


def decisions(events, records) -> dict:
    """What the scheduler decided in a run: for the replay check."""
    return {
        "output_tokens": [r.num_output_tokens for r in sorted(records, key=lambda r: int(
            r.request_id))],
        "admission_order": [a.request_id for e in events for a in e.admitted],
        "num_preemptions": sum(len(e.preempted) for e in events),
        "prefix_hit_blocks": sum(len(e.blocks_prefix_hit) for e in events),
        "num_steps": sum(1 for e in events if e.scheduled),
    }


def replay_check(run: dict, workload: Workload, settings: Mapping[str, Any]) -> dict:
    """Replay a real run's step times in the simulator; compare the decisions."""
    from llmlab.builtin import builtin_model_path
    from llmlab.runner.executor import VirtualClock
    from llmlab.sim import ReplayCostModel

    events = run["events"]
    first = next(e for e in events if e.arrived)
    t0 = first.arrived[0].arrival_time - workload.requests[0].arrival_time
    clock = VirtualClock()
    replay = ReplayCostModel.of(events, t0, clock)
    engine = sim_engine(builtin_model_path(), cost_model=replay, clock=clock, **settings)
    records, trace = run_workload(engine, workload)
    real, sim = decisions(events, run["records"]), decisions(trace.events, records)
    differences = {}
    for key in real:
        if real[key] != sim[key]:
            differences[key] = _difference(real[key], sim[key])
    latency = errors(run["metrics"], summarize(records, trace, workload.users))
    return {"identical": not differences, "differences": differences,
            "summary": {k: v for k, v in real.items() if not isinstance(v, list)}
            | {"num_admissions": len(real["admission_order"])},
            "metric_errors": latency}


def _difference(real: Any, sim: Any) -> str:
    if not isinstance(real, list):
        return f"real {real}, simulated {sim}"
    at = next((i for i, (a, b) in enumerate(zip(real, sim)) if a != b), min(len(real), len(sim)))
    return (f"lengths {len(real)} vs {len(sim)}; first difference at index {at}: real "
            f"{real[at:at + 5]}, simulated {sim[at:at + 5]}")


def accuracy(*, repeats: int = 3, threads: int | None = 1,
             calibration: Workload | None = None,
             targets: Mapping[str, Workload] | None = None,
             warmup: Workload | None = None, short_warmup: Workload | None = None,
             settings: Mapping[str, Any] = ACCURACY_SETTINGS, overlap: bool = True,
             host: Any = None, verbose: bool = True) -> dict:
    """Calibrate ``profiled`` on the calibration workload's recorded runs, predict the
    others; the fit on the first recording alone, and the roofline, alongside.

    Every real run is on one engine, warmed up first on every workload shape (a fresh
    engine's first steps meet each shape for the first time and run several times slower,
    which no steady engine does). Repeat ``r`` draws every workload with its own seed, so
    no run finds an earlier run's prompts in the prefix cache; each (workload, seed) is
    simulated once, and real and simulated means over the repeats are compared. Given
    workloads (tests) are used as they are for every repeat. ``overlap``: also run every
    draw on an engine with ``async_scheduling=True`` and compare the simulator's overlapped
    prices (``out["overlapped"]``); ``host``: the :class:`~llmlab.sim.HostCost` those use
    (default: ``HostCost()``, this machine's ``benchmarks.host_overhead`` numbers)."""
    from llmlab.sim import HostCost, ProfiledCostModel

    host = host if host is not None else HostCost()

    def draw(repeat: int) -> dict[str, Workload]:
        if calibration is not None or targets is not None:
            return {"calibration": calibration or calibration_workload(),
                    **(targets if targets is not None else target_workloads())}
        seed = 100 * (repeat + 1)
        return {"calibration": calibration_workload(seed=1 + seed),
                **target_workloads(seed=seed)}

    warmup = warmup if warmup is not None else calibration_workload(120, seed=7)
    short_warmup = short_warmup if short_warmup is not None else calibration_workload(
        16, seed=102, rate=None)
    drawn = [draw(r) for r in range(repeats + 1)]  # the first: the recorded calibration
    loops = {"sync": {**settings, "async_scheduling": False}}  # whatever the device's default
    if overlap:
        loops["overlap"] = {**settings, "async_scheduling": True}

    def warmed(loop: str, short: bool):
        engine = _real_engine(loops[loop], threads)
        if short:
            run_workload(engine, short_warmup, keep_events=False)
            return engine
        run_workload(engine, warmup, keep_events=False)
        run_workload(engine, short_warmup, keep_events=False)
        for workload in target_workloads(seed=1000).values():  # every shape, other prompts
            run_workload(engine, workload, keep_events=False)
        return engine

    # Given workloads repeat their prompts: each run then needs an empty prefix cache, so
    # a fresh engine (after a short warm-up); drawn ones differ and share the warm engine.
    fresh = calibration is not None or targets is not None
    engines = {loop: warmed(loop, short=False) for loop in loops
               if loop == "sync" or not fresh}
    recorded = _real_run(engines["sync"], drawn[0]["calibration"])
    names = list(drawn[0])
    runs: dict[str, dict[str, list[dict]]] = {loop: {n: [] for n in names} for loop in loops}
    for r in range(repeats):  # interleaved: load drift hits every workload and loop alike
        for name in names:
            for loop in loops:
                if not fresh:
                    runs[loop][name].append(_real_run(engines[loop], drawn[r + 1][name]))
                    continue
                engine = warmed(loop, short=True)
                runs[loop][name].append(_real_run(engine, drawn[r + 1][name]))
                engine.shutdown()
    for engine in engines.values():
        engine.shutdown()
    del engines
    # This machine's load moves step times from one run to the next, so the main fit
    # pools every recording of the calibration workload (as the real figures are means
    # over runs); the fit on the first recording alone shows what one run gives.
    one = ProfiledCostModel.fit(recorded["events"])
    calibration_events = [e for r in [recorded, *runs["sync"]["calibration"]]
                          for e in r["events"]]
    pooled = ProfiledCostModel.fit(calibration_events)
    out: dict[str, Any] = {"settings": dict(settings), "threads": threads, "repeats": repeats,
                           "profiled": pooled.describe(), "profiled_one_run": one.describe(),
                           "profiled_steps": pooled.num_steps,
                           "host": attrs.asdict(host), "workloads": {}}
    from llmlab.builtin import builtin_model_path
    from llmlab.sim import RooflineCostModel

    roofline = RooflineCostModel.for_model(
        str(builtin_model_path()), hardware="this_machine", dtype=settings["dtype"], host=host)
    roofline_host = roofline.fit_host(calibration_events)
    models = {"profiled": {"cost_model": pooled}, "profiled_one_run": {"cost_model": one},
              "roofline": {"cost_model": roofline},
              "roofline_host": {"cost_model": roofline_host}}
    out["workloads"] = _accuracy_rows(names, drawn, runs["sync"], models, settings, repeats,
                                      pooled)
    for name, row in out["workloads"].items():
        row["replay"] = [replay_check(runs["sync"][name][r], drawn[r + 1][name], settings)
                         for r in range(repeats)]
    if overlap:
        overlapped = attrs.evolve(pooled, host=host)
        models = {"profiled": {"cost_model": overlapped},
                  "profiled_as_sync": {"cost_model": pooled, "async_scheduling": False},
                  "roofline": {"cost_model": roofline},
                  "roofline_host": {"cost_model": roofline_host}}
        out["overlapped"] = {"workloads": _accuracy_rows(
            names, drawn, runs["overlap"], models, loops["overlap"], repeats,
            attrs.evolve(overlapped, overlap=True), step_baseline=pooled)}
    out["recorded_calibration"] = {m: recorded["metrics"][m] for m in ACCURACY_METRICS}
    if verbose:
        print(f"\n== accuracy: built-in model, {_settings_text(settings)}, cpu_threads={threads}; "
              f"{repeats} real runs per workload; profiled fitted on {pooled.num_steps} steps of "
              f"{repeats + 1} calibration runs ('1 run': on {one.num_steps} steps of the first)")
        _print_accuracy(out)
        if overlap:
            print(f"\n== accuracy, overlapped: the same draws on an engine with "
                  f"async_scheduling=True, priced max(device, hidden host) + unhidden host; "
                  f"host term {_host_text(host)}")
            _print_overlapped(out["overlapped"])
    return out


def _host_text(host) -> str:
    return (f"engine thread {host.per_step_s * 1e6:.0f} us + {host.per_request_s * 1e6:.1f} "
            f"us/request, executor thread {host.executor_per_step_s * 1e6:.0f} us + "
            f"{host.executor_per_request_s * 1e6:.1f} us/request")


def _accuracy_rows(names, drawn, runs, models, settings, repeats, step_model,
                   step_baseline=None) -> dict:
    """Per workload: the real runs' metrics, their mean and spread, and each model's
    simulated means and signed errors; ``step_model``'s error on the real steps (and
    ``step_baseline``'s, when given)."""
    rows = {}
    for name in names:
        values = {m: [r["metrics"][m] for r in runs[name]] for m in ACCURACY_METRICS}
        real = {m: float(np.mean(v)) for m, v in values.items()}
        row = {
            "num_requests": len(drawn[1][name]),
            "real_runs": values,
            "real_mean": real,
            "real_spread": {m: (max(v) - min(v)) / real[m] if real[m] else math.nan
                            for m, v in values.items()},
        }
        for label, cost in models.items():
            simulated_runs = [_simulated(drawn[r + 1][name], {**settings, **cost})
                              for r in range(repeats)]
            simulated = {m: float(np.mean([s[m] for s in simulated_runs]))
                         for m in ACCURACY_METRICS}
            row[label] = simulated
            row[f"{label}_error"] = errors(real, simulated)
        row["step_time_error"] = step_time_error(step_model, [r["events"] for r in runs[name]])
        if step_baseline is not None:
            row["step_time_error_baseline"] = step_time_error(
                step_baseline, [r["events"] for r in runs[name]])
        rows[name] = row
    return rows


def step_time_error(cost, runs_events) -> dict[str, dict[str, float]]:
    """Per regime (pure decode steps, the rest), over the real runs' steps: the mean
    measured cycle time and the model's signed error on those same shapes, which is the
    cost model's own error, before queueing amplifies it into latencies."""
    from llmlab.sim.cost_model import as_shapes

    sums = {"decode": [0, 0.0, 0.0], "prefill": [0, 0.0, 0.0]}
    for events in runs_events:
        for shape, seconds in zip(*as_shapes(events), strict=True):
            cell = sums["decode" if shape.is_decode else "prefill"]
            cell[0] += 1
            cell[1] += seconds
            cell[2] += cost.step_time(shape)
    return {regime: {"num_steps": n, "measured_mean_s": measured / n if n else math.nan,
                     "error": predicted / measured - 1 if measured else math.nan}
            for regime, (n, measured, predicted) in sums.items()}


def _print_error_table(out: dict, second: str, label: str) -> None:
    """The per-metric table of simulated errors and each model's summary line; ``second``:
    the extra profiled column (``profiled_one_run`` or ``profiled_as_sync``)."""
    print(f"{'workload':<19} {'metric':<12} {'real ms':>8} {'spread':>7} {'profiled':>9} "
          f"{'error':>7} {label:>7} {'roofline':>9} {'error':>7} {'+host':>7}")
    for name, w in out["workloads"].items():
        for m in ACCURACY_METRICS:
            print(f"{name:<19} {m:<12} {w['real_mean'][m] * 1e3:>8.1f} "
                  f"{w['real_spread'][m]:>7.1%} {w['profiled'][m] * 1e3:>9.1f} "
                  f"{w['profiled_error'][m]:>+7.1%} {w[f'{second}_error'][m]:>+7.1%} "
                  f"{w['roofline'][m] * 1e3:>9.1f} {w['roofline_error'][m]:>+7.1%} "
                  f"{w['roofline_host_error'][m]:>+7.1%}")
    for model in ("profiled", second, "roofline", "roofline_host"):
        cells = [(abs(w[f"{model}_error"][m]), w["real_spread"][m])
                 for name, w in out["workloads"].items()
                 if name != "calibration" for m in ACCURACY_METRICS]
        within = sum(e <= 0.05 for e, _ in cells)
        # Issue 42's bar: within 10% of the real mean, or within the real runs' own spread
        # where that is larger.
        target = sum(e <= max(TARGET_ERROR, spread) for e, spread in cells)
        print(f"{model}: {within} of {len(cells)} target cells within 5%, {target} within "
              f"{TARGET_ERROR:.0%} or the real spread, largest |error| "
              f"{max(e for e, _ in cells):.1%}")


def _print_accuracy(out: dict) -> None:
    _print_error_table(out, "profiled_one_run", "(1 run)")
    print("profiled step time on the real runs' own steps (measured mean, model's error):")
    for name, w in out["workloads"].items():
        cells = "  ".join(
            f"{regime} {c['num_steps']} steps {c['measured_mean_s'] * 1e3:.2f} ms "
            f"{c['error']:+.1%}" for regime, c in w["step_time_error"].items())
        print(f"  {name:<19} {cells}")
    for name, w in out["workloads"].items():
        for i, check in enumerate(w["replay"], start=1):
            summary = ", ".join(f"{k}={v}" for k, v in check["summary"].items())
            worst = max(abs(e) for e in check["metric_errors"].values())
            verdict = "identical decisions" if check["identical"] else (
                "DIFFERENT decisions: " + "; ".join(
                    f"{k}: {v}" for k, v in check["differences"].items()))
            print(f"replay {name} run {i}: {verdict} ({summary}; largest metric error "
                  f"{worst:.2e})")


def _print_overlapped(out: dict) -> None:
    _print_error_table(out, "profiled_as_sync", "as sync")
    print("profiled step time on the real overlapped runs' own steps (measured mean, the "
          "model's error priced overlapped / as sync):")
    for name, w in out["workloads"].items():
        cells = "  ".join(
            f"{regime} {c['num_steps']} steps {c['measured_mean_s'] * 1e3:.2f} ms "
            f"{c['error']:+.1%} / {w['step_time_error_baseline'][regime]['error']:+.1%}"
            for regime, c in w["step_time_error"].items())
        print(f"  {name:<19} {cells}")


# -- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", default="all",
                        choices=("all", "speed", "pool", "queue", "accuracy", "profile"))
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e3, 1e4, 1e5],
                        help="requests per speed run")
    parser.add_argument("--full", action="store_true", help="add 10^6 requests to --sizes")
    parser.add_argument("--rate", type=float, default=RATE, help="speed runs' arrivals, req/s")
    parser.add_argument("--hardware", default=HARDWARE, help="the speed runs' roofline preset")
    parser.add_argument("--pools", nargs="+", type=float, default=[1e4, 1e5, 1e6, 1e7])
    parser.add_argument("--queues", nargs="+", type=float, default=[1e2, 1e3, 1e4, 1e5])
    parser.add_argument("--repeats", type=int, default=3, help="real runs per workload")
    parser.add_argument("--threads", type=int, default=1,
                        help="the real engine's cpu_threads (0: llmlab's default)")
    parser.add_argument("--no-overlap", dest="overlap", action="store_false",
                        help="accuracy: skip the overlapped (async_scheduling=True) runs")
    parser.add_argument("--host-overhead", nargs="+", metavar="PATH",
                        help="accuracy: the host term from benchmarks.host_overhead --json "
                        "files (default: HostCost(), this machine's numbers)")
    parser.add_argument("--json", metavar="PATH", help="write every number here")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes] + ([10**6] if args.full else [])
    print(f"{datetime.date.today()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}")
    results: dict[str, Any] = {}
    if args.what in ("all", "speed"):
        results["speed"] = speed(sizes, args.rate, hardware=args.hardware)
    if args.what in ("all", "pool"):
        results["pool"] = pool_sweep([int(p) for p in args.pools], rate=args.rate,
                                     hardware=args.hardware)
    if args.what in ("all", "queue"):
        results["queue"] = queue_sweep([int(q) for q in args.queues])
    if args.what == "profile":
        results["profile"] = profile(rate=args.rate, hardware=args.hardware)
    if args.what in ("all", "accuracy"):
        from llmlab.sim import HostCost

        host = HostCost.from_host_overhead(*args.host_overhead) if args.host_overhead else None
        results["accuracy"] = accuracy(repeats=args.repeats, threads=args.threads or None,
                                       overlap=args.overlap, host=host)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=float)


if __name__ == "__main__":
    main()

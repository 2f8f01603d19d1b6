"""What watching costs: the default CPU throughput workload with and without views attached.

Same process, same engine, same workload (``benchmarks.throughput``'s CPU defaults: a
random-weight Llama, 64 requests, prompts U[16, 256], outputs U[16, 128], greedy), run in
interleaved rounds under each mode:

* ``none``: no observer;
* ``kv-view``: a live ``KVCacheView`` with its widget built, so it folds every event into
  its state and re-renders the grid's HTML at its default interval (0.25 s, within its
  2% draw budget) and once when the engine goes idle (no browser is attached: sending
  the widget state to a front end happens on the kernel's I/O thread, not in the step);
* ``all-views``: ``KVCacheView`` + ``SchedulerTimeline`` + ``MetricsPanel``, widgets built
  (the two plots re-render a PNG with matplotlib at most once a second);
* ``record``: ``Engine.record`` to a JSON Lines file.

Two numbers per mode: the time spent inside the observers (timed around each call, so
exact) as a percentage of the engine's step time, and the wall-time ratio to ``none``
(median of the rounds, the order of modes rotated each round; noisier, it includes the
machine's jitter, and the final draw each view makes on a timer thread once the run is
over). The issue's target is
under 5% of step time with a view attached.

    python -m benchmarks.viz_overhead            # ~2 min on 2 cores
    python -m benchmarks.viz_overhead --rounds 1 --num-requests 16   # quick look
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import tempfile
import time

import torch

from benchmarks.common import ModelShape, build_benchmark_model, make_workload
from benchmarks.throughput import DEVICE_DEFAULTS, _hf_config, build_llmlab, run_llmlab

MODES = ("none", "kv-view", "all-views", "record")


class _Timed:
    """Wraps an observer and adds up the time spent in it."""

    def __init__(self, observer) -> None:
        self.observer = observer
        self.seconds = 0.0

    def __call__(self, event) -> None:
        start = time.perf_counter()
        try:
            self.observer(event)
        finally:
            self.seconds += time.perf_counter() - start


def _attach(mode: str, llm, tmp: pathlib.Path):
    """Attach the mode's observers, each wrapped in a timer; returns (timers, detach)."""
    from llmlab.viz import KVCacheView, MetricsPanel, SchedulerTimeline

    engine = llm.llm_engine
    if mode == "none":
        return [], lambda: None
    if mode == "record":
        recorder = engine.record(tmp / "run.jsonl")
        engine.unsubscribe(recorder)
        timed = [_Timed(recorder)]
        closers = [recorder.close]
    else:
        kinds = [KVCacheView] if mode == "kv-view" else [KVCacheView, SchedulerTimeline, MetricsPanel]
        views = [kind(llm) for kind in kinds]
        timed = []
        for view in views:
            view.widget  # noqa: B018 - build the widget: redraws happen only once it exists
            engine.unsubscribe(view._on_event)
            timed.append(_Timed(view._on_event))
        closers = [view.close for view in views]
    for t in timed:
        engine.subscribe(t)

    def detach() -> None:
        for t in timed:
            engine.unsubscribe(t)
        for close in closers:
            close()

    return timed, detach


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=DEVICE_DEFAULTS["cpu"]["num_requests"])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    torch.set_num_threads(args.threads)
    defaults = DEVICE_DEFAULTS["cpu"]
    with tempfile.TemporaryDirectory(prefix="llmlab-viz-bench-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        model_dir = build_benchmark_model(tmp / "model", seed=0, device="cpu")
        shape = ModelShape.from_hf_config(_hf_config(model_dir))
        workload = make_workload(
            args.num_requests, args.seed, shape.vocab_size,
            defaults["prompt_len_range"], defaults["output_len_range"],
        )  # fmt: skip
        engine_args = argparse.Namespace(
            device="cpu", attention_backend=None, enforce_eager=False, max_num_seqs=256,
            max_num_batched_tokens=defaults["max_num_batched_tokens"], block_size=16,
            dtype="float32", torch_dtype=torch.float32, cpu_linear=None,
            decode_batch=0, decode_steps=0,  # no decode split here: no room kept for it
        )  # fmt: skip
        llm = build_llmlab(model_dir, workload, engine_args)
        steps = []
        llm.llm_engine.subscribe(lambda e: steps.append(e.wall_time_s))
        print(
            f"model: {shape}, float32; workload: {workload.num_requests} requests, "
            f"{workload.num_prompt_tokens} prompt + {workload.num_output_tokens} output tokens; "
            f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs, "
            f"load {os.getloadavg()[0]:.2f}"
        )
        run_llmlab(llm, make_workload(4, 1, shape.vocab_size, (16, 32), (4, 8)))  # warm-up
        walls: dict[str, list[float]] = {m: [] for m in modes}
        shares: dict[str, list[float]] = {m: [] for m in modes}
        num_steps = 0
        for round_index in range(args.rounds):
            # Rotate the order each round: the first run of a round tends to be faster.
            shift = round_index % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                timed, detach = _attach(mode, llm, tmp)
                steps.clear()
                try:
                    result = run_llmlab(llm, workload)
                finally:
                    detach()
                observer_s = sum(t.seconds for t in timed)
                # Observers run inside the step, after its clock stopped: add them.
                step_s = sum(steps) + observer_s
                walls[mode].append(result.wall_s)
                shares[mode].append(observer_s / step_s)
                num_steps = len(steps)
        base = statistics.median(walls["none"]) if "none" in walls else None
        print(f"{num_steps} steps per run, {args.rounds} round(s), modes interleaved (rotated)")
        print(f"{'mode':<10} {'wall s (median)':>16} {'vs none':>8} {'observers % of step':>20}")
        for mode in modes:
            wall = statistics.median(walls[mode])
            ratio = f"{wall / base:.3f}" if base else "-"
            share = 100 * statistics.median(shares[mode])
            print(f"{mode:<10} {wall:>16.2f} {ratio:>8} {share:>19.2f}%")
        for mode in modes:
            if mode != "none":
                share = 100 * statistics.median(shares[mode])
                verdict = "meets" if share < 5 else "MISSES"
                print(f"target (< 5% of step time) with {mode}: {verdict} ({share:.2f}%)")


if __name__ == "__main__":
    main()

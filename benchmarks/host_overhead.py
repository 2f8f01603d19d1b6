"""The engine's host work per decode step, on any CPU: the real engine around a model that
costs nothing (or a fixed, GIL-free time).

Each point runs the built-in ``llmlab-stories`` engine (its tokenizer, scheduler, KV cache
manager, runner, sampler and output processing, all real) with the model swapped for one
from :mod:`llmlab.testing.host_models`:

* ``null``: logits at no cost. Host work per step = step wall - time inside the model
  (a gather from a logits table; greedy sampling stays in the host figure).
* ``fixed``: a forward that sleeps ``--forward-ms`` (the GIL released, as while a GPU
  kernel runs). A synchronous loop's step is the sleep plus the host work; a loop that
  overlaps them should come close to the sleep alone.

Requests report as ``LLM.generate``'s do (``FINAL_ONLY``: nothing per step until they end,
the offline path the issue's baseline figures come from); ``--output-kind delta`` builds a
streaming server's one-token output per request per step, ``cumulative`` the whole text so
far (its cost grows with the output).

At each count of running requests (``--running``; all decode, none finishing while timed)
the loop is timed over ``--steps`` steps, ``--repeats`` times, each repeat on a fresh
engine; it prints the median per-step figure and the repeats' spread, then a split of the
host work by stage (a separate timed pass: the wrappers cost a little themselves).
Targets (issue 41, this 2-core machine): null host work <= 0.35 ms at 64 running and
<= 1.0 ms at 256, growth from 256 to 1,024 under 4x; with a 10 ms fixed forward at 256
running, an overlapped step <= 1.05 x 10 ms.

    python -m benchmarks.host_overhead                  # ~2 min on 2 cores
    python -m benchmarks.host_overhead --running 64 --repeats 1 --model-kind null   # a look
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from llmlab.engine.builder import EngineBuilder
from llmlab.sampling.params import RequestOutputKind, SamplingParams
from llmlab.testing.host_models import FixedTimeModel, NullModel, swap_model

TARGETS_MS = {64: 0.35, 256: 1.0}  # null-model host work per decode step
GROWTH_TARGET = 4.0  # host work at 1,024 running / at 256
OVERLAP_TARGET = 1.05  # overlapped step wall / the fixed forward time
# The built-in model's KV per token: 4 layers x (K + V) x 2 heads x 64 dims x fp32.
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4


def build(num_running: int, max_tokens: int, loop: str):
    """An eager float32 engine on the built-in model sized for ``num_running`` requests."""
    settings = {} if loop == "default" else {"async_scheduling": loop == "overlap"}
    kv_tokens = num_running * (max_tokens + 64) * 2
    return EngineBuilder.from_settings(
        "llmlab-stories", dtype="float32", enforce_eager=True, max_num_seqs=num_running,
        max_num_batched_tokens=max(2048, 16 * num_running),
        kv_cache_memory_bytes=kv_tokens * KV_BYTES_PER_TOKEN, **settings,
    ).build()


OUTPUT_KINDS = {"final": RequestOutputKind.FINAL_ONLY, "delta": RequestOutputKind.DELTA,
                "cumulative": RequestOutputKind.CUMULATIVE}


def run_point(num_running: int, steps: int, kind: str, forward_ms: float, loop: str,
              stages: bool = False, output_kind: str = "final") -> dict:
    """One repeat: a fresh engine, ``num_running`` requests decoding, ``steps`` timed steps.
    Returns per-step medians in ms (``wall``, ``model``, ``host`` = wall - model)."""
    warmup = 8
    max_tokens = warmup + 2 * steps + 8  # nobody finishes while timed (twice: the stages)
    engine = build(num_running, max_tokens, loop)
    vocab = engine.executor.model.vocab_size
    model = NullModel(vocab) if kind == "null" else FixedTimeModel(vocab, forward_ms / 1e3)
    swap_model(engine, model)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                            output_kind=OUTPUT_KINDS[output_kind])
    for i in range(num_running):
        engine.add_request(f"r{i}", f"Once upon a time, {i} little foxes", params)
    while engine.scheduler.num_waiting:  # every request prefilled and running
        engine.step()
    for _ in range(warmup):
        engine.step()
    running = engine.scheduler.num_unfinished
    if running != num_running:
        raise RuntimeError(f"{running} of {num_running} requests running after warmup")
    walls, models = [], []
    for _ in range(steps):
        before = model.seconds
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        models.append(model.seconds - before)
    result = {
        "wall_ms": 1e3 * statistics.median(walls),
        "model_ms": 1e3 * statistics.median(models),
        "host_ms": 1e3 * statistics.median(w - m for w, m in zip(walls, models, strict=True)),
    }
    if stages:
        result["stages_ms"] = _stages(engine, model, steps)
    engine.shutdown()
    return result


def _stages(engine, model, steps: int) -> dict:
    from benchmarks.throughput import _timed_stages, host_stages

    before = model.seconds
    start = time.perf_counter()
    with _timed_stages(engine) as totals:
        for _ in range(steps):
            engine.step()
    wall = time.perf_counter() - start
    return host_stages(totals, model.seconds - before, wall, steps)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-kind", choices=["null", "fixed", "both"], default="both")
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--fixed-running", type=int, default=256,
                        help="running requests for the fixed-time model")
    parser.add_argument("--loop", choices=["sync", "overlap", "both", "default"],
                        default="default",
                        help="the engine's loop: synchronous, overlapped (async_scheduling), "
                        "both in turn, or the engine's default")
    parser.add_argument("--output-kind", choices=list(OUTPUT_KINDS), default="final",
                        help="what each request reports per step (default: LLM.generate's)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (the host work is one Python thread)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loops = ["sync", "overlap"] if args.loop == "both" else [args.loop]
    report: dict = {"steps": args.steps, "repeats": args.repeats,
                    "output_kind": args.output_kind, "null": {}, "fixed": {}}
    print(f"host work per decode step, median of {args.steps} steps; repeats: {args.repeats} "
          f"fresh engines (min..max of their medians); outputs: {args.output_kind}")
    for loop in loops:
        if args.model_kind in ("null", "both"):
            print(f"\n== null model, loop={loop}")
            print(f"{'running':>8} {'host ms':>9} {'spread':>15} {'us/req':>7} {'target':>7}")
            for n in args.running:
                reps = [run_point(n, args.steps, "null", 0.0, loop, output_kind=args.output_kind)
                        for _ in range(args.repeats)]
                hosts = [r["host_ms"] for r in reps]
                med = statistics.median(hosts)
                target = TARGETS_MS.get(n)
                report["null"].setdefault(loop, {})[n] = {"host_ms": med, "repeats": hosts}
                print(f"{n:>8} {med:>9.3f} {min(hosts):>7.3f}..{max(hosts):<7.3f}"
                      f"{1e3 * med / n:>7.1f} {'' if target is None else f'{target:.2f}':>7}")
            points = report["null"][loop]
            if 256 in points and 1024 in points:
                growth = points[1024]["host_ms"] / points[256]["host_ms"]
                report["null"][loop]["growth_256_1024"] = growth
                print(f"growth 256 -> 1,024 running: {growth:.2f}x (target < {GROWTH_TARGET}x)")
            split_n = 256 if 256 in args.running else args.running[-1]
            split = run_point(split_n, args.steps, "null", 0.0, loop, stages=True,
                              output_kind=args.output_kind)["stages_ms"]
            report["null"][loop]["stages_ms"] = {"running": split_n, **split}
            print(f"host work by stage at {split_n} running (ms/step): " + ", ".join(
                f"{k} {v:.3f}" for k, v in split.items()))
        if args.model_kind in ("fixed", "both"):
            n = args.fixed_running
            reps = [run_point(n, args.steps, "fixed", args.forward_ms, loop,
                              output_kind=args.output_kind) for _ in range(args.repeats)]
            walls = [r["wall_ms"] for r in reps]
            med = statistics.median(walls)
            ratio = med / args.forward_ms
            report["fixed"][loop] = {"running": n, "forward_ms": args.forward_ms,
                                     "wall_ms": med, "repeats": walls, "ratio": ratio}
            print(f"\n== fixed {args.forward_ms:g} ms forward, {n} running, loop={loop}: "
                  f"step wall {med:.2f} ms ({min(walls):.2f}..{max(walls):.2f}) = "
                  f"{ratio:.3f} x the forward (overlapped target <= {OVERLAP_TARGET})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()

"""Generation speed on an idle machine and beside one competing CPU-bound process.

Each mode runs in a fresh Python process (the OpenMP wait policy is read once, when torch
loads), first alone, then while one busy-loop process (``while True: pass``) holds a core.
The workload is ``llmlab generate``'s on the built-in model: 8 prompts x 64 greedy tokens,
timed after one warm-up generation, median of ``--repeats``. Modes:

* ``llmlab``: llmlab's own thread setup (``llmlab.threads``: a thread per usable core, one
  fewer per other running task, a short OpenMP spin before a waiting thread sleeps);
* ``before``: what torch does by itself, as llmlab ran before ``llmlab.threads``: a thread
  per core whatever else runs (``OMP_NUM_THREADS``) and the OpenMP runtime's default
  spin (``GOMP_SPINCOUNT=300000``);
* ``all-cores``: llmlab's short spin with a thread per core whatever else runs
  (``LLMLAB_CPU_THREADS``): the spin's share of the difference;
* ``passive``: ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once), a thread per core;
* ``one-thread``: ``LLMLAB_CPU_THREADS=1``.

    python -m benchmarks.contention [--modes llmlab,before] [--repeats 3]

Prints tokens/s per mode idle and busy, and busy / idle slowdown (the issue's bound: <= 3x).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _modes() -> dict[str, dict[str, str]]:
    from llmlab.threads import available_cpus

    cores = str(available_cpus())
    return {
        "llmlab": {},
        "before": {"OMP_NUM_THREADS": cores, "GOMP_SPINCOUNT": "300000"},
        "all-cores": {"LLMLAB_CPU_THREADS": cores},
        "passive": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": cores},
        "one-thread": {"LLMLAB_CPU_THREADS": "1"},
    }


MODES = _modes()
# The variables a mode may set: cleared first so the parent's environment does not leak in.
CONTROLLED = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS", "LLMLAB_CPU_THREADS")

CHILD = r"""
import json, statistics, sys, time
import llmlab
import torch
from llmlab import LLM, SamplingParams

repeats = int(sys.argv[1])
from llmlab.builtin import builtin_model_path
llm = LLM(str(builtin_model_path()), seed=0)
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
prompts = [f"Once upon a time, there was a {w}" for w in
           ("boy", "girl", "cat", "dog", "bird", "fox", "frog", "bear")]
llm.generate(prompts, params, use_tqdm=False)
times = []
for _ in range(repeats):
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    times.append(time.perf_counter() - start)
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"tok_s": tokens / statistics.median(times), "threads": torch.get_num_threads(),
                  "times": times}))
"""


def run_mode(mode: str, repeats: int, busy: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CONTROLLED}
    env.update(MODES[mode])
    hog = None
    if busy:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, str(repeats)], env=env,
                              capture_output=True, text=True, timeout=1800)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    if done.returncode != 0:
        raise RuntimeError(f"mode {mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="llmlab,before,all-cores,one-thread")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {sorted(MODES)}")
    from llmlab.threads import available_cpus

    print(f"{time.strftime('%Y-%m-%d')}, {available_cpus()} usable CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; 8 prompts x 64 greedy tokens on the built-in model, "
          f"median of {args.repeats}")
    results = {}
    print(f"{'mode':<11} {'threads':>7} {'idle tok/s':>10} {'busy tok/s':>10} {'slowdown':>9}")
    for mode in modes:
        idle = run_mode(mode, args.repeats, busy=False)
        busy = run_mode(mode, args.repeats, busy=True)
        slowdown = idle["tok_s"] / busy["tok_s"]
        results[mode] = {"idle": idle, "busy": busy, "slowdown": slowdown}
        print(f"{mode:<11} {idle['threads']:>7} {idle['tok_s']:>10.0f} {busy['tok_s']:>10.0f} "
              f"{slowdown:>8.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()

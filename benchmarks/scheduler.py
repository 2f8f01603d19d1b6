"""Scheduler host cost per step at 10^3..10^5 waiting requests and 256 running, per policy.

Each step runs ``Scheduler.schedule`` and ``Scheduler.update`` with no model (every
scheduled request that completes its span gets one token). The 256 running requests have
random output lengths, so a few finish and a few waiting ones are admitted every step; each
admission is replaced by a fresh arrival, so the queue stays at its size throughout. Prompts
share prefixes (8 system prompts) so ``cache_aware`` has something to find.

Baseline, in the same process: ``sort_v1``, a policy in the version-1 form (the README's
``order(waiting, now)`` that sorts the whole queue by prompt length every step, through the
v1 adapter), which is what a per-step re-sort costs. The ratio column is baseline time /
policy time at the same queue length.

Run: ``python -m benchmarks.scheduler [--sizes 1e3 1e4 1e5] [--steps 50]``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

from llmlab import registry
from llmlab.cache import KVCacheManager
from llmlab.request import Request
from llmlab.sampling.params import SamplingParams
from llmlab.scheduler import BatchOutput, Scheduler

NUM_RUNNING = 256
BLOCK_SIZE = 16
PROMPT_LEN = (32, 512)
OUTPUT_LEN = (16, 256)


class SortEveryStep:
    """The version-1 form: re-sort every waiting request each step (the baseline)."""

    name = "sort_v1"

    def order(self, waiting, now):
        return sorted(waiting, key=lambda r: r.num_prompt_tokens)

    def victim(self, candidates):
        return max(candidates, key=lambda r: r.arrival_time)


def make_policy(name: str):
    return SortEveryStep() if name == "sort_v1" else registry.create("scheduling_policy", name)


class Workload:
    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.ids = itertools.count()
        self.systems = [[self.rng.randrange(1000) for _ in range(256)] for _ in range(8)]

    def request(self, now: float) -> Request:
        rng = self.rng
        n = rng.randrange(*PROMPT_LEN)
        system = self.systems[rng.randrange(8)]
        prompt = system[: min(n, 256)] + [rng.randrange(1000) for _ in range(max(0, n - 256))]
        request = Request(
            request_id=str(next(self.ids)),
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=rng.randrange(*OUTPUT_LEN), ignore_eos=True),
            arrival_time=now,
            priority=rng.randrange(4),
            user=f"u{rng.randrange(16)}",
        )
        return request


def measure(policy_name: str, num_waiting: int, steps: int) -> float:
    """Mean seconds per step (schedule + update) with the queue at ``num_waiting``."""
    work = Workload()
    max_tokens = PROMPT_LEN[1] + OUTPUT_LEN[1]
    num_blocks = (NUM_RUNNING + 64) * (max_tokens // BLOCK_SIZE + 1)
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    sched = Scheduler(
        kv=kv, max_num_seqs=NUM_RUNNING, max_num_batched_tokens=8192,
        max_model_len=max_tokens + 1, policy=make_policy(policy_name),
    )
    now = 0.0
    for _ in range(num_waiting + NUM_RUNNING):
        sched.add(work.request(now))
    # Replacements are built before timing: building a request is the client's cost.
    spare = [work.request(0.0) for _ in range(NUM_RUNNING * (steps + 40))]

    def step(now: float) -> None:
        batch = sched.schedule(now)
        out = BatchOutput.from_lists(
            [[7] * e.num_scored for e in batch.entries], [[0.0] * e.num_scored for e in batch.entries]
        )
        sched.update(batch, out)
        errors = sched.take_errors()
        if errors:
            raise errors[0]
        for _ in range(num_waiting - sched.num_waiting):  # keep the queue at its size
            request = spare.pop()
            request.arrival_time = now
            sched.add(request)

    while len(sched.running) < NUM_RUNNING or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in sched.running
    ):  # warm up: fill the rows, finish the prefills
        now += 0.01
        step(now)
    start = time.perf_counter()
    for _ in range(steps):
        now += 0.01
        step(now)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e3, 1e4, 1e5])
    parser.add_argument(
        "--policies", nargs="+", default=["sort_v1", *registry.available("scheduling_policy")]
    )
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes]
    print(f"ms per step (schedule + update), {NUM_RUNNING} running, queue held at each size;")
    print("ratio = sort_v1 / policy at the same size (higher is better)\n")
    print(f"{'policy':>12} " + " ".join(f"{n:>10,} {'ratio':>6}" for n in sizes))
    baseline = {n: measure("sort_v1", n, args.steps) for n in sizes}
    growth = {}
    for name in args.policies:
        times = baseline if name == "sort_v1" else {n: measure(name, n, args.steps) for n in sizes}
        growth[name] = times[sizes[-1]] / times[sizes[0]]
        cells = " ".join(f"{times[n] * 1e3:>10.2f} {baseline[n] / times[n]:>6.1f}" for n in sizes)
        print(f"{name:>12} {cells}", flush=True)
    print(f"\nper-step cost at {sizes[-1]:,} waiting relative to {sizes[0]:,} (1.00 = flat):")
    print("  " + "  ".join(f"{name}={g:.2f}" for name, g in growth.items()))


if __name__ == "__main__":
    main()

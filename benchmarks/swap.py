"""Swap vs recompute preemption on a workload that preempts heavily.

Every request has a long prompt and the device KV pool holds a quarter of the prompts and
two more blocks, so once they decode the scheduler preempts again and again. The baseline
is preemption by recompute (the default: the victim's blocks are freed and its whole context is
prefilled again when it resumes); ``preemption_mode="swap"`` copies the victim's blocks
to a host pool and back, so it resumes where it stopped. Both run the same workload in
the same process, on the same weights, after a warm-up; the script checks that they
produce the same greedy tokens and prints, per prompt length, the end-to-end time of
each, their ratio, preemptions and the prefill tokens each computed (recompute prefills
every victim's context again).

Then a soak: many mixed requests (shared prefixes, parallel samples, aborts) under a tiny
device pool with swap and the offload tier both on, calling the KV cache manager's
``check()`` (device pool, swap space, offload tier) after every step.

Run: ``python -m benchmarks.swap [--prompt-lens 128,256,512] [--threads N]``; the
benchmark model of ``benchmarks/common.py`` (random weights, built offline).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import tempfile
import time

import torch

from benchmarks.common import build_benchmark_model
from llmlab import LLM, SamplingParams


def _run(llm: LLM, prompts, params):
    engine = llm.llm_engine
    stats = {"preempted": 0, "swapped": 0, "prefill": 0}

    def count(event):
        stats["preempted"] += len(event.preempted)
        stats["swapped"] += len(event.swapped_out)
        stats["prefill"] += event.num_prefill_tokens

    engine.subscribe(count)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats["seconds"] = time.perf_counter() - start
    engine.unsubscribe(count)
    return [o.outputs[0].token_ids for o in outputs], stats


def compare_modes(model: str, prompt_len: int, args) -> dict:
    rng = random.Random(prompt_len)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 8000) for _ in range(prompt_len)]}
        for _ in range(args.num_requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    block_size = 16
    # Room for a quarter of the prompts and a little: they are admitted, then their
    # decodes outgrow the pool, and the newest is preempted again and again (each
    # resumption needs its context back).
    prompt_blocks = -(-prompt_len // block_size)
    settings = dict(
        dtype="float32", device="cpu", seed=0, block_size=block_size,
        max_model_len=prompt_len + args.max_tokens, max_num_seqs=args.num_requests,
        max_num_batched_tokens=512, cpu_threads=args.threads,
        num_gpu_blocks_override=max(
            args.num_requests // 4 * prompt_blocks + 2,
            -(-(prompt_len + args.max_tokens) // block_size),
        ),
    )
    result = {"prompt_len": prompt_len}
    tokens = {}
    for mode in ("recompute", "swap"):
        llm = LLM(model, preemption_mode=mode, swap_space=1.0, **settings)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        tokens[mode], stats = _run(llm, prompts, params)
        result[mode] = stats
        del llm
    result["same_tokens"] = tokens["recompute"] == tokens["swap"]
    return result


def soak(model: str, args) -> tuple[int, dict]:
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 8000) for _ in range(rng.randrange(32, 96))] for _ in range(8)]
    llm = LLM(model, dtype="float32", device="cpu", seed=0, block_size=16, max_model_len=256,
              max_num_seqs=16, num_gpu_blocks_override=24, preemption_mode="swap",
              swap_space=0.05, kv_offloading_size=0.02, kv_offloading_eviction_policy="arc",
              cpu_threads=args.threads)
    engine, kv = llm.llm_engine, llm.llm_engine.kv_cache
    seen = {"steps": 0, "swapped": 0, "spilled": 0, "loaded": 0, "aborted": 0}

    def check(event):
        kv.check()
        seen["steps"] += 1
        seen["swapped"] += len(event.swapped_out)
        seen["spilled"] += len(event.blocks_spilled)
        seen["loaded"] += len(event.blocks_loaded)

    engine.subscribe(check)
    for i in range(args.soak_requests):
        tail = [rng.randrange(3, 8000) for _ in range(rng.randrange(1, 32))]
        prompt = rng.choice(prefixes) + tail
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 24), ignore_eos=True,
                                n=rng.choice((1, 1, 2)))
        engine.add_request(f"soak-{i}", {"prompt_token_ids": prompt}, params)
        if rng.random() < 0.6:
            engine.step()
        if rng.random() < 0.05:
            engine.abort_request(f"soak-{rng.randrange(i + 1)}")
            seen["aborted"] += 1
    while engine.has_unfinished_requests():
        engine.step()
    kv.check()
    leaked = int(kv.pool.ref_counts.sum()) + kv.swap.num_used_blocks
    return leaked, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-lens", default="128,256,512")
    parser.add_argument("--num-requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--soak-requests", type=int, default=600)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--model", default=None, help="default: the benchmark model")
    args = parser.parse_args()
    model = args.model
    if model is None:
        model = str(build_benchmark_model(pathlib.Path(tempfile.mkdtemp()) / "bench"))
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs; "
          f"{args.num_requests} requests x {args.max_tokens} tokens; pool: a quarter of the "
          "prompts + 2 blocks")
    print(f"{'prompt':>6} {'recompute s':>11} {'swap s':>7} {'ratio':>6} "
          f"{'preempt r/s':>11} {'swapped':>7} {'prefill r/s':>13} same")
    for prompt_len in (int(n) for n in args.prompt_lens.split(",")):
        r = compare_modes(model, prompt_len, args)
        rec, swp = r["recompute"], r["swap"]
        ratio = rec["seconds"] / swp["seconds"]
        print(f"{prompt_len:>6} {rec['seconds']:>11.3f} {swp['seconds']:>7.3f} {ratio:>5.2f}x "
              f"{rec['preempted']:>5}/{swp['preempted']:<5} {swp['swapped']:>7} "
              f"{rec['prefill']:>6}/{swp['prefill']:<6} {r['same_tokens']}")
    leaked, seen = soak(model, args)
    print(f"soak: {args.soak_requests} requests, {seen['steps']} steps, check() clean after "
          f"every step; {seen['swapped']} swapped out, {seen['spilled']} blocks spilled, "
          f"{seen['loaded']} loaded, {seen['aborted']} aborts; blocks held at the end: {leaked}")


if __name__ == "__main__":
    main()

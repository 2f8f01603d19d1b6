"""``python -m benchmarks.distributed dp``: data parallelism's throughput and routing
(the module docstring of :mod:`benchmarks.distributed` says what is measured)."""

from __future__ import annotations

import argparse
import collections

from benchmarks.common import make_workload
from benchmarks.distributed import _generate


def _builtin():
    from llmlab.builtin import ensure_builtin_model

    return str(ensure_builtin_model())


def throughput(args: argparse.Namespace, model: str, vocab: int) -> dict:
    """One engine on one thread against two replicas of one thread each."""
    from llmlab import LLM

    workload = make_workload(args.dp_requests, args.seed, vocab, (16, 128), (32, 96))
    warmup = make_workload(4, args.seed + 1, vocab, (16, 64), (1, 8))
    results = {}
    for name, dp in (("1 engine", 1), ("2 replicas", 2)):
        llm = LLM(model, device="cpu", seed=0, cpu_threads=1, data_parallel_size=dp)
        try:
            _generate(llm, warmup)
            wall = _generate(llm, workload)
        finally:
            shutdown = getattr(llm.llm_engine, "shutdown", None)
            if shutdown is not None:
                shutdown()
        results[name] = {"wall_s": wall, "output_tok_s": workload.num_output_tokens / wall}
    ratio = results["2 replicas"]["output_tok_s"] / results["1 engine"]["output_tok_s"]
    results["ratio"] = ratio
    print(f"dp throughput: {workload.num_requests} requests, {workload.num_output_tokens} "
          "output tokens, 1 thread per engine")
    for name in ("1 engine", "2 replicas"):
        row = results[name]
        print(f"  {name:12s} {row['output_tok_s']:8.1f} output tok/s ({row['wall_s']:.1f} s)")
    print(f"  2 replicas / 1 engine: {ratio:.2f}x (target >= 1.7x)")
    return results


def _rounds(args: argparse.Namespace, vocab: int):
    """The multi-turn workload as rounds: round k holds turn k of every chat."""
    from llmlab.experiments.workloads import shared_prefix_chat

    workload = shared_prefix_chat(
        args.sessions, args.turns, vocab_size=vocab, system_prompt_len=32,
        user_turn_len=24, output_len=24, seed=args.seed, low=2,
    )
    turn = collections.Counter()
    rounds: dict[int, list] = collections.defaultdict(list)
    for request in workload.requests:
        rounds[turn[request.session]].append(request)
        turn[request.session] += 1
    return [rounds[k] for k in sorted(rounds)]


def prefix_hits(args: argparse.Namespace, model: str, vocab: int) -> dict:
    """Prefix-cache hit rate of the multi-turn workload over two replicas, per router."""
    from llmlab import LLM, SamplingParams

    rounds = _rounds(args, vocab)
    results = {}
    for router in ("round_robin", "prefix_aware"):
        llm = LLM(model, device="cpu", seed=0, cpu_threads=1, data_parallel_size=2,
                  router=router)
        queried = cached = 0
        per_replica = collections.Counter()

        def count(replica, event):
            nonlocal queried, cached
            for admission in event.admitted:
                if not admission.resumed:
                    queried += admission.num_prompt_tokens
                    cached += admission.num_cached_tokens
            per_replica[replica] += len(event.admitted)

        llm.llm_engine.subscribe(count, replica=True)
        try:
            for requests in rounds:
                prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
                params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                         ignore_eos=True) for r in requests]
                llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        results[router] = {"hit_rate": cached / max(1, queried),
                           "admitted_per_replica": dict(per_replica)}
    print(f"prefix hits: {args.sessions} chats x {args.turns} turns over 2 replicas")
    for router, row in results.items():
        print(f"  {router:13s} hit rate {row['hit_rate']:.1%}  "
              f"admissions per replica {row['admitted_per_replica']}")
    return results


def run_dp(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig

    model = _builtin()
    vocab = AutoConfig.from_pretrained(model).vocab_size
    return {"throughput": throughput(args, model, vocab),
            "prefix_hits": prefix_hits(args, model, vocab)}

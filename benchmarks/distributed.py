"""Past one device: tensor parallelism's overhead and data parallelism's scaling, on CPU.

``tp``: the default CPU throughput workload (``benchmarks.throughput``: the benchmark Llama,
64 requests, prompts U[16, 256], outputs U[16, 128], greedy, ``ignore_eos``, float32) run by
``LLM.generate`` three ways in one process: one rank on every core (``--threads``), one rank
on one thread, and ``tensor_parallel_size=2`` over gloo with one thread per rank (the same
cores as the first). Each engine is warmed up on 4 short requests from another seed. Reported:
output tokens/s, the ratio to each one-rank run, and the share of rank 0's step time spent in
the model's collectives (``TensorParallel.stats``: all-reduces and the logits all-gather,
waiting for the other rank included) and in broadcasting the batch. On 2 cores this
measures correctness's overhead, not a speed-up: each rank does half the math, then waits on
loopback TCP twice per layer.

``dp``: ``--dp-requests`` requests streamed at once into ``LLM(..., data_parallel_size=2)``
(two replicas in two processes, one thread each) against one replica in one process on one
thread, both behind the same front end code path; output tokens/s and the ratio (target >=
1.7x). Then a multi-turn workload (``--sessions`` chats of ``--turns`` turns, each turn's
prompt the previous turn's prompt and answer plus a new message, turns sent in rounds) through
two replicas with ``round_robin`` and with ``prefix_aware``: the prefix-cache hit rate (prompt
tokens served from cache over prompt tokens) summed over the replicas' step events.

    python -m benchmarks.distributed tp
    python -m benchmarks.distributed dp
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import torch

from benchmarks.common import Workload, build_benchmark_model, make_workload


def _generate(llm, workload: Workload) -> float:
    from llmlab import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    got = sum(len(o.outputs[0].token_ids) for o in outputs)
    if got != workload.num_output_tokens:
        raise AssertionError(f"generated {got} tokens, asked for {workload.num_output_tokens}")
    return wall


def _tp_engine(model_dir: pathlib.Path, tp: int, threads: int, kv_bytes: int):
    from llmlab import LLM

    return LLM(str(model_dir), device="cpu", dtype="float32", seed=0, skip_tokenizer_init=True,
               tensor_parallel_size=tp, cpu_threads=threads, kv_cache_memory_bytes=kv_bytes,
               max_num_batched_tokens=2048)


def run_tp(args: argparse.Namespace) -> dict:
    model_dir = args.model_dir / "tp-model"
    if not (model_dir / "config.json").exists():
        build_benchmark_model(model_dir)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    workload = make_workload(args.num_requests, args.seed, vocab)
    warmup = make_workload(4, args.seed + 1, vocab, (16, 64), (1, 8))
    kv_bytes = 512 * 2**20
    results = {}
    for name, tp, threads in (("1 rank, all threads", 1, args.threads),
                              ("1 rank, 1 thread", 1, 1),
                              ("2 ranks (gloo), 1 thread each", 2, 1)):
        llm = _tp_engine(model_dir, tp, threads, kv_bytes)
        _generate(llm, warmup)
        executor = llm.llm_engine.executor
        stats = getattr(getattr(executor, "runner", executor).model, "tp", None)
        stats = stats.stats if stats is not None and stats.is_parallel else None
        before = (stats.seconds, stats.calls) if stats else (0.0, 0)
        broadcast_before = getattr(getattr(executor, "workers", None), "broadcast_seconds", 0.0)
        wall = _generate(llm, workload)
        row = {"wall_s": wall, "output_tok_s": workload.num_output_tokens / wall}
        if stats is not None:
            row["collective_share"] = (stats.seconds - before[0]) / wall
            row["collectives"] = stats.calls - before[1]
            row["broadcast_share"] = (
                executor.workers.broadcast_seconds - broadcast_before) / wall
            executor.shutdown()
        results[name] = row
        del llm
    base_all, base_one = results["1 rank, all threads"], results["1 rank, 1 thread"]
    tp2 = results["2 ranks (gloo), 1 thread each"]
    tp2["vs_1_rank_all_threads"] = tp2["output_tok_s"] / base_all["output_tok_s"]
    tp2["vs_1_rank_1_thread"] = tp2["output_tok_s"] / base_one["output_tok_s"]
    print(f"workload: {workload.num_requests} requests, {workload.num_prompt_tokens} prompt "
          f"and {workload.num_output_tokens} output tokens; torch {torch.__version__}")
    for name, row in results.items():
        extra = ""
        if "collective_share" in row:
            extra = (f"  collectives {row['collective_share']:.0%} of wall "
                     f"({row['collectives']} calls), batch broadcast "
                     f"{row['broadcast_share']:.1%}; {row['vs_1_rank_all_threads']:.2f}x of "
                     f"1 rank on all threads, {row['vs_1_rank_1_thread']:.2f}x of 1 rank on 1")
        print(f"{name:32s} {row['output_tok_s']:8.1f} output tok/s ({row['wall_s']:.1f} s)"
              f"{extra}")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("tp", "dp", "all"), nargs="?", default="all")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--model-dir", type=pathlib.Path, default=None)
    parser.add_argument("--dp-requests", type=int, default=512)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir is None:
            args.model_dir = pathlib.Path(tmp)
        results = {}
        if args.what in ("tp", "all"):
            results["tp"] = run_tp(args)
        if args.what in ("dp", "all"):
            from benchmarks.distributed_dp import run_dp

            results["dp"] = run_dp(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

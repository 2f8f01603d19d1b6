"""Multi-LoRA throughput: a batch mixing 4 adapters and the base model vs the base model alone.

One process, one random-weight model (the CPU throughput benchmark's Llama,
``benchmarks.common.BENCH_MODEL_CONFIG``, or the CUDA one with ``--device cuda``), one
workload (``benchmarks.common.make_workload``: random prompts of 16-256 tokens, outputs of
16-128, greedy, ``ignore_eos``), three ways to run it, each timed on the same requests:

* ``base``: ``LLM(model)`` (no LoRA: nothing is wrapped), every request on the base model;
* ``lora-off``: ``LLM(model, enable_lora=True, max_loras=4)`` with every request on the base
  model: what carrying the slots costs when no request uses them;
* ``mixed``: the same engine, requests assigned round-robin to 4 random rank-``--rank``
  PEFT adapters (all seven projections targeted) and the base model, so most steps hold
  all five.

Throughput counts output tokens; total tokens/s adds the prompts. Each mode runs once
untimed on a few short requests first (one-time costs, adapter loading into slots); then
``--rounds`` rounds, each running the three modes in turn, a different one first each
round (so drift and cache state hit all alike); prefix caching is off, so every round
computes every prompt. Reported per
mode: the fastest round's wall time (on a shared machine other work only ever adds time,
so the minimum is the least disturbed) and the process CPU time of that round, each with
its ratio against ``base``. The adapters are written as PEFT
directories (``adapter_config.json`` + ``adapter_model.safetensors``) with random non-zero
A and B; their outputs differ from the base model's (checked).

Run: ``python -m benchmarks.lora [--num-requests 32] [--rank 16] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import tempfile
import time

import torch

from benchmarks.common import BENCH_MODELS, build_benchmark_model, make_workload

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: pathlib.Path, config: dict, rank: int, seed: int) -> str:
    """A PEFT-format LoRA adapter of the Llama described by ``config`` (random A and B)."""
    from safetensors.torch import save_file

    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    shapes = {  # (in, out)
        "self_attn.q_proj": (hidden, heads * head_dim),
        "self_attn.k_proj": (hidden, kv_heads * head_dim),
        "self_attn.v_proj": (hidden, kv_heads * head_dim),
        "self_attn.o_proj": (heads * head_dim, hidden),
        "mlp.gate_proj": (hidden, inner),
        "mlp.up_proj": (hidden, inner),
        "mlp.down_proj": (inner, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (d_in, d_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * d_in**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "use_rslora": False,
    }))
    return str(out)


def run(llm, workload, loras) -> tuple[float, float, list[list[int]]]:
    from llmlab import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in workload.output_lens]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall, cpu, [list(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=pathlib.Path)
    parser.add_argument("--json", type=pathlib.Path, help="also write the results here")
    args = parser.parse_args(argv)

    from llmlab import LLM, LoRARequest

    torch.set_num_threads(args.threads)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="llmlab-lora-bench-"))
    model_dir = args.model_dir or tmp / "model"
    if not (model_dir / "config.json").exists():
        build_benchmark_model(model_dir, seed=args.seed, device=args.device)
    config = BENCH_MODELS[args.device][1]
    adapters = [
        LoRARequest(f"adapter-{i}", i + 1,
                    write_adapter(tmp / f"adapter-{i}", config, args.rank, seed=100 + i))
        for i in range(args.num_adapters)
    ]
    workload = make_workload(args.num_requests, args.seed, config["vocab_size"])
    warmup = make_workload(args.num_adapters + 1, args.seed + 1, config["vocab_size"]).head(
        args.num_adapters + 1, 4)
    cycle = [*adapters, None]
    mixed_loras = [cycle[i % len(cycle)] for i in range(workload.num_requests)]
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    # No prefix caching: every round computes the whole workload again (a round after the
    # first would otherwise find its prompts cached).
    shared = dict(dtype=dtype, device=args.device, skip_tokenizer_init=True, seed=0,
                  enable_prefix_caching=False,
                  cpu_threads=args.threads if args.device == "cpu" else None)
    base_llm = LLM(str(model_dir), **shared)
    lora_llm = LLM(str(model_dir), enable_lora=True, max_loras=args.num_adapters,
                   max_lora_rank=args.rank, **shared)
    modes = {
        "base": (base_llm, None),
        "lora-off": (lora_llm, None),
        "mixed": (lora_llm, mixed_loras),
    }
    for llm, loras in modes.values():  # untimed: one-time costs, adapters into slots
        run(llm, warmup, None if loras is None else cycle[: warmup.num_requests])
    walls: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
    tokens: dict[str, list[list[int]]] = {}
    names = list(modes)
    for i in range(args.rounds):
        for name in names[i % 3:] + names[: i % 3]:  # each mode goes first in turn
            llm, loras = modes[name]
            wall, cpu, tokens[name] = run(llm, workload, loras)
            walls[name].append((wall, cpu))
    if tokens["base"] != tokens["lora-off"]:
        raise SystemExit("an engine with LoRA slots but no adapter changed the base tokens")
    changed = sum(t != b for t, b, r in zip(tokens["mixed"], tokens["base"], mixed_loras)
                  if r is not None)
    if not changed:
        raise SystemExit("the adapters changed no output: the benchmark would prove nothing")
    out_tokens, prompt_tokens = workload.num_output_tokens, workload.num_prompt_tokens
    results = {}
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} threads, {args.device}; {workload.num_requests} requests, "
          f"{prompt_tokens} prompt + {out_tokens} output tokens; {args.num_adapters} "
          f"adapters of rank {args.rank}; fastest of {args.rounds} rounds; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'mode':10} {'wall s':>8} {'out tok/s':>10} {'total tok/s':>12} {'vs base':>8} "
          f"{'cpu s':>7} {'cpu vs base':>11}")
    base_wall, base_cpu = min(walls["base"])
    for name in modes:
        wall, cpu = min(walls[name])
        results[name] = {"wall_s": wall, "cpu_s": cpu, "rounds": walls[name],
                         "output_tok_s": out_tokens / wall,
                         "ratio_vs_base": base_wall / wall, "cpu_ratio_vs_base": base_cpu / cpu}
        print(f"{name:10} {wall:8.2f} {out_tokens / wall:10.1f} "
              f"{(out_tokens + prompt_tokens) / wall:12.1f} {base_wall / wall:7.2f}x "
              f"{cpu:7.2f} {base_cpu / cpu:10.2f}x")
    print(f"mixed ({args.num_adapters} adapters + base) / base alone: "
          f"{results['mixed']['ratio_vs_base']:.2f}x (target >= 0.8); "
          f"{changed} adapter requests' outputs differ from the base model's")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=2))
    return results


if __name__ == "__main__":
    main()

"""Weight-only quantization on CPU: throughput, perplexity, and the linear kernels.

Three measurements, each against its baseline in the same process:

* Throughput (``--only throughput``): the offline throughput benchmark's CPU workload
  (``benchmarks/throughput.py``: its Llama model, random weights, 64 requests, prompts
  U[16, 256], outputs U[16, 128], greedy, ``ignore_eos``, the same engine settings and KV
  cache sizing) through ``LLM.generate`` in four engines: float32, bfloat16, int8 with
  float32 activations and int8 with bfloat16 activations. Each engine first runs a
  warmup workload from another seed; then the engines take turns over ``--rounds``
  rounds and each one's fastest round counts (turns, because a shared machine's load
  drifts). Printed: output tokens/s and the ratio of each int8 engine to its float one.
* Perplexity (``--only perplexity``): the built-in ``llmlab-stories`` model on held-out
  stories, ``--stories`` of them from ``llmlab.builtin.stories`` with seed 1 (the model
  was trained on seed 0; seed 1 is the held-out set its docstring reports, 1.470 in
  float32 from fp16-rounded weights), each scored on its own (``<s>`` story ``</s>``,
  every token after ``<s>``) from the engine's ``prompt_logprobs``, in float32 and in
  int8. Target: int8 within 2% of float32.
* Kernels (``--only kernels``): the benchmark model's linear shapes at 1, 8, 64 and 2048
  rows, each way llmlab could run them (the numbers behind ``Int8Linear``'s choice).

Run::

    python -m benchmarks.quantization
    python -m benchmarks.quantization --only perplexity --stories 64
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import tempfile
import time

import torch

from benchmarks.common import ModelShape, build_benchmark_model, make_workload
from benchmarks.throughput import kv_tokens_needed, run_llmlab

SECTIONS = ("throughput", "perplexity", "kernels")
# (name, dtype, quantization): the engines the throughput section compares.
ENGINES = (
    ("float32", "float32", None),
    ("bfloat16", "bfloat16", None),
    ("int8 (float32 act.)", "float32", "int8"),
    ("int8 (bfloat16 act.)", "bfloat16", "int8"),
)
BASELINE = {"int8 (float32 act.)": "float32", "int8 (bfloat16 act.)": "bfloat16"}
HELDOUT_SEED = 1  # llmlab.builtin.train trains on seed 0 and holds out seed 1


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help="subset of " + ",".join(SECTIONS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="the throughput workload's")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stories", type=int, default=256)
    parser.add_argument("--model-dir", type=pathlib.Path, help="reuse/write the model here")
    return parser.parse_args(argv)


def _cpu_llm(path, dtype, quantization, kv_tokens=None, **extra):
    from llmlab import LLM

    shape = ModelShape.from_hf_config(_hf_config(path))
    kv_bytes = None
    if kv_tokens is not None:
        kv_bytes = kv_tokens * shape.kv_bytes_per_token(torch.empty((), dtype=getattr(
            torch, dtype)).element_size())
    return LLM(
        str(path), dtype=dtype, quantization=quantization, seed=0, device="cpu",
        kv_cache_memory_bytes=kv_bytes, **extra,
    )


def _hf_config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def throughput(args, model_dir: pathlib.Path) -> dict:
    hf_config = _hf_config(model_dir)
    workload = make_workload(args.num_requests, args.seed, hf_config.vocab_size,
                             (16, 256), (16, 128))
    warmup = make_workload(4, args.seed + 1, hf_config.vocab_size, (16, 256), (1, 8))
    kv_tokens = max(kv_tokens_needed(workload, 16), hf_config.max_position_embeddings)
    print(f"workload: {workload.num_requests} requests, {workload.num_prompt_tokens} prompt "
          f"tokens, {workload.num_output_tokens} output tokens (seed {args.seed})")
    engines = {}
    for name, dtype, quantization in ENGINES:
        engines[name] = _cpu_llm(
            model_dir, dtype, quantization, kv_tokens, max_num_seqs=256,
            max_num_batched_tokens=2048, block_size=16, skip_tokenizer_init=True,
        )
        run_llmlab(engines[name], warmup)
    best: dict[str, float] = {}
    for round_index in range(args.rounds):
        for name in engines:
            result = run_llmlab(engines[name], workload)
            tok_s = result.useful_output_tokens / result.wall_s
            best[name] = max(best.get(name, 0.0), tok_s)
            print(f"  round {round_index + 1} {name:22s} {tok_s:8.0f} output tok/s")
    print(f"\n{'engine':22s} {'output tok/s':>12s}  vs float")
    for name, tok_s in best.items():
        ratio = f"{tok_s / best[BASELINE[name]]:.2f}x {BASELINE[name]}" if name in BASELINE else ""
        print(f"{name:22s} {tok_s:12.0f}  {ratio}")
    return best


def story_perplexity(llm, tokenizer, texts) -> float:
    """exp(mean NLL) over every token after ``<s>`` (``</s>`` included), story by story."""
    from llmlab import SamplingParams
    from llmlab.builtin.train import encode_story

    prompts = [{"prompt_token_ids": encode_story(tokenizer, t)} for t in texts]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    nll, count = 0.0, 0
    for prompt, out in zip(prompts, outputs):
        ids = prompt["prompt_token_ids"]
        for token, position in zip(ids[1:], out.prompt_logprobs[1:]):
            nll -= position[token].logprob
            count += 1
    return math.exp(nll / count)


def perplexity(args) -> dict:
    from transformers import AutoTokenizer

    from llmlab.builtin import ensure_builtin_model
    from llmlab.builtin.stories import stories

    path = ensure_builtin_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = stories(args.stories, HELDOUT_SEED)
    found = {}
    for name, quantization in (("float32", None), ("int8", "int8")):
        llm = _cpu_llm(path, "float32", quantization)
        found[name] = story_perplexity(llm, tokenizer, texts)
    change = found["int8"] / found["float32"] - 1
    print(f"llmlab-stories, {len(texts)} held-out stories (seed {HELDOUT_SEED}; trained on "
          f"seed 0): float32 {found['float32']:.4f}, int8 {found['int8']:.4f} "
          f"({change:+.2%}; target within 2%: {'met' if abs(change) <= 0.02 else 'MISSED'})")
    return found


def _time_us(fn, calls: int, repeats: int = 5) -> float:
    """Mean time per call of the fastest of ``repeats`` batches (the least disturbed)."""
    for _ in range(3):
        fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def kernels(model_dir: pathlib.Path) -> None:
    import torch.nn.functional as F

    from llmlab.kernels.cpu_linear import pack_weight, packed_linear
    from llmlab.quantization.int8 import quantize_int8

    config = _hf_config(model_dir)
    hidden, inner = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * hidden // config.num_attention_heads
    shapes = [(hidden, hidden + 2 * kv), (hidden, 2 * inner), (inner, hidden)]  # (in, out)
    print("microseconds per call (best of 5 batches); i8 deq: F.linear(x, q.to(dtype)) * scale")
    header = (f"{'rows':>5s} {'in->out':>10s} | {'f32 onednn':>10s} {'f32 linear':>10s} "
              f"{'i8 deq f32':>10s} | {'bf16 onednn':>11s} {'i8pack bf16':>11s} "
              f"{'i8 deq bf16':>11s}")
    print(header)
    for rows in (1, 8, 64, 2048):
        for k, n in shapes:
            w = torch.randn(n, k) * k**-0.5
            q, scale = quantize_int8(w)
            calls = 3 if rows == 2048 else 30
            times = []
            for dtype in (torch.float32, torch.bfloat16):
                x, wd, s = torch.randn(rows, k, dtype=dtype), w.to(dtype), scale.to(dtype)
                packed = pack_weight(wd)
                times.append(_time_us(lambda: packed_linear(x, packed, None, n), calls))
                if dtype == torch.float32:
                    times.append(_time_us(lambda: F.linear(x, wd), calls))
                else:
                    times.append(_time_us(lambda: torch._weight_int8pack_mm(x, q, s), calls))
                times.append(_time_us(lambda: F.linear(x, q.to(dtype)) * s, calls))
            print(f"{rows:5d} {f'{k}->{n}':>10s} | {times[0]:10.0f} {times[1]:10.0f} "
                  f"{times[2]:10.0f} | {times[3]:11.0f} {times[4]:11.0f} {times[5]:11.0f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    sections = args.only.split(",")
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs, load "
          f"average {os.getloadavg()[0]:.2f} (other processes skew timings)")
    with tempfile.TemporaryDirectory(prefix="llmlab-quant-") as tmp:
        model_dir = args.model_dir or pathlib.Path(tmp) / "model"
        if ("throughput" in sections or "kernels" in sections) and not (
            model_dir / "config.json"
        ).is_file():
            build_benchmark_model(model_dir, seed=0, device="cpu")
        if "kernels" in sections:
            print("\n== linear kernels (the benchmark model's shapes)")
            kernels(model_dir)
        if "perplexity" in sections:
            print("\n== perplexity")
            perplexity(args)
        if "throughput" in sections:
            print("\n== throughput (benchmarks/throughput.py's CPU workload)")
            throughput(args, model_dir)


if __name__ == "__main__":
    main()

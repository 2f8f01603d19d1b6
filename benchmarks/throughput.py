"""Offline throughput: llmlab vs Hugging Face ``generate`` vs HF continuous batching, plus a floor.

One process, one random-weight model, one workload, three ways to run it:

* ``llmlab``: ``LLM(...).generate`` with one ``SamplingParams`` per request (greedy,
  ``max_tokens`` = the request's output length, ``ignore_eos``); continuous batching over a
  paged KV cache.
* ``hf``: ``model.generate`` in static batches of ``--hf-batch-size`` requests, in request
  order (no sorting by length), left-padded with an attention mask, greedy. A batch runs
  until its longest request is done (``min_new_tokens = max_new_tokens`` keeps EOS from
  stopping it), so shorter requests in it generate tokens nobody asked for.
* ``hf-cb``: transformers' own continuous batching (``transformers.generation.
  continuous_batching``). ``model.generate_batch`` takes a single ``max_new_tokens`` for all
  requests, but the manager underneath it accepts one per request, so by default we drive the
  manager exactly as ``generate_batch`` does, with per-request lengths and EOS disabled
  (``--hf-cb-api manager``). ``--hf-cb-api generate_batch`` calls ``generate_batch`` itself
  with the workload's longest output for every request.

Fairness choices:

* Throughput counts *useful* output tokens only: each request's requested length, whatever
  a mode generated beyond it. Total tokens/s adds the prompt tokens (same for every mode).
* Timed: the generation call only. Not timed: loading the model, building llmlab's engine
  and HF's continuous-batching manager (both allocate their KV cache there). ``--warmup``
  first runs each mode on the first few requests with short outputs, so one-time costs
  (first kernel calls, allocator growth) are not timed either.
* Both paged engines get a KV cache that holds every request's full sequence at once (no
  preemption in either), the same token budget per step (``--max-num-batched-tokens``) and
  the same cap on running requests (``--max-num-seqs``). llmlab runs with
  ``skip_tokenizer_init`` because HF returns token ids and never detokenizes either.
* HF static batch size: 64 by default, the fastest of 8/16/32/64 on the default workload
  on a 2-core CPU (one run each, all 64 requests: 16 took 1.8x and 32 took 1.08x as long as
  64). Decode steps are cheap per row, so fewer, fuller batches win even though a batch runs
  to its longest output: at 64 HF computes 8128 output tokens for 4279 asked for.

Compute floor: the workload's matmul FLOPs (see ``benchmarks.common.count_workload_flops``:
prefill tokens and every fed-back output token through all linear layers, the lm_head once
per output token, causal attention score and value matmuls) divided by the best float32
``torch.mm`` rate measured in this run on the workload's own shapes. No float32 torch engine
can run faster than that floor; 100% of it would mean zero overhead.

Run::

    python -m benchmarks.throughput --warmup
    python -m benchmarks.throughput --only hf,hf-cb --num-requests 8
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import tempfile
import time
import traceback

import attrs
import torch

from benchmarks.common import (
    ModelShape,
    Workload,
    build_benchmark_model,
    count_workload_flops,
    make_workload,
    measure_matmul_flops_per_s,
    representative_matmul_shapes,
)

MODES = ("llmlab", "hf", "hf-cb")
HF_CB_PAGE_SIZE = 256  # transformers' default page size for continuous batching
WARMUP_REQUESTS, WARMUP_OUTPUT_TOKENS = 4, 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--warmup", action="store_true", help="untimed short run of each mode first"
    )
    parser.add_argument("--json", type=pathlib.Path, help="also write the results here")
    parser.add_argument("--model-dir", type=pathlib.Path, help="reuse/write the model here")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--hf-cb-api", choices=("manager", "generate_batch"), default="manager")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"--only: unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    return args


@attrs.frozen
class RunResult:
    mode: str
    wall_s: float
    useful_output_tokens: int  # what the requests asked for
    generated_tokens: int  # what the mode actually computed, padding rows included
    prompt_tokens: int
    note: str = ""

    @property
    def output_tokens_per_s(self) -> float:
        return self.useful_output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.useful_output_tokens + self.prompt_tokens) / self.wall_s


def kv_tokens_needed(workload: Workload, page_size: int) -> int:
    """KV slots, rounded up to whole pages per request, to hold every request at once."""
    pages = sum(
        -(-(len(p) + n) // page_size) for p, n in zip(workload.prompts, workload.output_lens)
    )
    return pages * page_size


# ---------------------------------------------------------------------------- llmlab


def build_llmlab(model_dir: pathlib.Path, workload: Workload, args: argparse.Namespace):
    from llmlab import LLM

    hf_config = _hf_config(model_dir)
    shape = ModelShape.from_hf_config(hf_config)
    float32_bytes = 4
    kv_bytes_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * float32_bytes
    # llmlab insists that one max-length sequence fits, even when no request is that long.
    kv_tokens = max(kv_tokens_needed(workload, args.block_size), hf_config.max_position_embeddings)
    return LLM(
        str(model_dir),
        dtype="float32",
        seed=0,
        device="cpu",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory_bytes=kv_tokens * kv_bytes_per_token,
        skip_tokenizer_init=True,
    )


def run_llmlab(llm, workload: Workload) -> RunResult:
    from llmlab import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids in workload.prompts]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    generated = [len(out.outputs[0].token_ids) for out in outputs]
    _check_lengths("llmlab", generated, workload.output_lens)
    return RunResult(
        "llmlab", wall_s, sum(workload.output_lens), sum(generated), workload.num_prompt_tokens
    )


# ---------------------------------------------------------------------------- HF static


def run_hf_static(model, workload: Workload, batch_size: int) -> RunResult:
    from transformers import GenerationConfig

    pad_id = 0
    generated = 0
    start = time.perf_counter()
    for first in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[first : first + batch_size]
        max_new = max(workload.output_lens[first : first + batch_size])
        input_ids, attention_mask = _left_pad(prompts, pad_id)
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id
        )
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config
            )
        new_tokens = out.shape[1] - input_ids.shape[1]
        if new_tokens != max_new:
            raise RuntimeError(f"HF generate made {new_tokens} tokens per row, expected {max_new}")
        generated += new_tokens * len(prompts)
    wall_s = time.perf_counter() - start
    return RunResult(
        "hf",
        wall_s,
        workload.num_output_tokens,
        generated,
        workload.num_prompt_tokens,
        note=f"batch size {batch_size}",
    )


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


# ---------------------------------------------------------------------------- HF continuous


def hf_cb_configs(workload: Workload, args: argparse.Namespace):
    """Generation and continuous-batching configs sized like llmlab's engine."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation = GenerationConfig(
        do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=-1
    )
    batching = ContinuousBatchingConfig(
        page_size=HF_CB_PAGE_SIZE,
        # Without an explicit size it takes 60% of host RAM on CPU (and zero-fills it).
        num_blocks=kv_tokens_needed(workload, HF_CB_PAGE_SIZE) // HF_CB_PAGE_SIZE,
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
    )
    return generation, batching


def run_hf_continuous(model, workload: Workload, args: argparse.Namespace) -> RunResult:
    if args.hf_cb_api == "generate_batch":
        return _run_hf_generate_batch(model, workload, args)
    generation, batching = hf_cb_configs(workload, args)
    # warmup=False: on CPU it would only build a batch processor that the generation thread
    # then builds again; we wait for the thread's own instead.
    with model.continuous_batching_context_manager(
        generation_config=generation,
        continuous_batching_config=batching,
        block=True,
        warmup=False,
    ) as manager:
        _wait_for_batch_processor(manager)  # KV cache and mask buffers: setup, not timed
        start = time.perf_counter()
        for index, (prompt, num_outputs) in enumerate(zip(workload.prompts, workload.output_lens)):
            manager.add_request(
                prompt, request_id=str(index), max_new_tokens=num_outputs, eos_token_id=-1
            )
        finished = _collect_hf_results(manager, workload.num_requests)
        wall_s = time.perf_counter() - start
    generated = [len(finished[str(i)].generated_tokens) for i in range(workload.num_requests)]
    _check_lengths("hf-cb", generated, workload.output_lens)
    return RunResult(
        "hf-cb",
        wall_s,
        workload.num_output_tokens,
        sum(generated),
        workload.num_prompt_tokens,
        note="per-request max_new_tokens via manager",
    )


def _wait_for_batch_processor(manager) -> None:
    while manager.batch_processor is None:
        if not manager.is_running():
            raise RuntimeError("HF continuous-batching thread stopped during setup")
        time.sleep(0.001)


def _collect_hf_results(manager, num_requests: int) -> dict:
    finished = {}
    while len(finished) < num_requests:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("HF continuous-batching thread stopped before finishing")
            continue
        if result.error is not None:
            raise RuntimeError(
                f"HF continuous batching: request {result.request_id}: {result.error}"
            )
        if result.is_finished():
            finished[result.request_id] = result
    return finished


def _run_hf_generate_batch(model, workload: Workload, args: argparse.Namespace) -> RunResult:
    generation, batching = hf_cb_configs(workload, args)
    start = time.perf_counter()
    results = model.generate_batch(
        inputs=workload.prompts,
        generation_config=generation,
        continuous_batching_config=batching,
        progress_bar=False,
    )
    wall_s = time.perf_counter() - start
    if len(results) != workload.num_requests:
        raise RuntimeError(f"generate_batch returned {len(results)} of {workload.num_requests}")
    generated = sum(len(r.generated_tokens) for r in results.values())
    return RunResult(
        "hf-cb",
        wall_s,
        workload.num_output_tokens,
        generated,
        workload.num_prompt_tokens,
        note="generate_batch: one max_new_tokens for all; manager setup timed",
    )


def _check_lengths(mode: str, generated: list[int], requested: list[int]) -> None:
    wrong = [(i, g, r) for i, (g, r) in enumerate(zip(generated, requested)) if g != r]
    if wrong:
        raise RuntimeError(f"{mode}: (request, generated, requested) mismatches: {wrong[:5]}")


# ---------------------------------------------------------------------------- floor


def measure_floor(model_dir: pathlib.Path, workload: Workload) -> dict:
    shape = ModelShape.from_hf_config(_hf_config(model_dir))
    flops = count_workload_flops(shape, workload)
    rates = {
        f"[{m}x{k}]@[{k}x{n}]": measure_matmul_flops_per_s(m, k, n)
        for m, k, n in representative_matmul_shapes(shape)
    }
    best_shape = max(rates, key=rates.get)
    floor_s = flops.total / rates[best_shape]
    return {
        "flops": attrs.asdict(flops) | {"total": flops.total},
        "matmul_flops_per_s": rates,
        "rate_shape": best_shape,
        "floor_s": floor_s,
        "floor_output_tokens_per_s": workload.num_output_tokens / floor_s,
    }


# ---------------------------------------------------------------------------- driver


def _hf_config(model_dir: pathlib.Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def prepare_mode(mode: str, model_dir: pathlib.Path, workload: Workload, args):
    """Build what a mode needs (untimed); return ``run(workload) -> RunResult``."""
    if mode == "llmlab":
        return functools.partial(run_llmlab, build_llmlab(model_dir, workload, args))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    if mode == "hf":
        return functools.partial(run_hf_static, model, batch_size=args.hf_batch_size)
    return functools.partial(run_hf_continuous, model, args=args)


def run_mode(mode: str, model_dir: pathlib.Path, workload: Workload, args) -> RunResult | None:
    """Prepare the mode, optionally warm it up, then time the workload; None if it fails."""
    print(f"\n== {mode}", flush=True)
    try:
        run = prepare_mode(mode, model_dir, workload, args)
        if args.warmup:
            warm = run(workload.head(WARMUP_REQUESTS, WARMUP_OUTPUT_TOKENS))
            print(f"warmup: {warm.wall_s:.2f} s", flush=True)
        result = run(workload)
    except Exception:  # noqa: BLE001 -- report it and go on to the other modes
        print(f"{mode} FAILED:\n{traceback.format_exc()}", flush=True)
        return None
    print(
        f"wall {result.wall_s:.2f} s | output {result.output_tokens_per_s:.1f} tok/s | "
        f"total {result.total_tokens_per_s:.1f} tok/s | generated {result.generated_tokens} "
        f"for {result.useful_output_tokens} useful" + (f" | {result.note}" if result.note else ""),
        flush=True,
    )
    return result


def print_summary(results: dict[str, RunResult], floor: dict) -> None:
    print("\n== summary")
    print(f"{'mode':8} {'wall s':>8} {'out tok/s':>10} {'total tok/s':>12} {'generated':>10}")
    for mode, r in results.items():
        print(
            f"{mode:8} {r.wall_s:8.2f} {r.output_tokens_per_s:10.1f} "
            f"{r.total_tokens_per_s:12.1f} {r.generated_tokens:10d}"
        )
    tps = {mode: r.output_tokens_per_s for mode, r in results.items()}
    hf_modes = [m for m in ("hf", "hf-cb") if m in tps]
    best_hf = max(hf_modes, key=tps.get) if hf_modes else None
    if "llmlab" in tps:
        for other in hf_modes:
            print(f"llmlab / {other}: {tps['llmlab'] / tps[other]:.2f}x")
        if best_hf:
            print(f"llmlab / best HF ({best_hf}): {tps['llmlab'] / tps[best_hf]:.2f}x")

    flops = floor["flops"]
    print("\n== compute floor")
    print(
        f"matmul GFLOP: {flops['total'] / 1e9:.1f} (linear {flops['linear'] / 1e9:.1f}, "
        f"lm_head {flops['lm_head'] / 1e9:.1f}, attention {flops['attention'] / 1e9:.1f})"
    )
    for shape, rate in floor["matmul_flops_per_s"].items():
        print(f"  torch.mm fp32 {shape}: {rate / 1e9:.1f} GFLOP/s")
    rate = floor["matmul_flops_per_s"][floor["rate_shape"]]
    print(f"floor rate: best of the above, {floor['rate_shape']} at {rate / 1e9:.1f} GFLOP/s")
    print(
        f"floor time {floor['floor_s']:.2f} s -> {floor['floor_output_tokens_per_s']:.1f} "
        "output tok/s"
    )
    if "llmlab" in tps:
        print(
            f"llmlab achieves {tps['llmlab'] / floor['floor_output_tokens_per_s']:.1%} of the floor"
        )
    if best_hf:
        print(
            f"floor / best HF ({best_hf}): {floor['floor_output_tokens_per_s'] / tps[best_hf]:.2f}x"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="llmlab-bench-") as tmp:
        model_dir = args.model_dir or pathlib.Path(tmp) / "model"
        if not (model_dir / "config.json").is_file():
            build_benchmark_model(model_dir, seed=0)
        shape = ModelShape.from_hf_config(_hf_config(model_dir))
        workload = make_workload(args.num_requests, args.seed, shape.vocab_size)
        print(f"model: {shape} float32, random weights (seed 0)")
        print(
            f"workload: {workload.num_requests} requests, {workload.num_prompt_tokens} prompt "
            f"tokens, {workload.num_output_tokens} output tokens (seed {args.seed})"
        )
        print(
            f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs, "
            f"load average {os.getloadavg()[0]:.2f} (other processes skew timings)"
        )

        floor = measure_floor(model_dir, workload)
        results = {}
        for mode in args.modes:
            result = run_mode(mode, model_dir, workload, args)
            if result is not None:
                results[mode] = result
        print_summary(results, floor)
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")

    if args.json:
        write_json(args.json, args, workload, results, floor)
        print(f"wrote {args.json}")


def write_json(path: pathlib.Path, args, workload: Workload, results: dict, floor: dict) -> None:
    payload = {
        "args": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
        "workload": {
            "num_requests": workload.num_requests,
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": workload.num_output_tokens,
        },
        "results": {
            mode: attrs.asdict(r)
            | {
                "output_tokens_per_s": r.output_tokens_per_s,
                "total_tokens_per_s": r.total_tokens_per_s,
            }
            for mode, r in results.items()
        },
        "floor": floor,
    }
    path.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()

"""Offline throughput: llmlab vs Hugging Face ``generate`` vs HF continuous batching, plus a floor.

One process, one random-weight model, one workload, four ways to run it, all in the same
``--dtype`` (float32 on CPU by default, bfloat16 on CUDA):

* ``llmlab``: ``LLM(...).generate`` with one ``SamplingParams`` per request (greedy,
  ``max_tokens`` = the request's output length, ``ignore_eos``); continuous batching over a
  paged KV cache.
* ``hf``: ``model.generate`` in static batches of ``--hf-batch-size`` requests, in request
  order (no sorting by length), left-padded with an attention mask, greedy. A batch runs
  until its longest request is done (``min_new_tokens = max_new_tokens`` keeps EOS from
  stopping it), so shorter requests in it generate tokens nobody asked for. HF's default
  dynamic KV cache.
* ``hf-static``: the same with a static KV cache (``cache_implementation="static"``), HF's
  fastest mode on CPU, swept over ``--hf-batch-sizes`` (each size timed on the whole
  workload); the fastest size is the result. "best HF" is the fastest HF mode run.
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
  (on by default) first runs each mode on a few short requests drawn from another seed, so
  one-time costs (first kernel calls, allocator growth) are not timed either, and no timed
  prompt is already in llmlab's prefix cache.
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
per output token, causal attention score and value matmuls) divided by the best
``torch.mm`` rate measured in this run on the workload's own shapes, in ``--dtype``.

Per-step roofline (CPU; the CUDA one below has the same shape): for each of llmlab's timed
steps, from its ``StepEvent``, the larger of its bytes (every weight once, the K/V its
attention reads, the K/V its new tokens write) over the measured main-memory read
bandwidth, and its FLOPs over the matmul rate measured at that step's row count on the
model's own projections (``benchmarks.common.RateCurve``: a 4-row decode step cannot
reach a 2,048-row prefill's rate). The rate at each row count is the fastest kernel this
machine has for each projection: ``torch.mm`` and llmlab's own prepacked oneDNN linear (what
the engine's linears run on; skipped, and said so, where this torch build has no oneDNN),
each kernel's own rates printed beside it (``benchmarks.common.measure_cpu_matmul_rates``).
Both rates are measured before the timed runs and again after them, and each point keeps
the better of the two (other processes on the machine only ever make a measurement low).
llmlab's fraction is the sum of the floors over its wall time; a fraction above 100% means
the floor is wrong (an engine beat it), and the benchmark fails instead of printing it.

Host work per decode step (CPU): everything a decode step does but the model math, at 64
running sequences; the target is <= 1.0 ms (issue 23). A short second llmlab pass after the
timed run (not part of the throughput) queues ``--decode-batch`` requests (64 on CPU, capped by the
workload and ``--max-num-seqs``; the workload's first prompts, greedy, enough output tokens
to outlast the pass), steps the engine until a step decodes all of them, then times
``--decode-steps`` (16 on CPU) steps by wall clock. During those steps the model's
``forward`` (what ``model(...)`` calls; patched on the instance) and ``compute_logits`` are
wrapped in ``time.perf_counter`` accumulators, restored afterwards. On CPU the math is
synchronous, so the time inside those two calls is the model math: every layer, attention
included, and the lm_head. Host work per step is the mean wall time per step minus the
mean math time per step: scheduling and KV-cache bookkeeping, building the flat inputs and
the attention metadata, sampling (its tensor work included), output processing and the
step's events. No profiler runs on CPU. The StepEvents' own mean step and model-runner
times are reported beside it, as is the timed run's pure-decode step time. llmlab's KV
cache is sized to hold these requests too: a measured step that is not a pure decode of
the whole batch (a preemption) makes the pass fail.

``--device cuda``: the defaults switch to the GPU workload (a Qwen3-0.6B-shaped
random-weight model in bfloat16, 256 requests with prompt and output lengths U[100, 1024],
8192-token steps, HF static batches of 64, modes ``llmlab,hf``, warmup on, a decode split
over 256 requests and 32 steps). llmlab's KV cache is what ``--gpu-memory-utilization``
leaves (printed beside what the workload needs at once). Instead of the compute floor it
reports:

* Roofline, per step, from the ``StepEvent``s of llmlab's timed run
  (``benchmarks.common.step_work`` and ``roofline``). Each step reads at least every
  weight once (counted from the checkpoint; a tied embedding once, as the lm_head reads
  it; a step that samples nothing is charged the lm_head too, which is negligible) plus
  the K/V of every scheduled request's context after the step, and writes the K/V of
  its new tokens, and does at least its
  matmul FLOPs (``2 * weights * tokens`` through the layers, the lm_head for each sampled
  row, causal attention over the context). Its floor is ``max(bytes / copy bandwidth,
  FLOPs / matmul rate)``, both rates measured in this run: a 1 GiB device-to-device copy
  (``2 * bytes / time``) and the best bf16 ``torch.mm`` over a few shapes. The roofline
  is the sum of the step floors; llmlab's fraction is roofline time / llmlab's measured
  time. Each request's context is tracked through the events (an admission starts it at
  its prefix-cache hit, a preemption drops it, each step adds its new tokens).
* Decode step time split into GPU and host time, from a short second llmlab pass after
  the timed run (not part of the throughput): ``--decode-batch`` requests (the workload's
  first prompts) are stepped until a step decodes all of them, then ``--decode-steps``
  steps are timed by wall clock and as many more run under ``torch.profiler`` with CUDA
  activity. GPU time per step is the union of the kernel, memcpy and memset intervals in
  that trace over the number of steps: the time the device was busy. Host time is the
  unprofiled wall time minus that: the time per step the GPU sat idle waiting for the
  host (host work that overlaps running kernels is hidden and not counted). CUDA events
  around a step cannot give this (a step ends in a synchronisation, so they measure wall
  time), and the profiler adds host overhead per launch, which is why the wall time comes
  from the unprofiled steps. The timed run's own pure-decode steps (mean wall and model
  runner time) are printed beside it.
* Warmup on CUDA: llmlab first runs a sweep whose prompts are drawn like the workload's
  but from another seed (so the timed run gets no prefix-cache hits from it), with
  staggered output lengths so that the running batch passes through every size from the
  full batch down to 1: Triton kernels are compiled and CUDA graphs (captured lazily, per
  padded batch size) exist before the clock starts. HF modes warm up on a few short
  requests, as on CPU.

Run::

    python -m benchmarks.throughput --warmup
    python -m benchmarks.throughput --only hf,hf-cb --num-requests 8
    python -m benchmarks.throughput --device cuda --json cuda.json

OpenMP wait policy: llmlab is imported before torch here, as the ``llmlab`` command does,
so the llmlab mode runs with the wait policy llmlab users get (``llmlab.threads``), and
each HF mode's own process starts without the ``GOMP_SPINCOUNT`` llmlab set (a user's own
setting is kept): HF runs as a script that never imports llmlab would.
"""

from __future__ import annotations

import os

# ruff: noqa: E402 (the imports below follow the wait policy on purpose)
# Before torch loads the OpenMP runtime (see above); remember whether the user set it.
_USER_SPINCOUNT = "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ
from llmlab.threads import set_wait_policy

set_wait_policy()

import argparse
import contextlib
import gc
import importlib
import json
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

import attrs
import torch

from benchmarks.common import (
    ModelShape,
    StepCostModel,
    Workload,
    build_benchmark_model,
    checkpoint_numel,
    count_workload_flops,
    cuda_matmul_shapes,
    device_busy_us,
    device_gaps_us,
    device_kernel_table,
    make_workload,
    measure_cpu_matmul_rates,
    measure_cpu_read_bytes_per_s,
    measure_cuda_copy_bytes_per_s,
    measure_cuda_matmul_flops_per_s,
    measure_matmul_flops_per_s,
    representative_matmul_shapes,
    roofline,
    step_work,
    weight_elements_read,
)

MODES = ("llmlab", "hf", "hf-static", "hf-cb")
HF_MODES = ("hf", "hf-static", "hf-cb")
HF_CB_PAGE_SIZE = 256  # transformers' default page size for continuous batching
WARMUP_REQUESTS, WARMUP_OUTPUT_TOKENS = 4, 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# CPU: what the host may spend per decode step at 64 sequences, outside the model math.
CPU_HOST_TARGET_MS = 1.0

# Defaults that depend on --device. CPU: the workload BENCHMARKS.md's CPU numbers come from.
# CUDA: the GPU workload (Qwen3-0.6B shape, 256 requests, U[100, 1024] in and out). HF's
# continuous batching is left out of the CUDA default (add it with --only): the whole
# default run then takes several minutes less.
DEVICE_DEFAULTS = {
    "cpu": {
        "num_requests": 64,
        "prompt_len_range": (16, 256),
        "output_len_range": (16, 128),
        "max_num_batched_tokens": 2048,
        "only": ",".join(MODES),
        "warmup": True,
        "dtype": "float32",
        "hf_batch_sizes": "16,32,64",
        "decode_batch": 64,
        "decode_steps": 16,
    },
    "cuda": {
        "num_requests": 256,
        "prompt_len_range": (100, 1024),
        "output_len_range": (100, 1024),
        "max_num_batched_tokens": 8192,
        "only": "llmlab,hf",
        "warmup": True,
        "dtype": "bfloat16",
        "hf_batch_sizes": "64",
        "decode_batch": 256,
        "decode_steps": 32,
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device",
        choices=tuple(DEVICE_DEFAULTS),
        default="cpu",
        help="cpu: the small Llama in float32 (default); cuda: the Qwen3-0.6B-shaped "
        "workload in bfloat16, with the roofline and the decode GPU/host split",
    )
    parser.add_argument("--num-requests", type=int, help="default: 64 on cpu, 256 on cuda")
    parser.add_argument(
        "--prompt-len-range", type=int, nargs=2, metavar=("MIN", "MAX"),
        help="inclusive; default: 16 256 on cpu, 100 1024 on cuda",
    )
    parser.add_argument(
        "--output-len-range", type=int, nargs=2, metavar=("MIN", "MAX"),
        help="inclusive; default: 16 128 on cpu, 100 1024 on cuda",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only", help=f"subset of {','.join(MODES)}; default: all on cpu, llmlab,hf on cuda"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES),
        help="weights, activations and KV cache, for llmlab and HF alike (default: float32 on "
        "cpu, bfloat16 on cuda)",
    )
    parser.add_argument(
        "--hf-batch-sizes",
        help="hf-static: batch sizes to sweep, each timed on the whole workload; the best is "
        "reported (default: 16,32,64 on cpu, 64 on cuda)",
    )
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        help="untimed short run of each mode first, on prompts outside the workload "
        "(default: on)",
    )
    parser.add_argument("--json", type=pathlib.Path, help="also write the results here")
    parser.add_argument("--model-dir", type=pathlib.Path, help="reuse/write the model here")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="default: 2048 on cpu, 8192 on cuda"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--hf-cb-api", choices=("manager", "generate_batch"), default="manager")
    parser.add_argument(
        "--attention-backend", help="llmlab's attention backend (default: its own 'auto')"
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="llmlab: no CUDA graphs for decode steps"
    )
    parser.add_argument(
        "--async-scheduling", choices=("auto", "on", "off"), default="auto",
        help="llmlab: overlapped scheduling (auto: the engine's default, on for CUDA)",
    )
    parser.add_argument(
        "--cpu-linear", choices=("auto", "onednn", "plain"),
        help="llmlab on CPU: prepacked oneDNN linears or F.linear (default: the engine's auto)",
    )
    parser.add_argument(
        "--no-cpu-fused-ops", dest="cpu_fused_ops", action="store_false",
        help="llmlab on CPU: plain torch ops instead of the fused C++ residual+norm, rotary "
        "and SiLU x up",
    )
    parser.add_argument(
        "--no-cuda-fused-ops", dest="cuda_fused_ops", action="store_false",
        help="llmlab on CUDA: plain torch ops instead of the Triton residual+norm, rotary "
        "and SiLU x up",
    )
    parser.add_argument(
        "--decode-batch", type=int,
        help="running requests for the decode step split after llmlab's timed run: host "
        "work vs model math on cpu, GPU/host on cuda (capped by the workload and "
        "--max-num-seqs; default: 64 on cpu, 256 on cuda); 0 skips it",
    )
    parser.add_argument(
        "--decode-steps", type=int,
        help="decode steps timed for that split (on cuda as many more are profiled; "
        "default: 16 on cpu, 32 on cuda)",
    )
    parser.add_argument(
        "--isolate", action=argparse.BooleanOptionalAction, default=True,
        help="run each HF mode in a fresh Python process, so no mode's threads, allocator "
        "or compiled state slows the next (default: on)",
    )
    # Internal: a child started by --isolate runs its one mode and writes the result here.
    parser.add_argument("--mode-result", type=pathlib.Path, help=argparse.SUPPRESS)
    cuda = parser.add_argument_group("cuda only")
    cuda.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    apply_device_defaults(args)
    args.modes = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"--only: unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args


def apply_device_defaults(args: argparse.Namespace) -> None:
    """Fill every option left unset with its default for ``args.device``."""
    for name, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.prompt_len_range = tuple(args.prompt_len_range)
    args.output_len_range = tuple(args.output_len_range)
    if isinstance(args.hf_batch_sizes, str):
        args.hf_batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b.strip()]
    args.torch_dtype = DTYPES[args.dtype]


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


def warmup_workload(
    mode: str, workload: Workload, args: argparse.Namespace, vocab_size: int
) -> Workload:
    """What ``--warmup`` runs before timing ``mode`` (see the module docstring): prompts
    drawn from another seed, so no mode finds any of the timed prompts in a cache."""
    if args.device == "cuda" and mode == "llmlab":
        return decode_sweep_workload(
            min(workload.num_requests, args.max_num_seqs),
            args.seed + 1,
            vocab_size,
            args.prompt_len_range,
        )
    return make_workload(
        WARMUP_REQUESTS, args.seed + 1, vocab_size, args.prompt_len_range,
        (1, WARMUP_OUTPUT_TOKENS),
    )  # fmt: skip


def decode_sweep_workload(
    num_requests: int, seed: int, vocab_size: int, prompt_len_range: tuple[int, int]
) -> Workload:
    """Random prompts, output lengths ``8 + (n - 1 - i)``: the first admitted run longest,
    so once the prefills are done about one request finishes per step and the decode batch
    sweeps every size from ``n`` down to 1."""
    n = num_requests
    prompts = make_workload(n, seed, vocab_size, prompt_len_range).prompts
    return Workload(prompts=prompts, output_lens=[8 + (n - 1 - i) for i in range(n)])


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- llmlab


def build_llmlab(model_dir: pathlib.Path, workload: Workload, args: argparse.Namespace):
    from llmlab import LLM

    extra = {}
    if args.attention_backend is not None:
        extra["attention_backend"] = args.attention_backend
    if args.enforce_eager:
        extra["enforce_eager"] = True
    if args.cpu_linear is not None:
        extra["cpu_linear"] = args.cpu_linear
    if not getattr(args, "cpu_fused_ops", True):
        extra["cpu_fused_ops"] = False
    if not getattr(args, "cuda_fused_ops", True):
        extra["cuda_fused_ops"] = False
    if getattr(args, "async_scheduling", "auto") != "auto":
        extra["async_scheduling"] = args.async_scheduling == "on"
    shared = dict(
        dtype=args.dtype,
        seed=0,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        skip_tokenizer_init=True,
        **extra,
    )
    if args.device == "cuda":
        # KV cache: what gpu_memory_utilization leaves after weights and activations.
        return LLM(str(model_dir), gpu_memory_utilization=args.gpu_memory_utilization, **shared)
    hf_config = _hf_config(model_dir)
    shape = ModelShape.from_hf_config(hf_config)
    kv_bytes_per_token = shape.kv_bytes_per_token(args.torch_dtype.itemsize)
    # Room for the timed run and, after it, for the decode split's requests (no preemption
    # in either). llmlab insists that one max-length sequence fits, even when no request is
    # that long.
    kv_tokens = max(
        kv_tokens_needed(workload, args.block_size),
        kv_tokens_needed(decode_split_workload(workload, args), args.block_size),
        hf_config.max_position_embeddings,
    )
    return LLM(str(model_dir), kv_cache_memory_bytes=kv_tokens * kv_bytes_per_token, **shared)


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


@attrs.define
class LlmlabRunner:
    """``run_llmlab`` on one engine; with ``record_steps``, keeps the last run's StepEvents."""

    llm: object
    record_steps: bool = False
    events: list = attrs.field(factory=list)

    def __call__(self, workload: Workload) -> RunResult:
        self.events = []
        if not self.record_steps:
            return run_llmlab(self.llm, workload)
        engine = self.llm.llm_engine
        observer = engine.subscribe(self.events.append)
        try:
            return run_llmlab(self.llm, workload)
        finally:
            engine.unsubscribe(observer)


def decode_split_lengths(
    prompts: list[list[int]],
    num_steps: int,
    max_num_batched_tokens: int,
    max_settle_steps: int | None = None,
) -> tuple[int, int]:
    """``measure_decode_split``'s (steps allowed to reach a full decode batch, output
    tokens each request asks for): enough to outlast settling, timing and profiling."""
    if max_settle_steps is None:
        max_settle_steps = -(-sum(len(p) for p in prompts) // max_num_batched_tokens) + 8
    return max_settle_steps, max_settle_steps + 2 * num_steps + 4


def decode_split_batch(workload: Workload, args: argparse.Namespace) -> int:
    """Requests the decode split runs: ``--decode-batch``, capped by the workload and
    ``--max-num-seqs`` (0 or less: skipped)."""
    return min(args.decode_batch, args.max_num_seqs, workload.num_requests)


def decode_split_workload(workload: Workload, args: argparse.Namespace) -> Workload:
    """What the decode split puts in the KV cache at once: the workload's first prompts,
    each with the output tokens it asks for (empty when the split is skipped)."""
    batch = decode_split_batch(workload, args)
    if batch <= 0 or args.decode_steps <= 0:
        return Workload(prompts=[], output_lens=[])
    prompts = workload.prompts[:batch]
    _, max_tokens = decode_split_lengths(prompts, args.decode_steps, args.max_num_batched_tokens)
    return Workload(prompts=prompts, output_lens=[max_tokens] * batch)


def measure_decode_split(
    llm,
    prompts: list[list[int]],
    num_steps: int,
    profile: bool = True,
    max_settle_steps: int | None = None,
    time_math: bool = False,
) -> dict:
    """Mean wall, GPU (``profile``) or model-math (``time_math``) and host time of a
    pure-decode step with ``len(prompts)`` running.

    Queues one request per prompt (greedy, EOS ignored, enough output tokens to outlast the
    measurement), steps the engine until a step decodes every one of them at once, then
    times ``num_steps`` steps by wall clock. With ``time_math`` (CPU, where the math is
    synchronous), the model's ``forward`` and ``compute_logits`` are wrapped in
    ``time.perf_counter`` accumulators during those steps (``_timed_model_math``; restored
    afterwards): ``math_ms`` is the mean time inside them per step and ``host_ms`` the
    rest of the wall time. With ``profile`` (CUDA), ``num_steps`` more run under
    ``torch.profiler`` (CUDA activity) and the device's busy time comes from its trace
    (``device_busy_us``): ``gpu_ms``, and ``host_ms`` = wall - GPU busy. The requests are
    aborted at the end. Raises if any measured step is not a pure decode of the whole batch
    (e.g. preemption: too small a KV cache).
    """
    from llmlab.sampling.params import RequestOutputKind, SamplingParams

    if profile and time_math:
        raise ValueError("profile and time_math both define host_ms: pick one")
    engine = llm.llm_engine
    if time_math and getattr(engine, "overlap", None) is not None:
        # Overlapped steps commit one batch while the next runs: a step's wall time no
        # longer holds its own forward, so host = wall - math means nothing.
        raise ValueError("time_math needs a synchronous engine (async_scheduling=False)")
    model = _engine_model(engine) if time_math else None
    batch = len(prompts)
    budget = engine.config.max_num_batched_tokens
    max_settle_steps, max_tokens = decode_split_lengths(
        prompts, num_steps, budget, max_settle_steps
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    ids = [f"decode-split-{i}" for i in range(batch)]
    events = []

    def full_decode(event) -> bool:
        return len(event.scheduled) == batch and all(n == 1 for _, n in event.scheduled)

    def timed_steps(count: int) -> list[float]:
        walls = []
        for _ in range(count):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        return walls

    observer = engine.subscribe(events.append)
    try:
        for request_id, prompt in zip(ids, prompts, strict=True):
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        for _ in range(max_settle_steps):
            engine.step()
            if events and full_decode(events[-1]):
                break
        else:
            raise RuntimeError(
                f"no step decoded all {batch} requests within {max_settle_steps} steps"
            )
        contexts = sorted(len(p) for p in prompts)
        first_event = len(events)
        if time_math:
            with _timed_model_math(model) as math, _timed_stages(engine) as stages:
                walls = timed_steps(num_steps)
        else:
            walls = timed_steps(num_steps)
        result = {
            "batch": batch,
            "num_steps": num_steps,
            "prompt_len_min": contexts[0],
            "prompt_len_max": contexts[-1],
            "wall_ms": 1e3 * sum(walls) / num_steps,
            "engine_wall_ms": 1e3 * sum(e.wall_time_s for e in events[first_event:]) / num_steps,
            "model_ms": 1e3 * sum(e.model_time_s for e in events[first_event:]) / num_steps,
            "gpu_ms": None,
            "math_ms": None,
            "host_ms": None,
            "profiled_wall_ms": None,
            "num_device_activities": None,
        }
        if time_math:
            if math["forward"] != num_steps or math["compute_logits"] != num_steps:
                raise RuntimeError(
                    f"{num_steps} steps called model.forward {math['forward']} and "
                    f"compute_logits {math['compute_logits']} times (once each per step "
                    "expected; a CUDA graph replay bypasses forward): math not measured"
                )
            math_ms = 1e3 * math["seconds"] / num_steps
            result.update(math_ms=math_ms, host_ms=result["wall_ms"] - math_ms,
                          host_stages_ms=host_stages(stages, math["seconds"], sum(walls),
                                                     num_steps))
        if profile:
            trace, profiled = _profile_steps(engine, num_steps)
            busy_us, activities = device_busy_us(trace)
            if activities == 0:
                raise RuntimeError("the profiler trace has no kernel, memcpy or memset events")
            # Idle stretches of the device: those over 50 us are where it waited on the host
            # between kernels (under the profiler, whose host overhead lengthens them).
            gaps = [g for g in device_gaps_us(trace) if g > 50.0]
            result.update(
                gpu_ms=busy_us / 1e3 / num_steps,
                host_ms=result["wall_ms"] - busy_us / 1e3 / num_steps,
                profiled_wall_ms=1e3 * profiled / num_steps,
                num_device_activities=activities,
                profiled_gaps={"over_us": 50.0, "per_step": len(gaps) / num_steps,
                               "ms_per_step": sum(gaps) / 1e3 / num_steps,
                               "largest_us": max(gaps, default=0.0)},
                kernels=[dict(k, us_per_step=k["total_us"] / num_steps)
                         for k in device_kernel_table(trace)],
            )
        measured = events[first_event:]
        if len(measured) != num_steps * (2 if profile else 1) or not all(map(full_decode, measured)):
            raise RuntimeError(
                f"a measured step was not a pure decode of all {batch} requests: "
                f"{[len(e.scheduled) for e in measured]} scheduled per step"
            )
        return result
    finally:
        engine.unsubscribe(observer)
        engine.abort_request(ids)


def _engine_model(engine) -> torch.nn.Module:
    """The model the engine's executor (a ``ModelRunner``) runs."""
    model = getattr(engine.executor, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"the engine's executor {type(engine.executor).__name__} has no model to time"
        )
    return model


_TIMED_METHODS = ("forward", "compute_logits")


@contextlib.contextmanager
def _timed_model_math(model: torch.nn.Module):
    """Wrap ``model.forward`` (what ``model(...)`` calls) and ``model.compute_logits`` in
    ``time.perf_counter`` accumulators, as instance attributes; yield the totals
    (``seconds`` inside either, and the calls of each). The originals are restored on exit:
    the instance attributes are removed again (or reset, had the instance its own)."""
    totals = {"seconds": 0.0, **{name: 0 for name in _TIMED_METHODS}}

    def timed(name: str, method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                totals["seconds"] += time.perf_counter() - start
                totals[name] += 1

        wrapper.__wrapped__ = method
        return wrapper

    missing = object()
    saved = {}
    try:
        for name in _TIMED_METHODS:
            original = vars(model).get(name, missing)
            setattr(model, name, timed(name, getattr(model, name)))
            saved[name] = original
        yield totals
    finally:
        for name, original in saved.items():
            if original is missing:
                delattr(model, name)
            else:
                setattr(model, name, original)


# Host work per decode step by stage: (label, owner attribute path from the engine, method).
# Methods are wrapped on their classes for the timed steps only ("module:" owners: the
# function is replaced in that module). Nested stages are reported exclusive of what they
# contain (host_stages). These name today's engine internals: when the engine is
# restructured, update this table with it.
_STAGES = (
    ("schedule", "scheduler", "schedule"),
    ("execute", "executor", "execute"),
    ("batch", "executor", "prepare"),
    ("metadata", "executor.attention", "build_metadata"),
    ("sampling", "executor.sampler", "__call__"),
    ("commit", None, "_commit"),
    ("update", "scheduler", "update"),
    ("text", "outputs", "stop_string"),
    ("outputs", "outputs", "outputs"),
    ("events", "module:llmlab.observe.observable", "step_event"),
    ("observers", "module:llmlab.engine.engine", "notify"),
)


@contextlib.contextmanager
def _timed_stages(engine):
    """Wrap each stage's method (on its class) in a ``perf_counter`` accumulator; yield
    ``{label: seconds}``. Classes are restored on exit."""
    totals = {label: 0.0 for label, _, _ in _STAGES}
    patched = []
    try:
        for label, path, name in _STAGES:
            if path and path.startswith("module:"):
                cls = importlib.import_module(path.removeprefix("module:"))
            else:
                owner = engine
                for part in path.split(".") if path else ():
                    owner = getattr(owner, part)
                cls = type(owner)
            original = cls.__dict__.get(name)
            method = getattr(cls, name)

            def wrapper(*args, _method=method, _label=label, **kwargs):
                start = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    totals[_label] += time.perf_counter() - start

            setattr(cls, name, wrapper)
            patched.append((cls, name, original))
        yield totals
    finally:
        for cls, name, original in reversed(patched):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


def host_stages(totals: dict[str, float], math_s: float, wall_s: float, steps: int) -> dict:
    """Milliseconds per step of each host stage, exclusive of the stages inside it:
    the runner's own work is ``execute`` minus metadata, model math and sampling; the
    engine's commit bookkeeping is ``commit`` minus the scheduler's update, text, outputs
    and events; ``rest`` is the step's wall time outside every stage."""
    ms = {k: 1e3 * v / steps for k, v in totals.items()}
    math_ms = 1e3 * math_s / steps
    parts = {
        "schedule": ms["schedule"],
        "batch": ms["batch"],
        "metadata": ms["metadata"],
        "sampling": ms["sampling"],
        "runner": ms["execute"] - ms["batch"] - ms["metadata"] - ms["sampling"] - math_ms,
        "update": ms["update"],
        "text": ms["text"],
        "outputs": ms["outputs"],
        "events": ms["events"],
        "commit": ms["commit"] - ms["update"] - ms["text"] - ms["outputs"] - ms["events"],
        "observers": ms["observers"],
    }
    parts["rest"] = 1e3 * wall_s / steps - math_ms - sum(parts.values())
    return parts


def _profile_steps(engine, num_steps: int) -> tuple[list, float]:
    """Run ``num_steps`` engine steps under the torch profiler; (the trace's events, wall
    seconds)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory(prefix="llmlab-trace-") as tmp:
        path = pathlib.Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return (trace["traceEvents"] if isinstance(trace, dict) else trace), wall_s


# ---------------------------------------------------------------------------- HF static


def run_hf_static_cache_sweep(model, workload: Workload, batch_sizes: list[int]) -> RunResult:
    """HF at its best: ``generate`` with a static KV cache, the whole workload at each batch
    size; the fastest is the result (its note lists every size's time)."""
    runs = [
        run_hf_static(model, workload, batch_size=b, cache_implementation="static")
        for b in batch_sizes
    ]
    best = min(runs, key=lambda r: r.wall_s)
    times = ", ".join(f"{b}: {r.wall_s:.2f} s" for b, r in zip(batch_sizes, runs, strict=True))
    return attrs.evolve(best, mode="hf-static", note=f"static cache, batch sizes {times}")


def run_hf_static(
    model, workload: Workload, batch_size: int, cache_implementation: str | None = None
) -> RunResult:
    """HF ``generate`` over static batches (dynamic KV cache unless ``cache_implementation``
    says otherwise)."""
    from transformers import GenerationConfig

    pad_id = 0
    generated = 0
    start = time.perf_counter()
    for first in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[first : first + batch_size]
        max_new = max(workload.output_lens[first : first + batch_size])
        input_ids, attention_mask = _left_pad(prompts, pad_id)
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id,
            cache_implementation=cache_implementation,
        )
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids.to(model.device),
                attention_mask=attention_mask.to(model.device),
                generation_config=config,
            )
        new_tokens = out.shape[1] - input_ids.shape[1]
        if new_tokens != max_new:
            raise RuntimeError(f"HF generate made {new_tokens} tokens per row, expected {max_new}")
        generated += new_tokens * len(prompts)
    _synchronize(model.device.type)
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
    # warmup=False on CPU: it would only build a batch processor that the generation thread
    # then builds again; we wait for the thread's own instead. On CUDA its warmup captures
    # CUDA graphs before the clock starts, as transformers does by default.
    with model.continuous_batching_context_manager(
        generation_config=generation,
        continuous_batching_config=batching,
        block=True,
        warmup=args.device == "cuda",
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


def measure_floor(
    model_dir: pathlib.Path, workload: Workload, dtype: torch.dtype = torch.float32
) -> dict:
    shape = ModelShape.from_hf_config(_hf_config(model_dir))
    flops = count_workload_flops(shape, workload)
    rates = {
        f"[{m}x{k}]@[{k}x{n}]": measure_matmul_flops_per_s(m, k, n, dtype=dtype)
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


# ---------------------------------------------------------------------------- roofline (cuda)


def measure_device_rates(shape: ModelShape, args: argparse.Namespace) -> dict:
    """Copy bandwidth and the best bf16 matmul rate of this GPU (before any model loads)."""
    copy_bytes_per_s = measure_cuda_copy_bytes_per_s("cuda")
    rates = {
        f"[{m}x{k}]@[{k}x{n}]": measure_cuda_matmul_flops_per_s("cuda", m, k, n)
        for m, k, n in cuda_matmul_shapes(shape, args.max_num_batched_tokens)
    }
    best_shape = max(rates, key=rates.get)
    return {
        "copy_bytes_per_s": copy_bytes_per_s,
        "matmul_flops_per_s": rates,
        "rate_shape": best_shape,
        "best_matmul_flops_per_s": rates[best_shape],
    }


def compute_roofline(
    events: list,
    model_dir: pathlib.Path,
    rates: dict,
    workload: Workload,
    dtype: torch.dtype,
    flops_per_s=None,
) -> dict:
    """The roofline of llmlab's timed run (see the module docstring), as a JSON-able dict.
    ``flops_per_s``: a rate per step size (a ``RateCurve``) instead of the single best."""
    shape = ModelShape.from_hf_config(_hf_config(model_dir))
    weight_elements = weight_elements_read(checkpoint_numel(model_dir))
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    costs = StepCostModel.for_model(shape, weight_elements, dtype_bytes)
    work = step_work(events)
    sampled = sum(w.num_sampled for w in work)
    if sampled != workload.num_output_tokens:
        raise RuntimeError(
            f"the StepEvents sampled {sampled} tokens, the workload asked for "
            f"{workload.num_output_tokens}: the events do not cover the timed run"
        )
    rate = rates["best_matmul_flops_per_s"] if flops_per_s is None else flops_per_s
    line = roofline(work, costs, rates["copy_bytes_per_s"], rate)
    return attrs.asdict(line) | {
        "weight_elements": weight_elements,
        "weight_bytes": costs.weight_bytes,
        "kv_bytes_per_token": costs.kv_bytes_per_token,
        "output_tokens_per_s": workload.num_output_tokens / line.total_s,
        "decode_step_wall_ms": _mean_ms([w.wall_s for w in work if w.is_decode]),
        "decode_step_model_ms": _mean_ms(
            [e.model_time_s for e in events if _is_decode_event(e)]
        ),
        "decode_step_mean_batch": _mean([len(e.scheduled) for e in events if _is_decode_event(e)]),
    }


def _is_decode_event(event) -> bool:
    return bool(event.scheduled) and all(n == 1 for _, n in event.scheduled)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _mean_ms(values: list[float]) -> float | None:
    mean = _mean(values)
    return None if mean is None else 1e3 * mean


# ---------------------------------------------------------------------------- driver


def _hf_config(model_dir: pathlib.Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def prepare_mode(mode: str, model_dir: pathlib.Path, workload: Workload, args):
    """Build what a mode needs (untimed); return ``run(workload) -> RunResult``."""
    if mode == "llmlab":
        llm = build_llmlab(model_dir, workload, args)
        if args.device == "cuda":
            kv = llm.llm_engine.kv_cache
            print(
                f"KV cache: {kv.num_blocks * args.block_size} tokens; the workload needs "
                f"{kv_tokens_needed(workload, args.block_size)} at once",
                flush=True,
            )
        return LlmlabRunner(llm, record_steps=True)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=args.torch_dtype, attn_implementation="sdpa"
    )
    model = model.to(args.device).eval()
    if mode == "hf":
        return lambda w: run_hf_static(model, w, batch_size=args.hf_batch_size)
    if mode == "hf-static":
        return lambda w: run_hf_static_cache_sweep(model, w, args.hf_batch_sizes)
    return lambda w: run_hf_continuous(model, w, args=args)


def run_mode(
    mode: str, model_dir: pathlib.Path, workload: Workload, args, report: dict | None = None
) -> RunResult | None:
    """Prepare the mode, optionally warm it up, then time the workload; None if it fails.

    llmlab's timed StepEvents and the decode step split (host work vs model math on CPU,
    GPU/host on CUDA) go into ``report`` (keys ``llmlab_events`` and ``decode_split``). On
    CUDA the mode's model and caches are released before returning, so the next mode has
    the GPU to itself.
    """
    print(f"\n== {mode}", flush=True)
    run = None
    try:
        run = prepare_mode(mode, model_dir, workload, args)
        if args.warmup:
            vocab_size = _hf_config(model_dir).vocab_size
            warm = run(warmup_workload(mode, workload, args, vocab_size))
            print(f"warmup: {warm.wall_s:.2f} s", flush=True)
        result = run(workload)
    except Exception:  # noqa: BLE001 -- report it and go on to the other modes
        print(f"{mode} FAILED:\n{traceback.format_exc()}", flush=True)
        return None
    else:
        print(
            f"wall {result.wall_s:.2f} s | output {result.output_tokens_per_s:.1f} tok/s | "
            f"total {result.total_tokens_per_s:.1f} tok/s | generated {result.generated_tokens} "
            f"for {result.useful_output_tokens} useful"
            + (f" | {result.note}" if result.note else ""),
            flush=True,
        )
        if report is not None and isinstance(run, LlmlabRunner):
            report["llmlab_events"] = run.events
            report["decode_split"] = _decode_split_or_error(run.llm, workload, args)
        return result
    finally:
        del run
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
            print(
                f"GPU memory still allocated after {mode}: "
                f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB",
                flush=True,
            )


def _decode_split_or_error(llm, workload: Workload, args) -> dict:
    """The decode split for ``args.device``: profiled on CUDA, model math timed on CPU (with
    the CPU target beside it); ``{"error": ...}`` if skipped or failed."""
    batch = decode_split_batch(workload, args)
    if batch <= 0 or args.decode_steps <= 0:
        return {"error": "skipped (--decode-batch or --decode-steps is 0)"}
    cuda = args.device == "cuda"
    try:
        split = measure_decode_split(
            llm, workload.prompts[:batch], args.decode_steps, profile=cuda, time_math=not cuda
        )
    except Exception as err:  # noqa: BLE001 -- the throughput results stand without it
        what = "GPU/host split" if cuda else "host work split"
        print(f"decode {what} FAILED:\n{traceback.format_exc()}", flush=True)
        return {"error": f"{type(err).__name__}: {err}"}
    return split if cuda else split | {"host_target_ms": CPU_HOST_TARGET_MS}


def print_results(results: dict[str, RunResult]) -> None:
    print("\n== summary")
    print(f"{'mode':8} {'wall s':>8} {'out tok/s':>10} {'total tok/s':>12} {'generated':>10}")
    for mode, r in results.items():
        print(
            f"{mode:8} {r.wall_s:8.2f} {r.output_tokens_per_s:10.1f} "
            f"{r.total_tokens_per_s:12.1f} {r.generated_tokens:10d}"
        )
    tps = {mode: r.output_tokens_per_s for mode, r in results.items()}
    hf_modes = [m for m in HF_MODES if m in tps]
    best_hf = max(hf_modes, key=tps.get) if hf_modes else None
    if "llmlab" in tps:
        for other in hf_modes:
            print(f"llmlab / {other}: {tps['llmlab'] / tps[other]:.2f}x")
        if best_hf:
            print(f"llmlab / best HF ({best_hf}): {tps['llmlab'] / tps[best_hf]:.2f}x")


def print_summary(results: dict[str, RunResult], floor: dict) -> None:
    print_results(results)
    tps = {mode: r.output_tokens_per_s for mode, r in results.items()}
    hf_modes = [m for m in HF_MODES if m in tps]
    best_hf = max(hf_modes, key=tps.get) if hf_modes else None

    flops = floor["flops"]
    print("\n== compute floor")
    print(
        f"matmul GFLOP: {flops['total'] / 1e9:.1f} (linear {flops['linear'] / 1e9:.1f}, "
        f"lm_head {flops['lm_head'] / 1e9:.1f}, attention {flops['attention'] / 1e9:.1f})"
    )
    for shape, rate in floor["matmul_flops_per_s"].items():
        print(f"  torch.mm {shape}: {rate / 1e9:.1f} GFLOP/s")
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


def print_cpu_roofline(results: dict[str, RunResult], rates: dict, line: dict | None) -> None:
    print("\n== per-step roofline (llmlab's steps, from its StepEvents)")
    print(
        f"read bandwidth: {rates['read_bytes_per_s'] / 1e9:.1f} GB/s (sum of 512 MiB, best of 7, "
        "before and after the runs)"
    )
    def points(flops_per_s) -> str:
        return ", ".join(
            f"{rows}: {rate / 1e9:.0f}"
            for rows, rate in zip(rates["matmul_rows"], flops_per_s, strict=True)
        )

    print(
        "matmul GFLOP/s by rows (the model's projections), per kernel, best of a measurement "
        "before and one after the runs:"
    )
    for name, kernel_rates in rates.get("matmul_flops_per_s_by_kernel", {}).items():
        print(f"  {name}: {points(kernel_rates)}")
    for name, reason in rates.get("matmul_kernels_skipped", {}).items():
        print(f"  {name}: skipped ({reason})")
    print(
        f"  roofline rate (each projection at its fastest kernel): "
        f"{points(rates['matmul_flops_per_s'])}"
    )
    if line is None or "llmlab" not in results:
        print("no llmlab run: no roofline")
        return
    wall = results["llmlab"].wall_s
    print(
        f"floor: {line['total_s']:.2f} s over {line['num_steps']} steps "
        f"({line['memory_bound_steps']} memory-bound): weights + K/V read + K/V written over "
        "bandwidth, or FLOPs over the rate at the step's rows, whichever is larger"
    )
    print(
        f"decode steps: floor {line['decode_floor_s']:.2f} s vs wall {line['decode_wall_s']:.2f} s;"
        f" other steps: floor {line['other_floor_s']:.2f} s vs wall {line['other_wall_s']:.2f} s"
    )
    fraction = roofline_fraction(line["total_s"], wall)
    print(f"llmlab achieves {fraction:.1%} of the per-step roofline")


def cpu_rates_report(matmul, read_bytes_per_s: float) -> dict:
    """The CPU rates the roofline used, JSON-able (``extras["cpu_rates"]``)."""
    return {
        "read_bytes_per_s": read_bytes_per_s,
        "matmul_rows": list(matmul.rows),
        "matmul_flops_per_s": list(matmul.curve.flops_per_s),
        "matmul_flops_per_s_by_kernel": {name: list(r) for name, r in matmul.by_kernel.items()},
        "matmul_fastest_kernel": list(matmul.fastest()),
        "matmul_kernels_skipped": dict(matmul.skipped),
    }


class RooflineBeatenError(RuntimeError):
    """A measured run took less time than its roofline: the floor is not a floor."""


def roofline_fraction(floor_s: float, wall_s: float) -> float:
    """``floor_s / wall_s``, the fraction of the roofline a run reaches; raises
    :class:`RooflineBeatenError` above 1: a run faster than its floor means the floor
    priced something too slowly (a matmul rate below a kernel the engine runs, a bandwidth
    measured low), and a number above 100% would be reported as if it meant something."""
    if wall_s <= 0:
        raise ValueError(f"wall time must be > 0, got {wall_s}")
    fraction = floor_s / wall_s
    if fraction > 1:
        raise RooflineBeatenError(
            f"llmlab ran in {wall_s:.3f} s, under its per-step roofline of {floor_s:.3f} s "
            f"({fraction:.1%} of it): the roofline is not a floor. A rate it uses is too "
            "low: the matmul rate (is a faster kernel than those measured running?) or the "
            "read bandwidth."
        )
    return fraction


def print_cpu_decode_split(line: dict | None, decode: dict | None) -> None:
    print("\n== llmlab host work per decode step (everything but model math)")
    if line is not None and line.get("decode_step_wall_ms") is not None:
        print(
            f"timed run: {line['decode_steps']} pure-decode steps, mean "
            f"{line['decode_step_wall_ms']:.2f} ms wall, {line['decode_step_model_ms']:.2f} ms "
            f"in the model runner (mean batch {line['decode_step_mean_batch']:.0f})"
        )
    if decode is None:
        print("host work per decode step: n/a (llmlab did not run)")
        return
    if "error" in decode:
        print(f"host work per decode step: {decode['error']}")
        return
    print(
        f"host work per decode step at {decode['batch']} seqs: {decode['host_ms']:.2f} ms "
        f"(wall {decode['wall_ms']:.2f} ms, model math {decode['math_ms']:.2f} ms; "
        f"target <= {CPU_HOST_TARGET_MS} ms)"
    )
    print(
        f"  separate pass, {decode['batch']} running (prompts {decode['prompt_len_min']}-"
        f"{decode['prompt_len_max']} tokens), {decode['num_steps']} steps; model math = time "
        "inside model.forward and compute_logits, host = wall - math"
    )
    print(
        f"  (StepEvents: {decode['engine_wall_ms']:.2f} ms engine step, "
        f"{decode['model_ms']:.2f} ms in the model runner)"
    )
    stages = decode.get("host_stages_ms")
    if stages:
        print("  by stage, ms per step: " + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()))


def print_cuda_report(
    results: dict[str, RunResult], rates: dict, line: dict | None, decode: dict | None
) -> None:
    print("\n== roofline (per llmlab step, from its StepEvents)")
    print(
        f"copy bandwidth: {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s (1 GiB device-to-device, "
        "2 x bytes / time, best of 10)"
    )
    for shape, rate in rates["matmul_flops_per_s"].items():
        print(f"  torch.mm bf16 {shape}: {rate / 1e12:.1f} TFLOP/s")
    print(
        f"matmul rate: best of the above, {rates['rate_shape']} at "
        f"{rates['best_matmul_flops_per_s'] / 1e12:.1f} TFLOP/s"
    )
    if line is None:
        print("roofline: n/a (it needs llmlab's timed run; see above)")
    elif "error" in line:
        print(f"roofline: FAILED: {line['error']}")
    else:
        print(
            f"per step: weights {line['weight_bytes'] / 1e9:.3f} GB "
            f"({line['weight_elements'] / 1e6:.1f}M params) + KV "
            f"{line['kv_bytes_per_token']} B per context token; total "
            f"{line['total_bytes'] / 1e12:.2f} TB and {line['total_flops'] / 1e15:.2f} PFLOP"
        )
        print(
            f"steps: {line['num_steps']} ({line['decode_steps']} pure decode), "
            f"{line['memory_bound_steps']} memory-bound, "
            f"{line['num_steps'] - line['memory_bound_steps']} compute-bound"
        )
        print(
            f"roofline time {line['total_s']:.2f} s -> {line['output_tokens_per_s']:.0f} "
            "output tok/s"
        )
        for kind, floor_key, wall_key in (
            ("pure decode", "decode_floor_s", "decode_wall_s"),
            ("prefill/mixed", "other_floor_s", "other_wall_s"),
        ):
            floor_s, wall_s = line[floor_key], line[wall_key]
            share = f" ({floor_s / wall_s:.1%})" if wall_s > 0 else ""
            print(f"  {kind} steps: floor {floor_s:.2f} s, measured {wall_s:.2f} s{share}")
        if "llmlab" in results:
            wall_s = results["llmlab"].wall_s
            print(
                f"llmlab: {wall_s:.2f} s -> {line['total_s'] / wall_s:.1%} of the roofline "
                "(roofline time / llmlab time)"
            )

    print("\n== llmlab decode step time")
    if line is not None and "error" not in line and line["decode_step_wall_ms"] is not None:
        print(
            f"timed run: {line['decode_steps']} pure-decode steps, mean "
            f"{line['decode_step_wall_ms']:.2f} ms wall, {line['decode_step_model_ms']:.2f} ms "
            f"in the model runner (mean batch {line['decode_step_mean_batch']:.0f})"
        )
    if decode is None:
        print("GPU/host split: n/a (llmlab did not run)")
    elif "error" in decode:
        print(f"GPU/host split: {decode['error']}")
    else:
        print(
            f"separate pass, {decode['batch']} running (prompts {decode['prompt_len_min']}-"
            f"{decode['prompt_len_max']} tokens), {decode['num_steps']} steps each:"
        )
        print(
            f"  wall {decode['wall_ms']:.2f} ms | GPU busy {decode['gpu_ms']:.2f} ms | "
            f"host (wall - GPU busy) {decode['host_ms']:.2f} ms per step"
        )
        print(
            f"  (model runner {decode['model_ms']:.2f} ms of the wall; profiled steps took "
            f"{decode['profiled_wall_ms']:.2f} ms wall, {decode['num_device_activities']} "
            "device activities)"
        )
        gaps = decode.get("profiled_gaps")
        if gaps:
            print(f"  profiled: {gaps['per_step']:.1f} device gaps > {gaps['over_us']:.0f} us "
                  f"per step, {gaps['ms_per_step']:.3f} ms idle in them per step, largest "
                  f"{gaps['largest_us']:.0f} us")
        for k in decode.get("kernels") or ():
            print(f"    {k['us_per_step']:9.1f} us/step {k['calls'] / decode['num_steps']:6.1f} "
                  f"calls/step  {k['name'][:90]}")


def run_mode_isolated(mode: str, model_dir: pathlib.Path, args) -> RunResult | None:
    """``run_mode`` in a fresh ``python -m benchmarks.throughput`` process (same options,
    same workload, this model). None if it fails."""
    with tempfile.TemporaryDirectory(prefix="llmlab-bench-mode-") as tmp:
        path = pathlib.Path(tmp) / "result.json"
        # Later options win in argparse: these override the parent's.
        command = [sys.executable, "-m", "benchmarks.throughput", *args.argv, "--only", mode,
                   "--model-dir", str(model_dir), "--mode-result", str(path),
                   "--threads", str(args.threads)]
        # The child's output is relayed line by line through this process's stdout.
        env = dict(os.environ)
        if not _USER_SPINCOUNT and mode != "llmlab":
            env.pop("GOMP_SPINCOUNT", None)  # HF as a script without llmlab runs it
        with subprocess.Popen(command, cwd=pathlib.Path(__file__).resolve().parents[1],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) as child:
            for line in child.stdout:
                print(line, end="", flush=True)
        if child.returncode != 0 or not path.is_file():
            print(f"{mode} FAILED in its own process (exit status {child.returncode})",
                  flush=True)
            return None
        return RunResult(**json.loads(path.read_text()))


def _child_main(args) -> None:
    """An ``--isolate`` child: time one mode on the parent's model and workload."""
    (mode,) = args.modes
    shape = ModelShape.from_hf_config(_hf_config(args.model_dir))
    workload = make_workload(args.num_requests, args.seed, shape.vocab_size,
                             args.prompt_len_range, args.output_len_range)
    result = run_mode(mode, args.model_dir, workload, args)
    if result is not None:
        args.mode_result.write_text(json.dumps(attrs.asdict(result)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.mode_result is not None:
        _child_main(args)
        return
    cuda = args.device == "cuda"
    dtype = args.torch_dtype
    with tempfile.TemporaryDirectory(prefix="llmlab-bench-") as tmp:
        model_dir = args.model_dir or pathlib.Path(tmp) / "model"
        if not (model_dir / "config.json").is_file():
            build_benchmark_model(model_dir, seed=0, device=args.device)
        shape = ModelShape.from_hf_config(_hf_config(model_dir))
        workload = make_workload(
            args.num_requests,
            args.seed,
            shape.vocab_size,
            args.prompt_len_range,
            args.output_len_range,
        )
        print(f"model: {shape} {str(dtype).removeprefix('torch.')}, random weights (seed 0)")
        print(
            f"workload: {workload.num_requests} requests, {workload.num_prompt_tokens} prompt "
            f"tokens, {workload.num_output_tokens} output tokens (seed {args.seed})"
        )
        if cuda:
            print(
                f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
                f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
            )
        else:
            print(
                f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs, "
                f"load average {os.getloadavg()[0]:.2f} (other processes skew timings)"
            )

        extras: dict = {}
        beaten: RooflineBeatenError | None = None
        if cuda:
            rates = measure_device_rates(shape, args)
            extras["device_rates"] = rates
        else:
            extras["floor"] = measure_floor(model_dir, workload, dtype)
            # Measured again after the runs; the roofline takes the better of the two.
            matmul = measure_cpu_matmul_rates(shape, dtype)
            read_bytes_per_s = measure_cpu_read_bytes_per_s()
        report: dict = {}
        results = {}
        for mode in args.modes:
            if args.isolate and mode in HF_MODES:
                result = run_mode_isolated(mode, model_dir, args)
            else:
                result = run_mode(mode, model_dir, workload, args, report)
            if result is not None:
                results[mode] = result
        if cuda:
            line = None
            if "llmlab_events" in report:
                try:
                    line = compute_roofline(
                        report["llmlab_events"], model_dir, rates, workload, dtype
                    )
                except Exception as err:  # noqa: BLE001 -- print what was measured anyway
                    print(f"roofline FAILED:\n{traceback.format_exc()}", flush=True)
                    line = {"error": f"{type(err).__name__}: {err}"}
            extras["roofline"] = line
            extras["decode_split"] = report.get("decode_split")
            print_results(results)
            print_cuda_report(results, rates, line, extras["decode_split"])
        else:
            print_summary(results, extras["floor"])
            matmul = matmul.best_of(measure_cpu_matmul_rates(shape, dtype))
            read_bytes_per_s = max(read_bytes_per_s, measure_cpu_read_bytes_per_s())
            rates = {"copy_bytes_per_s": read_bytes_per_s, "curve": matmul.curve}
            extras["cpu_rates"] = cpu_rates_report(matmul, read_bytes_per_s)
            line = None
            if "llmlab_events" in report:
                line = compute_roofline(
                    report["llmlab_events"], model_dir, rates, workload, dtype, rates["curve"]
                )
            extras["roofline"] = line
            extras["decode_split"] = report.get("decode_split")
            try:
                print_cpu_roofline(results, extras["cpu_rates"], line)
            except RooflineBeatenError as err:  # fail at the end, with the rest reported
                print(f"ROOFLINE BEATEN: {err}", flush=True)
                beaten = err
            print_cpu_decode_split(line, extras["decode_split"])
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")

    if args.json:
        write_json(args.json, args, workload, results, extras)
        print(f"wrote {args.json}")
    if beaten is not None:
        raise beaten


def write_json(path: pathlib.Path, args, workload: Workload, results: dict, extras: dict) -> None:
    """Args, workload, per-mode results, and ``extras``: ``floor``, ``cpu_rates``,
    ``roofline`` and ``decode_split`` (host work vs model math) on CPU; ``device_rates``,
    ``roofline`` and ``decode_split`` (GPU/host) on CUDA."""
    payload = {
        "args": {
            k: str(v) if isinstance(v, (pathlib.Path, torch.dtype)) else v
            for k, v in vars(args).items()
        },
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
        **extras,
    }
    path.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()

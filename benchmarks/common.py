"""Shared benchmark pieces: the synthetic workload, the benchmark models, and the floors.

The compute floor (CPU) is the time the workload's matrix multiplications alone would take
at the best float32 ``torch.mm`` rate this machine reaches on the workload's own shapes: no
engine that runs these matmuls in float32 through torch can beat it, so an engine's
distance from it is the overhead left to remove.

The roofline (CUDA) is computed per engine step from the engine's own ``StepEvent``s: each
step must at least read every weight once plus the KV of every scheduled request's context
(at the measured device copy bandwidth), and at least do its matmul FLOPs (at the best
measured bf16 ``torch.mm`` rate); the step's floor is the larger of the two, and the
roofline is their sum. The arithmetic here is plain Python over the events, so it is unit
tested on CPU; only the two rates need a GPU.
"""

from __future__ import annotations

import math
import pathlib
import random
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

# The model arithmetic, the rate curve and the rate measurements live in the library (the
# simulator's roofline cost model prices steps with them); re-exported here under their old
# names (a redundant alias marks a re-export).
from llmlab.sim.measure import CpuMatmulRates as CpuMatmulRates
from llmlab.sim.measure import measure_cpu_matmul_rates as measure_cpu_matmul_rates
from llmlab.sim.measure import measure_cpu_rate_curve as measure_cpu_rate_curve
from llmlab.sim.measure import measure_cpu_read_bytes_per_s as measure_cpu_read_bytes_per_s
from llmlab.sim.measure import measure_cuda_copy_bytes_per_s as measure_cuda_copy_bytes_per_s
from llmlab.sim.measure import (
    measure_cuda_matmul_flops_per_s as measure_cuda_matmul_flops_per_s,
)
from llmlab.sim.measure import measure_matmul_flops_per_s as measure_matmul_flops_per_s
from llmlab.sim.roofline import ModelShape as ModelShape
from llmlab.sim.roofline import RateCurve as RateCurve

# The default benchmark model: Llama-shaped, small enough for a CPU, big enough that matmuls
# (not Python) should dominate a good engine's time.
BENCH_MODEL_CONFIG = {
    "vocab_size": 8000,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1408,
    "max_position_embeddings": 1024,
}

# The CUDA benchmark model: Qwen3-0.6B's shape (random weights; no download). Positions to
# 4096 leave room for the longest request (1024 prompt + 1024 output tokens) with margin.
QWEN3_0_6B_CONFIG = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope": {"rope_type": "default", "rope_theta": 1_000_000.0},
}

# Which model each --device benchmarks: (architecture, build_tiny_model config).
BENCH_MODELS = {
    "cpu": ("LlamaForCausalLM", BENCH_MODEL_CONFIG),
    "cuda": ("Qwen3ForCausalLM", QWEN3_0_6B_CONFIG),
}

# Token ids 0 and 1 are the tiny tokenizer's BOS and EOS; random prompts avoid them.
FIRST_ORDINARY_TOKEN_ID = 2


@attrs.frozen
class Workload:
    """Requests to run: prompt token ids and the number of output tokens each one asks for."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, num_requests: int, max_output_len: int) -> Workload:
        """The first requests, with outputs capped: a cheap warmup that takes the same paths."""
        return Workload(
            prompts=self.prompts[:num_requests],
            output_lens=[min(n, max_output_len) for n in self.output_lens[:num_requests]],
        )


def make_workload(
    num_requests: int,
    seed: int,
    vocab_size: int,
    prompt_len_range: tuple[int, int] = (16, 256),
    output_len_range: tuple[int, int] = (16, 128),
) -> Workload:
    """Random prompt ids; lengths uniform in the (inclusive) ranges; same seed, same workload."""
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_len_range)
        output_lens.append(rng.randint(*output_len_range))
        prompts.append(
            [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size) for _ in range(prompt_len)]
        )
    return Workload(prompts=prompts, output_lens=output_lens)


def build_benchmark_model(path: pathlib.Path, seed: int = 0, device: str = "cpu") -> pathlib.Path:
    """Write the random-weight benchmark model for ``device`` (HF format, float32 on disk,
    with a small tokenizer) to ``path``: the Llama of ``BENCH_MODEL_CONFIG`` for CPU, the
    Qwen3-0.6B-shaped model of ``QWEN3_0_6B_CONFIG`` for CUDA (about 2.4 GB)."""
    from llmlab.testing.tiny import build_tiny_model

    architecture, config = BENCH_MODELS[device]
    return build_tiny_model(path, architecture, seed=seed, **config)


@attrs.frozen
class WorkloadFlops:
    linear: int
    lm_head: int
    attention: int

    @property
    def total(self) -> int:
        return self.linear + self.lm_head + self.attention


def count_workload_flops(shape: ModelShape, workload: Workload) -> WorkloadFlops:
    """Matmul FLOPs an ideal engine spends on the workload (no padding, no recompute).

    A request with ``p`` prompt and ``n`` output tokens sends ``p + n - 1`` tokens through the
    layers (the prompt, then every output token but the last, which is never fed back), and
    ``n`` rows through the lm_head (the last prompt position, then each decode step). Token at
    position ``i`` (0-based) attends over ``i + 1`` positions (causal, KV cached).
    """
    linear = lm_head = attention = 0
    for prompt, num_outputs in zip(workload.prompts, workload.output_lens, strict=True):
        tokens_through_layers = len(prompt) + num_outputs - 1
        linear += tokens_through_layers * shape.linear_flops_per_token()
        lm_head += num_outputs * shape.lm_head_flops_per_token()
        sum_of_context_lens = tokens_through_layers * (tokens_through_layers + 1) // 2
        attention += shape.num_layers * shape.attention_flops_per_layer(sum_of_context_lens)
    return WorkloadFlops(linear=linear, lm_head=lm_head, attention=attention)


def representative_matmul_shapes(shape: ModelShape) -> list[tuple[int, int, int]]:
    """(rows, inner, cols) of the workload's big matmuls: prefill chunks and decode batches."""
    h, ffn, vocab = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    return [
        (512, h, ffn),  # a prefill chunk through gate/up
        (512, ffn, h),  # ... through down
        (2048, h, ffn),  # a large mixed prefill step
        (64, h, ffn),  # a 64-request decode step through gate/up
        (64, h, vocab),  # ... through the lm_head
    ]


# ---------------------------------------------------------------------------- weights


def weight_elements_read(numel_by_name: Mapping[str, int]) -> int:
    """Weight elements one forward pass reads, from a checkpoint's tensor sizes.

    Every tensor counts once. A tied lm_head is stored once (as the input embedding), and
    the lm_head matmul reads that whole matrix, so it counts once. An untied checkpoint
    stores both; its input embedding table is left out, because a lookup reads only the
    batch's rows while the lm_head reads its own full matrix. (Llama/Qwen names:
    ``embed_tokens.weight``, ``lm_head.weight``.)
    """
    has_head = any(name.endswith("lm_head.weight") for name in numel_by_name)
    return sum(
        numel
        for name, numel in numel_by_name.items()
        if not (has_head and name.endswith("embed_tokens.weight"))
    )


def checkpoint_numel(model_dir: pathlib.Path) -> dict[str, int]:
    """Element count of every tensor in a directory's ``*.safetensors`` (headers only)."""
    from safetensors import safe_open

    numel = {}
    files = sorted(pathlib.Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 -- safe_open has keys(), no __iter__
                numel[name] = math.prod(f.get_slice(name).get_shape())
    return numel


# ---------------------------------------------------------------------------- roofline


@attrs.frozen
class StepWork:
    """The least work one engine step implies, from its ``StepEvent``.

    Attributes:
        num_tokens: new tokens through the layers (prefill chunks plus decodes).
        num_sampled: rows through the lm_head (tokens sampled this step).
        kv_tokens: sum over the scheduled requests of their context after the step: the
            K/V entries (per layer) the step's attention has to read.
        attention_positions: sum over the step's new tokens of the positions each one
            attends over (causal: token at position ``i`` sees ``i + 1``).
        is_decode: every scheduled request computed exactly one token.
        wall_s: the step's measured wall time (``StepEvent.wall_time_s``).
    """

    num_tokens: int
    num_sampled: int
    kv_tokens: int
    attention_positions: int
    is_decode: bool
    wall_s: float


class ContextTracker:
    """Each running request's context length (tokens in its KV cache), step by step.

    ``StepEvent.scheduled`` gives the new tokens of each request per step, not where they
    start, so the context is accumulated here: an admission starts it at the prefix-cache
    hit (``Admission.num_cached_tokens``, usually 0), a preemption drops it (the KV is
    freed and recomputed on resumption, which is a new admission), and each scheduled
    step adds its tokens. Finished and aborted requests are forgotten. A request never
    seen admitted (e.g. a parallel sample forked from another) starts from 0.
    """

    def __init__(self) -> None:
        self.context: dict[str, int] = {}

    def advance(self, event) -> list[tuple[str, int, int]]:
        """Apply one step; ``(request_id, context before, new tokens)`` per scheduled entry."""
        for request_id in event.preempted:
            self.context.pop(request_id, None)
        for admission in event.admitted:
            self.context[admission.request_id] = admission.num_cached_tokens
        spans = []
        for request_id, num_new in event.scheduled:
            before = self.context.get(request_id, 0)
            self.context[request_id] = before + num_new
            spans.append((request_id, before, num_new))
        for request_id, _reason in event.finished:
            self.context.pop(request_id, None)
        for request_id in event.aborted:
            self.context.pop(request_id, None)
        return spans


def step_work(events: Iterable) -> list[StepWork]:
    """One :class:`StepWork` per event that ran a batch, in order."""
    tracker = ContextTracker()
    work = []
    for event in events:
        spans = tracker.advance(event)
        if not spans:
            continue
        work.append(
            StepWork(
                num_tokens=sum(n for _, _, n in spans),
                num_sampled=sum(n for _, n in event.sampled),
                kv_tokens=sum(before + n for _, before, n in spans),
                attention_positions=sum(n * before + n * (n + 1) // 2 for _, before, n in spans),
                is_decode=all(n == 1 for _, _, n in spans),
                wall_s=event.wall_time_s,
            )
        )
    return work


@attrs.frozen
class StepCostModel:
    """Bytes and FLOPs per unit of :class:`StepWork` for one model and dtype."""

    weight_bytes: int
    kv_bytes_per_token: int
    linear_flops_per_token: int  # all layers
    lm_head_flops_per_row: int
    attention_flops_per_position: int  # all layers

    @classmethod
    def for_model(cls, shape: ModelShape, weight_elements: int, dtype_bytes: int):
        return cls(
            weight_bytes=weight_elements * dtype_bytes,
            kv_bytes_per_token=shape.kv_bytes_per_token(dtype_bytes),
            linear_flops_per_token=shape.linear_flops_per_token(),
            lm_head_flops_per_row=shape.lm_head_flops_per_token(),
            attention_flops_per_position=shape.attention_flops_per_position(),
        )

    def bytes(self, work: StepWork) -> int:
        """Every weight once, the K/V the step's attention reads (its context), and the
        K/V its new tokens write."""
        return self.weight_bytes + (work.kv_tokens + work.num_tokens) * self.kv_bytes_per_token

    def flops(self, work: StepWork) -> int:
        return (
            work.num_tokens * self.linear_flops_per_token
            + work.num_sampled * self.lm_head_flops_per_row
            + work.attention_positions * self.attention_flops_per_position
        )


@attrs.frozen
class Roofline:
    """Sum of per-step floors, ``max(bytes / bandwidth, flops / matmul rate)``, with the
    measured wall time of the same steps beside it (split into pure-decode steps and the
    rest: prefill and mixed prefill+decode steps)."""

    total_s: float
    num_steps: int
    memory_bound_steps: int
    total_bytes: int
    total_flops: int
    decode_steps: int
    decode_floor_s: float
    decode_wall_s: float
    other_floor_s: float
    other_wall_s: float

    @property
    def compute_bound_steps(self) -> int:
        return self.num_steps - self.memory_bound_steps


def roofline(
    work: Sequence[StepWork],
    costs: StepCostModel,
    bytes_per_s: float,
    flops_per_s: float | Callable[[int], float],
) -> Roofline:
    """Sum of per-step floors. ``flops_per_s``: one rate, or a function of the step's rows
    through the layers (a :class:`RateCurve`)."""
    rate = flops_per_s if callable(flops_per_s) else (lambda _rows: flops_per_s)
    total = decode_floor = decode_wall = other_floor = other_wall = 0.0
    memory_bound = decode_steps = total_bytes = total_flops = 0
    for step in work:
        nbytes, flops = costs.bytes(step), costs.flops(step)
        memory_s, compute_s = nbytes / bytes_per_s, flops / rate(step.num_tokens)
        floor = max(memory_s, compute_s)
        total += floor
        total_bytes += nbytes
        total_flops += flops
        memory_bound += memory_s >= compute_s
        if step.is_decode:
            decode_steps += 1
            decode_floor += floor
            decode_wall += step.wall_s
        else:
            other_floor += floor
            other_wall += step.wall_s
    return Roofline(
        total_s=total,
        num_steps=len(work),
        memory_bound_steps=memory_bound,
        total_bytes=total_bytes,
        total_flops=total_flops,
        decode_steps=decode_steps,
        decode_floor_s=decode_floor,
        decode_wall_s=decode_wall,
        other_floor_s=other_floor,
        other_wall_s=other_wall,
    )


# ---------------------------------------------------------------------------- GPU time


# Chrome-trace categories (kineto's activity names, lower-cased) of work that occupies the
# device; "memcpy" and "memset" are what older kineto versions called the copies.
DEVICE_ACTIVITY_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})


def device_busy_us(trace_events: Iterable[Mapping]) -> tuple[float, int]:
    """Time the device was busy in a profiler chrome trace, and the number of its activities.

    Busy time is the length of the union of the ``[ts, ts + dur)`` intervals (microseconds)
    of every kernel, memcpy and memset, so work overlapping on several streams counts once.
    Everything else (CPU ops, runtime calls, annotations projected onto the GPU timeline)
    is ignored.
    """
    intervals = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in trace_events
        if e.get("ph") == "X" and e.get("cat", "").lower() in DEVICE_ACTIVITY_CATEGORIES
    )
    busy, end = 0.0, -math.inf
    for start, stop in intervals:
        if start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy, len(intervals)


def _device_activities(trace_events: Iterable[Mapping]) -> list[Mapping]:
    return [e for e in trace_events
            if e.get("ph") == "X" and e.get("cat", "").lower() in DEVICE_ACTIVITY_CATEGORIES]


def device_gaps_us(trace_events: Iterable[Mapping]) -> list[float]:
    """The idle stretches of the device in a profiler chrome trace: the gaps (microseconds)
    between consecutive stretches of the union of its activities (as
    :func:`device_busy_us` takes them), in time order."""
    intervals = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
                       for e in _device_activities(trace_events))
    gaps, end = [], None
    for start, stop in intervals:
        if end is not None and start > end:
            gaps.append(start - end)
        end = stop if end is None else max(end, stop)
    return gaps


def device_kernel_table(trace_events: Iterable[Mapping], top: int = 12) -> list[dict]:
    """The device activities of a profiler trace grouped by name, the most device time
    first: ``name``, ``total_us`` and ``calls`` for the ``top`` largest, and one ``(rest)``
    row for the others (so the table sums to the whole)."""
    totals: dict[str, list] = {}
    for e in _device_activities(trace_events):
        row = totals.setdefault(str(e.get("name", "?")), [0.0, 0])
        row[0] += float(e.get("dur", 0.0))
        row[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    table = [{"name": n, "total_us": t, "calls": c} for n, (t, c) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        table.append({"name": f"(rest: {len(rest)} more)", "total_us": sum(t for _, (t, _c) in rest),
                      "calls": sum(c for _, (_t, c) in rest)})
    return table


# ---------------------------------------------------------------------------- CUDA rates


def cuda_matmul_shapes(shape: ModelShape, step_tokens: int) -> list[tuple[int, int, int]]:
    """(rows, inner, cols) to time on the GPU: a large square one (near the device's peak)
    and the workload's own big ones (a full prefill step through gate/up and down, a
    256-row lm_head)."""
    h, ffn, vocab = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    return [
        (8192, 8192, 8192),
        (step_tokens, h, 2 * ffn),
        (step_tokens, ffn, h),
        (256, h, vocab),
    ]

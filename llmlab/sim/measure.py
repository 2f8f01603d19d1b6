"""Measuring a machine's rates for the roofline: matmul FLOP/s and memory bandwidth, on
CPU and CUDA (torch is imported when a measurement runs). Each takes the best of short
trials, so other processes sharing the machine distort it as little as possible. A rate
that depends on the rows in flight is a :class:`RateCurve`."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from llmlab.validation import as_real

if TYPE_CHECKING:
    from llmlab.sim.model_shape import ModelShape


@attrs.frozen
class RateCurve:
    """A matmul rate that depends on the rows in flight: measured at a few row counts,
    interpolated linearly in log(rows) between them and flat beyond the ends. A step of 4
    decode rows cannot reach the rate of a 2,048-row prefill, so each step is floored at
    the rate of its own size."""

    rows: tuple[int, ...]
    flops_per_s: tuple[float, ...]

    def __attrs_post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.flops_per_s):
            raise ValueError("RateCurve needs as many rates as row counts, at least one")
        if list(self.rows) != sorted(set(self.rows)) or self.rows[0] < 1:
            raise ValueError(f"rows must be increasing and >= 1, got {self.rows}")
        for rate in self.flops_per_s:
            as_real("flops_per_s", rate, min=0, min_inclusive=False)

    def __call__(self, rows: int) -> float:
        xs, ys = self.rows, self.flops_per_s
        if rows <= xs[0]:
            return ys[0]
        for i in range(1, len(xs)):
            if rows <= xs[i]:
                t = (math.log(rows) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
                return ys[i - 1] + t * (ys[i] - ys[i - 1])
        return ys[-1]

    @property
    def peak(self) -> float:
        return max(self.flops_per_s)


def _torch_dtype(dtype: Any):
    """A torch dtype from a name (``"bf16"``, ``"torch.float32"``, ...) or a torch dtype."""
    from llmlab.dtypes import dtype_from_name

    resolved = dtype_from_name(dtype)
    if resolved is None:
        raise ValueError("dtype 'auto' names no size here; give float32, bfloat16, ...")
    return resolved


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype name (``"bfloat16"`` -> 2) or a torch dtype."""
    return _torch_dtype(dtype).itemsize


def measure_matmul_flops_per_s(
    rows: int,
    inner: int,
    cols: int,
    num_trials: int = 15,
    trial_time_s: float = 0.05,
    dtype: Any = "float32",
) -> float:
    """Best CPU ``torch.mm`` rate for one shape and dtype over short trials (the best trial,
    so other processes sharing the CPU distort it as little as possible)."""
    import torch

    dtype = _torch_dtype(dtype)
    a = torch.randn(rows, inner, dtype=dtype)
    b = torch.randn(inner, cols, dtype=dtype)
    out = torch.empty(rows, cols, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    best_s_per_mm = float("inf")
    for _ in range(num_trials):
        iterations, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < trial_time_s or iterations < 2:
            torch.mm(a, b, out=out)
            iterations += 1
        best_s_per_mm = min(best_s_per_mm, elapsed / iterations)
    return 2 * rows * inner * cols / best_s_per_mm


def measure_cpu_rate_curve(
    shape: ModelShape,
    dtype: Any = "float32",
    rows: Sequence[int] = (1, 4, 16, 64, 256, 1024, 2048),
    trial_time_s: float = 0.02,
) -> RateCurve:
    """The model's own linear-layer matmul rate at several row counts: at each, the
    FLOP-weighted mean over the layer's projections (fused q/k/v, o, the MLP's input
    projections, its output projection), each at its best over short trials."""
    h, ffn = shape.hidden_size, shape.intermediate_size
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    mlp_in = 2 * ffn if shape.gated_mlp else ffn
    projections = [(h, q + 2 * kv), (q, h), (h, mlp_in), (ffn, h)]
    rates = []
    for m in rows:
        flops = seconds = 0.0
        for inner, cols in projections:
            rate = measure_matmul_flops_per_s(m, inner, cols, 5, trial_time_s, dtype)
            work = 2 * m * inner * cols
            flops += work
            seconds += work / rate
        rates.append(flops / seconds)
    return RateCurve(tuple(rows), tuple(rates))


def measure_cpu_read_bytes_per_s(num_bytes: int = 1 << 29, num_trials: int = 7) -> float:
    """Main-memory read bandwidth: the best time to sum a ``num_bytes`` float32 tensor (far
    larger than any cache), all threads."""
    import torch

    x = torch.ones(num_bytes // 4)
    x.sum()
    best_s = math.inf
    for _ in range(num_trials):
        start = time.perf_counter()
        x.sum()
        best_s = min(best_s, time.perf_counter() - start)
    return num_bytes / best_s


def measure_cuda_copy_bytes_per_s(
    device, num_bytes: int = 1 << 30, num_trials: int = 10, copies_per_trial: int = 5
) -> float:
    """Device memory bandwidth: best device-to-device ``copy_`` of ``num_bytes`` (read plus
    write, so ``2 * num_bytes`` moved per copy), timed with CUDA events."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    best_s = math.inf
    for _ in range(num_trials):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(copies_per_trial):
            dst.copy_(src)
        end.record()
        end.synchronize()
        best_s = min(best_s, start.elapsed_time(end) / 1e3 / copies_per_trial)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / best_s


def measure_cuda_matmul_flops_per_s(
    device,
    rows: int,
    inner: int,
    cols: int,
    dtype: Any = "bfloat16",
    num_trials: int = 10,
    mms_per_trial: int = 10,
) -> float:
    """Best ``torch.mm`` rate for one shape and dtype on the GPU (CUDA events)."""
    import torch

    dtype = _torch_dtype(dtype)
    a = torch.randn(rows, inner, device=device, dtype=dtype)
    b = torch.randn(inner, cols, device=device, dtype=dtype)
    out = torch.empty(rows, cols, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    torch.cuda.synchronize(device)
    best_s = math.inf
    for _ in range(num_trials):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(mms_per_trial):
            torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        best_s = min(best_s, start.elapsed_time(end) / 1e3 / mms_per_trial)
    del a, b, out
    torch.cuda.empty_cache()
    return 2 * rows * inner * cols / best_s

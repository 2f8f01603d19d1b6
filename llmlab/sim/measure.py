"""Measuring a machine's rates for the roofline: matmul FLOP/s and memory bandwidth, on
CPU and CUDA (torch is imported when a measurement runs). Each takes the best of short
trials, so other processes sharing the machine distort it as little as possible. A rate
that depends on the rows in flight is a :class:`RateCurve`. A CPU's matmul rate is the best
over the kernels it can run (``torch.mm`` and llmlab's own prepacked oneDNN linear, which
beats ``torch.mm`` on small row counts): a floor priced at a slower kernel's rate is no
floor for an engine that runs a faster one."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
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


def _best_rate(run, flops: float, num_trials: int, trial_time_s: float) -> float:
    """``flops / s`` of ``run()`` at its best trial (a few untimed calls first)."""
    for _ in range(3):
        run()
    best_s_per_call = float("inf")
    for _ in range(num_trials):
        iterations, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < trial_time_s or iterations < 2:
            run()
            iterations += 1
        best_s_per_call = min(best_s_per_call, elapsed / iterations)
    return flops / best_s_per_call


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
    return _best_rate(
        lambda: torch.mm(a, b, out=out), 2 * rows * inner * cols, num_trials, trial_time_s
    )


def measure_packed_linear_flops_per_s(
    rows: int,
    inner: int,
    cols: int,
    num_trials: int = 15,
    trial_time_s: float = 0.05,
    dtype: Any = "float32",
) -> float:
    """Best rate of llmlab's prepacked oneDNN linear (``llmlab.kernels.cpu_linear``, what
    the engine's linears run on CPU unless ``cpu_linear="plain"``) for ``rows`` rows of
    width ``inner`` through a ``[cols, inner]`` weight, no bias, over short trials."""
    import torch

    from llmlab.kernels.cpu_linear import pack_weight, packed_linear

    dtype = _torch_dtype(dtype)
    x = torch.randn(rows, inner, dtype=dtype)
    packed = pack_weight(torch.randn(cols, inner, dtype=dtype))
    return _best_rate(
        lambda: packed_linear(x, packed, None, cols), 2 * rows * inner * cols, num_trials,
        trial_time_s,
    )


# A CPU matmul kernel's rate measurement: (rows, inner, cols, num_trials, trial_time_s,
# dtype) -> FLOP/s, with measure_matmul_flops_per_s's signature.
MatmulKernel = Callable[[int, int, int, int, float, Any], float]

TORCH_MM = "torch.mm"
LLMLAB_ONEDNN = "llmlab oneDNN linear"


def cpu_matmul_kernels() -> tuple[dict[str, MatmulKernel], dict[str, str]]:
    """The CPU matmul kernels this machine can run, by name, and those it cannot, with
    why: ``torch.mm`` always, llmlab's prepacked oneDNN linear where this torch build has
    oneDNN (the engine's linears run on it there; see ``EngineConfig.cpu_linear``)."""
    from llmlab.kernels.cpu_linear import onednn_unavailable_reason

    kernels: dict[str, MatmulKernel] = {TORCH_MM: measure_matmul_flops_per_s}
    skipped: dict[str, str] = {}
    reason = onednn_unavailable_reason()
    if reason is None:
        kernels[LLMLAB_ONEDNN] = measure_packed_linear_flops_per_s
    else:
        skipped[LLMLAB_ONEDNN] = reason
    return kernels, skipped


def _rate_tuples(by_kernel: Mapping[str, Sequence[float]]) -> dict[str, tuple[float, ...]]:
    return {name: tuple(float(r) for r in rates) for name, rates in by_kernel.items()}


@attrs.frozen
class CpuMatmulRates:
    """The model's linear-layer matmul rates at several row counts, per kernel, and the
    best of them (:attr:`curve`).

    Attributes:
        rows: the row counts measured, increasing.
        by_kernel: each kernel's rate at each row count: the FLOP-weighted mean over the
            layer's projections, as if every projection ran on that kernel.
        curve: at each row count, every projection at its fastest kernel (FLOP-weighted
            mean): at least the best kernel's own rate there, so a floor priced with it
            holds whichever kernel an engine runs each projection on.
        skipped: kernels that cannot run here, with why.
    """

    rows: tuple[int, ...] = attrs.field(converter=tuple)
    by_kernel: dict[str, tuple[float, ...]] = attrs.field(converter=_rate_tuples)
    curve: RateCurve
    skipped: dict[str, str] = attrs.field(factory=dict, converter=dict)

    def __attrs_post_init__(self) -> None:
        if not self.by_kernel:
            raise ValueError("CpuMatmulRates needs at least one kernel")
        for name, rates in self.by_kernel.items():
            if len(rates) != len(self.rows):
                raise ValueError(f"kernel {name!r}: {len(rates)} rates for {len(self.rows)} rows")
        if self.curve.rows != self.rows:
            raise ValueError(f"curve rows {self.curve.rows} != rows {self.rows}")

    def best_of(self, other: CpuMatmulRates) -> CpuMatmulRates:
        """Each rate at the higher of two measurements of the same kernels at the same
        rows (other processes sharing the machine only ever make a measurement low, so the
        higher is the closer to the kernel's peak)."""
        if other.rows != self.rows or set(other.by_kernel) != set(self.by_kernel):
            raise ValueError("best_of needs measurements of the same kernels at the same rows")
        return CpuMatmulRates(
            rows=self.rows,
            by_kernel={
                name: tuple(map(max, rates, other.by_kernel[name]))
                for name, rates in self.by_kernel.items()
            },
            curve=RateCurve(
                self.rows, tuple(map(max, self.curve.flops_per_s, other.curve.flops_per_s))
            ),
            skipped=self.skipped,
        )

    def fastest(self) -> tuple[str, ...]:
        """The kernel with the best whole-layer rate at each row count."""
        return tuple(
            max(self.by_kernel, key=lambda name: self.by_kernel[name][i])
            for i in range(len(self.rows))
        )


def _projections(shape: ModelShape) -> list[tuple[int, int]]:
    """(inner, cols) of one layer's linears: fused q/k/v, o, the MLP's input projections
    (gate and up fused), its output projection."""
    h, ffn = shape.hidden_size, shape.intermediate_size
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    mlp_in = 2 * ffn if shape.gated_mlp else ffn
    return [(h, q + 2 * kv), (q, h), (h, mlp_in), (ffn, h)]


def measure_cpu_matmul_rates(
    shape: ModelShape,
    dtype: Any = "float32",
    rows: Sequence[int] = (1, 4, 16, 64, 256, 1024, 2048),
    trial_time_s: float = 0.02,
    kernels: Mapping[str, MatmulKernel] | None = None,
) -> CpuMatmulRates:
    """The model's own linear-layer matmul rates at several row counts, for every kernel
    (``kernels``: name -> measurement; by default :func:`cpu_matmul_kernels`, i.e.
    ``torch.mm`` and, where oneDNN runs, llmlab's prepacked linear), each projection at its
    best over short trials; the curve takes each projection at its fastest kernel."""
    skipped: dict[str, str] = {}
    if kernels is None:
        kernels, skipped = cpu_matmul_kernels()
    if not kernels:
        raise ValueError("no matmul kernel to measure")
    projections = _projections(shape)
    by_kernel: dict[str, list[float]] = {name: [] for name in kernels}
    best: list[float] = []
    for m in rows:
        seconds = {name: 0.0 for name in kernels}
        best_seconds = flops = 0.0
        for inner, cols in projections:
            work = 2 * m * inner * cols
            flops += work
            times = {}
            for name, measure in kernels.items():
                rate = measure(m, inner, cols, 5, trial_time_s, dtype)
                as_real(f"{name} rate", rate, min=0, min_inclusive=False)
                times[name] = work / rate
                seconds[name] += times[name]
            best_seconds += min(times.values())
        for name in kernels:
            by_kernel[name].append(flops / seconds[name])
        best.append(flops / best_seconds)
    return CpuMatmulRates(
        rows=tuple(rows),
        by_kernel=by_kernel,
        curve=RateCurve(tuple(rows), tuple(best)),
        skipped=skipped,
    )


def measure_cpu_rate_curve(
    shape: ModelShape,
    dtype: Any = "float32",
    rows: Sequence[int] = (1, 4, 16, 64, 256, 1024, 2048),
    trial_time_s: float = 0.02,
    kernels: Mapping[str, MatmulKernel] | None = None,
) -> RateCurve:
    """The model's own linear-layer matmul rate at several row counts: at each, the
    FLOP-weighted mean over the layer's projections (fused q/k/v, o, the MLP's input
    projections, its output projection), each at its fastest kernel (by default
    ``torch.mm`` and llmlab's prepacked oneDNN linear where it runs; see
    :func:`measure_cpu_matmul_rates`, which also keeps each kernel's own rates) and its
    best over short trials. ``kernels={"torch.mm": measure_matmul_flops_per_s}`` gives
    the ``torch.mm``-only curve."""
    return measure_cpu_matmul_rates(shape, dtype, rows, trial_time_s, kernels).curve


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

"""The ``roofline`` cost model: a step takes as long as its matmuls or its memory traffic.

A step through a decoder-only transformer must at least do its matmul FLOPs at the device's
peak rate, and at least read every weight once plus the KV cache its attention reads (and
write the KV of its new tokens) at the device's memory bandwidth; the slower of the two is
the step's device floor (Williams, Waterman and Patterson, "Roofline: an insightful visual
performance model for multicore architectures", CACM 2009). Small decode batches land on the
memory side, long prefills on the compute side. On top of the floor comes the engine's own
host time (:class:`~llmlab.sim.host.HostCost`), which on small models is a large share of a
step: all of it on a synchronous engine, only the executor thread's part on an overlapped
one (``async_scheduling``), whose engine thread schedules and commits while the device runs.

Three pieces, each usable alone:

* :class:`~llmlab.sim.model_shape.ModelShape` (its own module; importable from here too):
  a model's dimensions (from its Hugging Face config) and the arithmetic on them:
  parameters, FLOPs per token, KV bytes per token;
* :class:`Hardware`: peak rates, as public presets (:func:`hardware`) or measured here
  (:mod:`llmlab.sim.measure`, a CPU's rate as a :class:`~llmlab.sim.measure.RateCurve`);
* :class:`RooflineCostModel`: prices a :class:`~llmlab.sim.shape.BatchShape`.

No torch at import time: it is imported inside the functions that measure.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from llmlab.sim.experts import ExpertRouting
from llmlab.sim.host import HostCost, overlapped_time, overlaps
from llmlab.sim.measure import (
    RateCurve,
    _torch_dtype,
    dtype_bytes,
    measure_cpu_read_bytes_per_s,
    measure_cuda_copy_bytes_per_s,
    measure_cuda_matmul_flops_per_s,
    measure_matmul_flops_per_s,
)
from llmlab.sim.model_shape import ModelShape
from llmlab.validation import as_bool, as_int, as_real, as_str

if TYPE_CHECKING:
    from llmlab.observe.events import StepEvent
    from llmlab.sim.shape import BatchShape


def _positive_int(field: str):
    return functools.partial(as_int, field, min=1)


def _positive_real(field: str):
    return functools.partial(as_real, field, min=0, min_inclusive=False)


def _fraction(field: str):
    return functools.partial(as_real, field, min=0, max=1, min_inclusive=False)


# ---------------------------------------------------------------------------- hardware

GiB = 1 << 30

# What Hardware.measure times on a CPU: a 2048-wide layer at these row counts (the rate
# climbs with the rows), and a 256 MiB read (larger than any CPU's last-level cache but
# the biggest AMD V-Cache parts). Under a second on two cores.
_CPU_CURVE_ROWS = (1, 8, 64, 256)
_CPU_CURVE_WIDTH = 2048
_CPU_READ_BYTES = 256 << 20


@attrs.frozen
class Hardware:
    """A device's peak rates, as the roofline uses them.

    Attributes:
        name: the registered name (:func:`hardware`), or ``"this_machine"``.
        matmul_flops_per_s: peak dense matmul rate in the serving dtype (bf16/fp16 tensor
            cores for the GPU presets).
        memory_bytes_per_s: memory (HBM, GDDR or DRAM) bandwidth.
        memory_bytes: memory capacity.
        description: where the numbers come from.
        flops_curve: the matmul rate as a function of the rows through the layers; when
            given it replaces ``matmul_flops_per_s`` in step times (a CPU reaches its peak
            only on large batches).
    """

    name: str = attrs.field(converter=functools.partial(as_str, "name", allow_empty=False))
    matmul_flops_per_s: float = attrs.field(converter=_positive_real("matmul_flops_per_s"))
    memory_bytes_per_s: float = attrs.field(converter=_positive_real("memory_bytes_per_s"))
    memory_bytes: float = attrs.field(converter=_positive_real("memory_bytes"))
    description: str = ""
    flops_curve: RateCurve | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(RateCurve))
    )

    def matmul_rate(self, rows: int) -> float:
        """The matmul rate a step with ``rows`` tokens through the layers reaches."""
        if self.flops_curve is None:
            return self.matmul_flops_per_s
        return self.flops_curve(max(rows, 1))

    @classmethod
    def measure(cls, dtype: Any = "float32", device: str = "cpu",
                refresh: bool = False) -> Hardware:
        """This machine's rates in ``dtype`` (once per process per dtype and device; later
        calls return the same object). CPU: a ``torch.mm`` rate curve over batch sizes on
        a 2048-wide layer (peak: its best point) and the read bandwidth of a 256 MiB sum,
        in under a second, saved under ``$LLMLAB_CACHE_DIR`` (default ``~/.cache/llmlab``)
        ``/hardware`` for this CPU, core count, torch version and thread count: later
        processes read the same numbers, so a simulation on ``"this_machine"`` gives the
        same results in every process (``refresh=True`` measures again and replaces them).
        CUDA (pass ``dtype="bfloat16"`` for the serving rate): the best ``torch.mm`` over
        three large shapes and a 1 GiB device copy, measured in each process."""
        dtype, device = str(_torch_dtype(dtype)).removeprefix("torch."), str(device)
        if refresh:
            _measure.cache_clear()
            if device == "cpu":
                _saved_path(dtype).unlink(missing_ok=True)
        return _measure(dtype, device)


def _saved_path(dtype: str) -> pathlib.Path:
    """Where this machine's CPU measurement in ``dtype`` is kept (keyed by everything the
    numbers depend on, so another CPU, torch or thread count measures afresh)."""
    import torch

    from llmlab.kernels.cpu_kernels import cache_root, machine_tag

    key = json.dumps([machine_tag(), os.cpu_count(), torch.__version__,
                      torch.get_num_threads(), dtype, _CPU_CURVE_ROWS, _CPU_CURVE_WIDTH,
                      _CPU_READ_BYTES])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "hardware" / f"this_machine-{digest}.json"


@functools.cache
def _measure(dtype: str, device: str) -> Hardware:
    if device.startswith("cuda"):
        return _measure_cuda(dtype, device)
    if device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    path = _saved_path(dtype)
    try:
        saved = json.loads(path.read_text())
        return attrs.evolve(Hardware(**{k: v for k, v in saved.items() if k != "flops_curve"}),
                            flops_curve=RateCurve(*map(tuple, saved["flops_curve"])))
    except (OSError, ValueError, TypeError, KeyError):
        pass  # not measured yet here (or unreadable): measure and save
    hardware = _measure_cpu(dtype)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        saved = attrs.asdict(hardware, recurse=False)
        saved["flops_curve"] = [list(hardware.flops_curve.rows),
                                list(hardware.flops_curve.flops_per_s)]
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(saved))
        tmp.replace(path)  # atomic: a reader sees the old file or the whole new one
    except OSError:
        pass  # a read-only home: measured in each process, as before
    return hardware


def _measure_cpu(dtype: str) -> Hardware:
    rates = tuple(
        measure_matmul_flops_per_s(
            m, _CPU_CURVE_WIDTH, _CPU_CURVE_WIDTH, num_trials=3, trial_time_s=0.01, dtype=dtype
        )
        for m in _CPU_CURVE_ROWS
    )
    curve = RateCurve(_CPU_CURVE_ROWS, rates)
    return Hardware(
        name="this_machine",
        matmul_flops_per_s=curve.peak,
        memory_bytes_per_s=measure_cpu_read_bytes_per_s(_CPU_READ_BYTES, num_trials=2),
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        description=(
            f"this machine's CPU ({os.cpu_count()} logical cores), measured: {dtype} torch.mm "
            f"on a {_CPU_CURVE_WIDTH}-wide layer at {_CPU_CURVE_ROWS} rows, "
            f"{_CPU_READ_BYTES >> 20} MiB read"
        ),
        flops_curve=curve,
    )


def _measure_cuda(dtype: str, device: str) -> Hardware:
    import torch

    shapes = [(8192, 8192, 8192), (4096, 4096, 16384), (16384, 4096, 4096)]
    flops = max(
        measure_cuda_matmul_flops_per_s(device, m, k, n, dtype=dtype, num_trials=5)
        for m, k, n in shapes
    )
    props = torch.cuda.get_device_properties(device)
    return Hardware(
        name="this_machine",
        matmul_flops_per_s=flops,
        memory_bytes_per_s=measure_cuda_copy_bytes_per_s(device, num_trials=5),
        memory_bytes=props.total_memory,
        description=f"{props.name}, measured: best {dtype} torch.mm, device-to-device copy",
    )


# Public spec sheets, dense (no 2:4 sparsity) bf16 tensor-core rates:
# - H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100):
#   1,979 TFLOPS bf16 with sparsity, so 989.4 dense; 3.35 TB/s HBM3; 80 GB.
# - H200 SXM: NVIDIA H200 page (nvidia.com/en-us/data-center/h200): same Hopper compute
#   as the H100 SXM; 4.8 TB/s HBM3e; 141 GB.
# - A100 80GB SXM: NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): 312 TFLOPS
#   bf16 dense; 2,039 GB/s HBM2e; 80 GB.
# - L4: NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4): 242 TFLOPS bf16 with
#   sparsity, so 121 dense; 300 GB/s GDDR6; 24 GB.
# Real kernels reach a fraction of these: set RooflineCostModel's efficiencies from a run.
PRESETS: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("h100_sxm", 989.4e12, 3.35e12, 80 * GiB, "NVIDIA H100 SXM5 80GB (spec sheet)"),
        Hardware("h200", 989.4e12, 4.8e12, 141e9, "NVIDIA H200 SXM 141GB (spec sheet)"),
        Hardware("a100_80gb", 312e12, 2.039e12, 80 * GiB, "NVIDIA A100 80GB SXM (spec sheet)"),
        Hardware("l4", 121e12, 300e9, 24e9, "NVIDIA L4 24GB (spec sheet)"),
    )
}
ALIASES = {"h100": "h100_sxm", "a100": "a100_80gb"}
THIS_MACHINE = "this_machine"


def hardware_names() -> list[str]:
    """Every name :func:`hardware` accepts."""
    return sorted([*PRESETS, *ALIASES, THIS_MACHINE])


def hardware(name_or_instance: str | Hardware) -> Hardware:
    """A :class:`Hardware` by registered name (``"h100"``, ``"l4"``, ``"this_machine"``:
    measured on this machine's CPU, float32), or the instance itself."""
    if isinstance(name_or_instance, Hardware):
        return name_or_instance
    if not isinstance(name_or_instance, str):
        raise TypeError(f"hardware must be a name or a Hardware, got {name_or_instance!r}")
    name = name_or_instance.strip().lower()
    if name == THIS_MACHINE:
        return Hardware.measure()
    name = ALIASES.get(name, name)
    if name not in PRESETS:
        raise ValueError(
            f"unknown hardware {name_or_instance!r}; known: {', '.join(hardware_names())}"
        )
    return PRESETS[name]


_lookup_hardware = hardware  # RooflineCostModel.for_model's argument shadows the name


# ---------------------------------------------------------------------------- cost model


def _as_model_shape(value: Any) -> ModelShape:
    if not isinstance(value, ModelShape):
        raise TypeError(
            f"model must be a ModelShape (see RooflineCostModel.for_model for a model "
            f"directory or a config), got {type(value).__name__} {value!r}"
        )
    return value


def _as_host_cost(value: Any) -> HostCost:
    if not isinstance(value, HostCost):
        raise TypeError(f"host must be a HostCost, got {type(value).__name__} {value!r}")
    return value


def _as_expert_routing(value: Any) -> ExpertRouting:
    if not isinstance(value, ExpertRouting):
        raise TypeError(
            f"experts must be an ExpertRouting, got {type(value).__name__} {value!r}"
        )
    return value


def _default_weight_bytes(value: int | None, self: RooflineCostModel) -> int:
    if value is None:
        return self.model.num_parameters_read() * self.dtype_bytes
    return as_int("weight_bytes", value, min=0)


@attrs.frozen
class RooflineCostModel:
    """A step takes ``max(FLOPs / matmul rate, bytes / bandwidth)`` plus host time;
    overlapped, ``max(device, hidden host) + unhidden host`` (:class:`HostCost`).

    FLOPs: every token through the layers' projections, every sampled row through the LM
    head, every (token, attended position) pair through attention. Bytes: every weight once,
    the KV the step's attention reads (``context_tokens``) and the KV its new tokens write.
    An ideal kernel's floor, so the efficiencies (the fraction of peak a real run reaches,
    from a measurement) scale the rates down. A step with no requests costs host time only.

    A mixture of experts (``model.num_experts``) is priced by its active parameters: each
    token runs the router and ``top_k`` experts of every sparse layer (the FLOPs of a dense
    model of as many parameters), stretched by ``experts.imbalance`` (the step waits for the
    most loaded expert); and a step reads only the experts some token picked: ``top_k`` a
    layer for one token, all of them for a long prefill, the expected number in between
    (:meth:`~llmlab.sim.model_shape.ModelShape.expected_experts_read`, under uniform
    routing or ``experts.shares``).

    Attributes:
        model: the model's shape.
        hardware: a :class:`Hardware` or a registered name (:func:`hardware`).
        dtype_bytes: bytes per weight and per KV element.
        weight_bytes: weights read per step (default: ``model.num_parameters_read()`` times
            ``dtype_bytes``; give it for quantized weights or a measured checkpoint).
        compute_efficiency, memory_efficiency: fractions of the peak rates reached, in (0, 1].
        host: the engine's host time per step, split into what overlap hides and what it
            does not.
        experts: how tokens spread over a mixture of experts' experts
            (:class:`~llmlab.sim.experts.ExpertRouting`: uniform and balanced by default;
            ``ExpertRouting.from_loads(events)`` reads a recorded run's); unused for a dense
            model. ``weight_bytes`` counts every expert; a step reads the share of it its
            experts make.
        overlap: whether the engine modelled overlaps its steps (``async_scheduling``).
            None: as the simulated engine's ``async_scheduling`` resolves
            (:func:`~llmlab.sim.cost_model.with_overlap`: on for a GPU preset unless it is
            False); priced on its own, None is synchronous. A step that verifies
            speculative drafts is priced synchronous either way (the engine runs it so).
    """

    # Converters, not validators, check the types: weight_bytes's default reads the model,
    # and attrs runs every converter before any validator.
    model: ModelShape = attrs.field(converter=_as_model_shape)
    hardware: Hardware = attrs.field(converter=hardware)
    dtype_bytes: int = attrs.field(default=2, converter=_positive_int("dtype_bytes"))
    weight_bytes: int = attrs.field(
        default=None, converter=attrs.Converter(_default_weight_bytes, takes_self=True)
    )
    compute_efficiency: float = attrs.field(
        default=1.0, converter=_fraction("compute_efficiency")
    )
    memory_efficiency: float = attrs.field(default=1.0, converter=_fraction("memory_efficiency"))
    host: HostCost = attrs.field(factory=HostCost, converter=_as_host_cost)
    overlap: bool | None = attrs.field(
        default=None, converter=functools.partial(as_bool, "overlap", allow_none=True)
    )
    experts: ExpertRouting = attrs.field(factory=ExpertRouting, converter=_as_expert_routing)

    def __attrs_post_init__(self) -> None:
        if self.model.is_moe and self.experts.shares is not None:
            self.model.expected_experts_read(1, self.experts.shares)  # refuses a wrong shape

    @classmethod
    def for_model(
        cls,
        model: ModelShape | str | os.PathLike | Any,
        hardware: str | Hardware = THIS_MACHINE,
        dtype: Any = None,
        **kwargs: Any,
    ) -> RooflineCostModel:
        """For a model directory (its ``config.json``), a Hugging Face config or a
        :class:`ModelShape`, on ``hardware``. ``dtype`` (``"bfloat16"``, ``"float32"``, ...)
        sets ``dtype_bytes``; by default float32 on ``"this_machine"`` (measured in that
        dtype) and bfloat16 on a preset. ``kwargs``: the other fields."""
        if isinstance(model, (str, os.PathLike)):
            model = ModelShape.from_pretrained(model)
        elif not isinstance(model, ModelShape):
            model = ModelShape.from_hf_config(model)
        on_this_machine = isinstance(hardware, str) and hardware.strip().lower() == THIS_MACHINE
        if dtype is None:
            dtype = "float32" if on_this_machine else "bfloat16"
        device = Hardware.measure(dtype) if on_this_machine else _lookup_hardware(hardware)
        return cls(model=model, hardware=device, dtype_bytes=dtype_bytes(dtype), **kwargs)

    def flops(self, shape: BatchShape) -> float:
        m = self.model
        per_token = m.linear_flops_per_token()
        if m.is_moe and self.experts.imbalance != 1.0:
            # The experts' share runs at the busiest expert's pace.
            per_token += (self.experts.imbalance - 1.0) * m.expert_flops_per_token()
        return (
            shape.num_tokens * per_token
            + shape.num_sampled * m.lm_head_flops_per_token()
            + shape.attention_positions * m.attention_flops_per_position()
        )

    def weights_read_bytes(self, shape: BatchShape) -> float:
        """The weights a step reads: ``weight_bytes``, less the experts no token picked (a
        mixture of experts; :meth:`ModelShape.parameters_read`)."""
        m = self.model
        if not m.is_moe:
            return self.weight_bytes
        read = m.parameters_read(shape.num_tokens, self.experts.shares)
        return self.weight_bytes * read / m.num_parameters_read()

    def bytes(self, shape: BatchShape) -> float:
        kv_tokens = shape.context_tokens + shape.num_tokens  # read the context, write the new
        return (self.weights_read_bytes(shape)
                + kv_tokens * self.model.kv_bytes_per_token(self.dtype_bytes))

    def compute_time(self, shape: BatchShape) -> float:
        rate = self.hardware.matmul_rate(shape.num_tokens) * self.compute_efficiency
        return self.flops(shape) / rate

    def memory_time(self, shape: BatchShape) -> float:
        return self.bytes(shape) / (self.hardware.memory_bytes_per_s * self.memory_efficiency)

    def device_time(self, shape: BatchShape) -> float:
        """The roofline part of a step: ``max(compute, memory)`` (0 with no requests)."""
        if shape.num_requests == 0:
            return 0.0
        return max(self.compute_time(shape), self.memory_time(shape))

    def step_time(self, shape: BatchShape) -> float:
        """Synchronous: device + host. Overlapped: ``max(device, host.hidden_time) +
        host.unhidden_time``."""
        device = self.device_time(shape)
        if overlaps(self.overlap, shape):
            return overlapped_time(device, self.host.hidden_time(shape),
                                   self.host.unhidden_time(shape))
        return device + self.host.time(shape)

    def fit_host(self, events: Iterable[StepEvent]) -> RooflineCostModel:
        """This model with its :class:`HostCost` fitted on a *synchronous* run's step
        events: each step's measured cycle (:func:`~llmlab.sim.cost_model.measured_step_times`)
        less its roofline time, by least squares with every term >= 0 (per step, request,
        token, admission, and per wake-up after an idle gap). The device part
        stays the hardware's; only what the hardware cannot explain goes to the host. A
        step event does not say which thread spent its host time: the fitted per-step and
        per-request terms are split between the engine and executor threads in the
        current host term's proportions (:meth:`HostCost.with_totals`)."""
        from llmlab.sim.cost_model import as_shapes
        from llmlab.sim.profiled import _nonnegative_least_squares

        shapes, times = as_shapes(events)
        if len(shapes) < 5:
            raise ValueError(
                f"fitting the host term needs at least 5 steps that ran a batch, got "
                f"{len(shapes)}"
            )
        x = np.array([[s.num_requests, s.num_tokens, s.num_admitted, s.after_idle]
                      for s in shapes], dtype=np.float64)
        y = np.asarray(times) - np.array([self.device_time(s) for s in shapes])
        (per_request, per_token, per_admission, per_wakeup), per_step = (
            _nonnegative_least_squares(x, y))
        return attrs.evolve(self, host=self.host.with_totals(
            per_step_s=per_step, per_request_s=float(per_request),
            per_token_s=float(per_token), per_admission_s=float(per_admission),
            per_wakeup_s=float(per_wakeup),
        ))

"""W4A16: 4-bit weights, activations in float32 / bfloat16 / float16, one canonical layout.

Every 4-bit checkpoint format (GPTQ, AWQ, compressed-tensors pack-quantized) is converted at
load time (:mod:`llmlab.quantization`) into this layout of one linear ``[out, in]`` with
group size ``g`` (dividing ``in``; ``g == in`` is per channel):

* ``qweight``: uint8 ``[out, in // 2]``, two unsigned 4-bit values per byte, the low nibble
  holding the even input index (:func:`pack`, :func:`unpack`);
* ``scales``: float32 ``[out, in // g]``; ``zeros``: float32 ``[out, in // g]`` holding the
  integer zero point (0..15, symmetric = 8; 16 is accepted too, GPTQ v1's zero point read
  back as ``stored + 1``);
* ``w[o, i] = (q[o, i] - zeros[o, i // g]) * scales[o, i // g]`` (:func:`dequantize`).

:func:`prepare` repacks a weight once for the kernel that will run it and returns an
:class:`Int4Weight`; :func:`linear` runs it. Kernels (``Int4Weight.kernel``):

* ``"int4pack_mm"`` (CPU, bfloat16, ``out % 16 == 0``, a group size that 32, 64, 128 or 256
  divides): ATen's int4 CPU matmul (``_weight_int4pack_mm_for_cpu``, tinygemm's layout),
  which reads a quarter of the bytes of a bfloat16 matmul: the handle holds that layout
  alone, 4.25 bits per weight at group 128 (what a 4-bit checkpoint is chosen for). Its
  time grows with the rows (it dequantizes the weight again for every 4: 2.2x
  dequantize-then-matmul's at 2,048 rows), so ``prepare(..., int4pack_max_rows=N)`` trades
  memory for prefill speed: the handle also keeps ``"dequant_matmul"``'s layout and calls of
  more than ``N`` rows run it (:data:`INT4PACK_MAX_ROWS` = 32 measured best; 8.75 bits per
  weight then).
* ``"dequant_matmul"`` (CPU otherwise): the weight dequantized on the fly into a reused
  scratch buffer, at most :data:`SCRATCH_BYTES` of output rows at a time (the full float
  weight is never held), each chunk multiplied by ``F.linear``. Dequantized in float32 (one
  rounding per weight), then cast for 16-bit activations. ATen's int4 kernel is not
  used for float32 / float16 activations: on x86 only its bfloat16 path is vectorized (the
  others are a scalar loop, 15 to 80 times slower than float32 ``F.linear``, measured). No
  float copy of the weight is cached: a 4-bit checkpoint is picked to save memory, and a
  cached copy would hold more bytes than the float model.
* ``"triton_w4a16"`` (CUDA): :mod:`llmlab.kernels.triton_int4`, a GEMM that dequantizes the
  nibbles in registers (float32 accumulation).
* ``"torch_dequant"`` (CUDA where the Triton kernel does not take the group size, or
  without triton): dequantize the whole weight, then ``F.linear``.

Numbers (speed and error) are in ``benchmarks/quantization.py``'s kernels section and in
``tests/quantization/test_int4_kernels.py``.
"""

from __future__ import annotations

import threading

import attrs
import torch
import torch.nn.functional as F

from llmlab.validation import as_int

# ATen's int4 CPU kernel takes these group sizes; a larger group is run as several of them
# (the scale repeated), an exact rewrite.
INT4PACK_GROUP_SIZES = (256, 128, 64, 32)
# The split to pass as ``prepare(int4pack_max_rows=...)`` when prefill speed matters more than
# memory: ATen's int4 kernel's time grows with the rows (it dequantizes the weight again for
# every 4): on par with dequantize-then-matmul at 64 rows, 2.2x slower at 2048
# (benchmarks/quantization.py --only kernels, AVX-512, one thread).
INT4PACK_MAX_ROWS = 32
# Largest float chunk of a weight the CPU fallback dequantizes at once (per thread).
SCRATCH_BYTES = 4 << 20
MAX_ZERO_POINT = 16
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

KERNEL_INT4PACK = "int4pack_mm"
KERNEL_DEQUANT = "dequant_matmul"
KERNEL_TRITON = "triton_w4a16"
KERNEL_TORCH_DEQUANT = "torch_dequant"
KERNELS = (KERNEL_INT4PACK, KERNEL_DEQUANT, KERNEL_TRITON, KERNEL_TORCH_DEQUANT)


# --- the canonical layout -------------------------------------------------------------


def pack(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[out, in]`` values in 0..15 -> uint8 ``[out, in // 2]``, the even input
    index in the low nibble."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"pack takes q of shape [out, in] with an even in, got {tuple(q.shape)}")
    if q.dtype != torch.uint8:
        raise ValueError(f"pack takes q as uint8 values in 0..15, got dtype {q.dtype}")
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"pack takes q in 0..15, got a value of {int(q.max())}")
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[out, in // 2]`` -> uint8 ``[out, in]`` values in 0..15 (:func:`pack`'s
    inverse)."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(
            f"unpack takes packed uint8 [out, in // 2], got {packed.dtype} {tuple(packed.shape)}"
        )
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def check_layout(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> tuple[int, int]:
    """``(out, in)`` of a weight in the canonical layout, or ``ValueError`` naming what does
    not fit (dtypes, shapes, a group size that does not divide ``in``, zero points)."""
    if qweight.dim() != 2 or qweight.dtype != torch.uint8:
        raise ValueError(
            f"qweight must be uint8 [out, in // 2], got {qweight.dtype} {tuple(qweight.shape)}"
        )
    out_features, in_features = qweight.shape[0], 2 * qweight.shape[1]
    group_size = as_int("group_size", group_size, min=1)
    if in_features % group_size:
        raise ValueError(
            f"group_size {group_size} must divide the input size {in_features} "
            f"(qweight {tuple(qweight.shape)}); group_size == {in_features} is per channel"
        )
    groups = (out_features, in_features // group_size)
    for name, tensor in (("scales", scales), ("zeros", zeros)):
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != groups:
            raise ValueError(
                f"{name} must be float32 {list(groups)} ([out, in // group_size] for in "
                f"{in_features}, group_size {group_size}), got {tensor.dtype} "
                f"{list(tensor.shape)}"
            )
    if zeros.numel():
        bad = (zeros != zeros.round()) | (zeros < 0) | (zeros > MAX_ZERO_POINT)
        if bool(bad.any()):
            value = float(zeros[bad][0])
            raise ValueError(
                f"zeros must hold integer zero points in 0..15 (16 accepted), got {value}"
            )
    return out_features, in_features


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The float32 weight ``[out, in]``: ``(q - zeros) * scales`` per group (the reference
    every kernel is checked against; plain torch, one rounding per element)."""
    check_layout(qweight, scales, zeros, group_size)
    return _dequantize(qweight, scales, zeros, group_size)


def _dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    out_features = qweight.shape[0]
    q = unpack(qweight).float().view(out_features, -1, group_size)
    w = (q - zeros.to(q.device)[..., None]) * scales.to(q.device)[..., None]
    return w.view(out_features, -1)


# --- a prepared weight ----------------------------------------------------------------


@attrs.define(eq=False)
class Int4Weight:
    """A 4-bit weight repacked for the kernel that runs it (:func:`prepare`); call
    :func:`linear`. ``kernel`` names what runs (one of :data:`KERNELS`); ``nbytes`` counts
    every byte the handle holds (packed weights, scales, zeros)."""

    out_features: int
    in_features: int
    group_size: int
    dtype: torch.dtype
    device: torch.device
    kernel: str
    # Each kernel's tensors, by name (see the _prepare_* functions).
    tensors: dict[str, torch.Tensor]
    # The group size the kernel runs at: ``group_size`` or, for ``int4pack_mm``, a divisor.
    kernel_group_size: int
    # ``int4pack_mm`` with the dequantize layout kept too: calls with more rows run
    # ``dequant_matmul``. None: ATen's kernel at every row count (its layout alone).
    int4pack_max_rows: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def kernel_for(self, rows: int) -> str:
        """The kernel a call of ``rows`` rows runs."""
        if (self.kernel == KERNEL_INT4PACK and self.int4pack_max_rows is not None
                and rows > self.int4pack_max_rows and "halves" in self.tensors):
            return KERNEL_DEQUANT
        return self.kernel


def _int4pack_unavailable_reason(
    out_features: int, group_size: int, dtype: torch.dtype
) -> str | None:
    """Why ATen's int4 CPU kernel cannot (or should not) run this weight; None if it can."""
    ops = torch.ops.aten
    if not (hasattr(ops, "_weight_int4pack_mm_for_cpu")
            and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")):
        return "this torch build has no _weight_int4pack_mm_for_cpu"
    if dtype != torch.bfloat16:
        # On x86 its float32 / float16 paths are scalar loops (measured 15-80x slower than
        # F.linear); ARM's NEON path covers them, but was not measured.
        return f"its {dtype} path is a scalar loop on x86 (bfloat16 only is vectorized)"
    if out_features % 16:
        return f"it needs out % 16 == 0, got out {out_features}"
    if _int4pack_group(group_size) is None:
        return f"it needs a group size divisible by 32, 64, 128 or 256, got {group_size}"
    return None


def _int4pack_group(group_size: int) -> int | None:
    return next((g for g in INT4PACK_GROUP_SIZES if group_size % g == 0), None)


def prepare(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    kernel: str | None = None,
    int4pack_max_rows: int | None = None,
) -> Int4Weight:
    """Repack a canonical 4-bit weight once for activations of ``dtype`` on ``device``
    (default: ``qweight``'s). ``kernel`` forces a choice (tests, benchmarks); by default
    the fastest one that takes the weight on that device (see the module docstring).
    ``int4pack_max_rows``: with ATen's int4 kernel, keep the dequantize layout too and run
    calls of more rows through it (faster prefill, about twice the bytes)."""
    out_features, in_features = check_layout(qweight, scales, zeros, group_size)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    device = torch.device(device) if device is not None else qweight.device
    if kernel is None:
        kernel = _default_kernel(out_features, in_features, group_size, dtype, device)
    elif kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS} or None, got {kernel!r}")
    if kernel == KERNEL_INT4PACK:
        reason = _int4pack_unavailable_reason(out_features, group_size, dtype)
        if reason is not None or device.type != "cpu":
            raise ValueError(f"kernel {kernel!r} cannot run this weight: {reason or device}")
        tensors = _prepare_int4pack(qweight, scales, zeros, group_size, dtype)
        if int4pack_max_rows is not None:
            tensors.update(_prepare_dequant(qweight, scales, zeros, dtype))
    elif kernel == KERNEL_DEQUANT:
        tensors = _prepare_dequant(qweight, scales, zeros, dtype)
    elif kernel == KERNEL_TRITON:
        from llmlab.kernels import triton_int4

        reason = triton_int4.unsupported_reason(in_features, group_size, device)
        if reason is not None:
            raise ValueError(f"kernel {kernel!r} cannot run this weight: {reason}")
        tensors = triton_int4.prepare(unpack(qweight), scales, zeros)
    else:
        tensors = {"qweight": qweight, "scales": scales, "zeros": zeros}
    tensors = {name: t.to(device) for name, t in tensors.items()}
    kernel_group = _int4pack_group(group_size) if kernel == KERNEL_INT4PACK else group_size
    return Int4Weight(out_features, in_features, group_size, dtype, device, kernel, tensors,
                      kernel_group,
                      int4pack_max_rows if kernel == KERNEL_INT4PACK else None)


def _default_kernel(
    out_features: int, in_features: int, group_size: int, dtype: torch.dtype,
    device: torch.device,
) -> str:
    if device.type == "cpu":
        if _int4pack_unavailable_reason(out_features, group_size, dtype) is None:
            return KERNEL_INT4PACK
        return KERNEL_DEQUANT
    try:
        from llmlab.kernels import triton_int4
    except ImportError:
        return KERNEL_TORCH_DEQUANT
    if triton_int4.unsupported_reason(in_features, group_size, device) is None:
        return KERNEL_TRITON
    return KERNEL_TORCH_DEQUANT


def _prepare_int4pack(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """tinygemm's layout. Its dequantization is ``(q - 8) * scale + zero`` with scale and
    zero in the activation dtype; ours is ``(q - z) * s``. So ``scale = dtype(s)`` and
    ``zero = dtype((8 - z) * scale)``: the zero is taken from the rounded scale, so the
    only rounding beyond the scale's is the zero's own (none for symmetric weights, where
    it is 0)."""
    tiny_group = _int4pack_group(group_size)
    repeat = group_size // tiny_group
    q = unpack(qweight.cpu()).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scale = scales.cpu().to(dtype).repeat_interleave(repeat, dim=1)
    zero = ((8 - zeros.cpu().repeat_interleave(repeat, dim=1)) * scale.float()).to(dtype)
    # [in // tiny_group, out, 2]: (scale, zero) of each group and output channel.
    scale_and_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
    return {"int4pack": packed, "scale_and_zeros": scale_and_zeros}


def _prepare_dequant(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The CPU fallback's layout: byte ``j`` of a row holds input ``j`` (low nibble) and
    input ``j + in // 2`` (high nibble), so each nibble plane unpacks into one contiguous
    half of the float row (the canonical interleave would need a strided write, measured
    2-3x slower). Scales and ``-zero * scale`` in float32."""
    q = unpack(qweight)
    half = q.shape[1] // 2
    halves = (q[:, :half] | (q[:, half:] << 4)).contiguous()
    return {"halves": halves, "scales": scales.contiguous(), "zeros": zeros.contiguous()}


# --- running it -----------------------------------------------------------------------


def linear(x: torch.Tensor, handle: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for ``x`` ``[..., in]`` in ``handle.dtype``; ``[..., out]``."""
    if x.shape[-1] != handle.in_features:
        raise ValueError(
            f"x's last dimension must be the weight's input size {handle.in_features}, "
            f"got x of shape {tuple(x.shape)}"
        )
    if x.dtype != handle.dtype:
        raise ValueError(f"x must be {handle.dtype} (the weight was prepared for it), got {x.dtype}")
    rows = x.reshape(-1, handle.in_features)
    kernel = handle.kernel_for(rows.shape[0])
    if rows.shape[0] == 0:
        y = rows.new_empty((0, handle.out_features))
    elif kernel == KERNEL_INT4PACK:
        t = handle.tensors
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.contiguous(), t["int4pack"], handle.kernel_group_size, t["scale_and_zeros"]
        )
    elif kernel == KERNEL_DEQUANT:
        y = _dequant_matmul(rows, handle)
    elif kernel == KERNEL_TRITON:
        from llmlab.kernels import triton_int4

        y = triton_int4.w4a16_matmul(rows, handle.tensors, handle.group_size)
    else:
        t = handle.tensors
        w = _dequantize(t["qweight"], t["scales"], t["zeros"], handle.group_size)
        y = F.linear(rows, w.to(handle.dtype))
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], handle.out_features)


_SCRATCH = threading.local()


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-thread buffer of at least ``numel`` elements, kept between calls: a fresh
    multi-megabyte allocation per call costs page faults comparable to the matmul."""
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = {}
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        # A normal tensor even when made under inference_mode (the engine's forward): an
        # inference tensor could not be written in place by a later call outside it.
        with torch.inference_mode(False):
            buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def _dequant_matmul(rows: torch.Tensor, handle: Int4Weight) -> torch.Tensor:
    t = handle.tensors
    halves, scales, zeros = t["halves"], t["scales"], t["zeros"]
    n, k, g = handle.out_features, handle.in_features, handle.group_size
    chunk = max(1, min(n, SCRATCH_BYTES // (4 * k)))
    # Dequantized in float32 (one rounding), then cast: torch's in-place ops on bfloat16
    # with float32 scales are a slow path (15x), and bfloat16 scales would round twice.
    w32 = _scratch(chunk * k, torch.float32)
    w = w32 if rows.dtype == torch.float32 else _scratch(chunk * k, rows.dtype)
    nibbles = _scratch(chunk * k // 2, torch.uint8)
    y = None
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        size = (stop - start) * k
        w_chunk = w32[:size].view(stop - start, k)
        _dequantize_halves(halves[start:stop], scales[start:stop], zeros[start:stop], g,
                           w_chunk, nibbles[: size // 2].view(stop - start, k // 2))
        if w is not w32:
            w_chunk = w[:size].view(stop - start, k).copy_(w_chunk)
        if start == 0 and stop == n:
            return F.linear(rows, w_chunk)
        if y is None:
            y = rows.new_empty((rows.shape[0], n))
        y[:, start:stop] = F.linear(rows, w_chunk)
    return y


def _dequantize_halves(
    halves: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    out: torch.Tensor, nibbles: torch.Tensor,
) -> None:
    """Write ``(q - zeros) * scales`` of the halves layout into ``out`` (float32 ``[n, k]``)."""
    half = out.shape[1] // 2
    torch.bitwise_and(halves, 15, out=nibbles)
    out[:, :half].copy_(nibbles)
    torch.bitwise_right_shift(halves, 4, out=nibbles)
    out[:, half:].copy_(nibbles)
    grouped = out.view(out.shape[0], -1, group_size)
    grouped.sub_(zeros[..., None]).mul_(scales[..., None])

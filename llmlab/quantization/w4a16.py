"""4-bit weights, 16/32-bit activations (W4A16): the linear layer every 4-bit checkpoint
format loads into, in one canonical layout.

The canonical layout (the contract with :mod:`llmlab.kernels.int4`):

* ``qweight``: uint8 ``[out, in / 2]``, two 4-bit unsigned values per byte, the low
  nibble holding the even input index;
* ``scales``: float32 ``[out, in / group_size]``; ``zeros``: the integer zero points of
  the same shape (0..15; 8 for symmetric formats; a GPTQ v1 checkpoint may say 16), so
  ``w[o, i] = (q[o, i] - zeros[o, i // group_size]) * scales[o, i // group_size]``;
* groups are contiguous runs of ``group_size`` input channels. A checkpoint whose groups
  are not (GPTQ act-order, compressed-tensors ``actorder: group``: a ``g_idx`` per layer)
  has its input channels permuted at load time so that they are: ``perm`` is stored, and
  the layer computes ``x[..., perm] @ w.T``. :func:`canonical_layout` sorts the channels
  by group (stably) and takes as the canonical group size the largest that splits every
  run of equal group ids, which is the checkpoint's own group size whenever each group
  is whole (always, for one device); a tensor-parallel rank holding part of a group gets
  smaller groups with repeated scales: the same weights, never an approximation.

Zero points are stored as uint8 (exact: small integers) and scales as float32, so a layer
holds ``4 + 40 / group_size`` bits per weight: 4.31 at group 128.

Kernels (:meth:`W4A16Linear.finalize` picks one):

* ``"int4"``: :mod:`llmlab.kernels.int4` (``prepare`` once, ``linear`` per call; which
  kernel runs is its choice: ATen's int4 CPU matmul, a chunked CPU dequantize-matmul, a
  Triton GEMM on CUDA). Its handle holds its own repacked copy of the weight, so the
  canonical buffers are released once it is made (one copy of the weight, not two);
* ``"dequantize"``: where that module is missing or refuses the layer, or when asked: the
  weight is dequantized to float32 for each call and multiplied in the activations' dtype
  (the float reference's own arithmetic). The canonical buffers stay.
"""

from __future__ import annotations

import logging
import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

KERNELS = ("int4", "dequantize")


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 values ``[out, in]`` (0..15, ``in`` even) -> ``[out, in / 2]``, the even
    input index in the low nibble."""
    values = values.to(torch.uint8)
    return values[:, 0::2] | (values[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: uint8 ``[out, in]``."""
    out, half = packed.shape
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(out, half * 2)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int) -> torch.Tensor:
    """The canonical layout's float32 weight ``[out, in]``: ``(q - zero) * scale`` per
    group (the reference every kernel is checked against)."""
    values = unpack_nibbles(qweight).float()
    out, width = values.shape
    grouped = values.view(out, width // group_size, group_size)
    weight = (grouped - zeros.float()[:, :, None]) * scales.float()[:, :, None]
    return weight.reshape(out, width)


@attrs.frozen
class CanonicalInt4:
    """One linear (or one part of a fused one) in the canonical layout; ``perm`` is None
    when the input order is the checkpoint's."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None


def canonical_layout(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     g_idx: torch.Tensor) -> CanonicalInt4:
    """Unpacked values ``[out, in]`` with per-group ``scales``/``zeros`` ``[out, groups]``
    and each input channel's group ``g_idx`` ``[in]`` -> the canonical layout: channels
    sorted by group (stable, so contiguous groups stay in place and ``perm`` is None),
    canonical groups as large as every run of one group id allows (see the module
    docstring), their scales and zero points gathered from the groups they lie in."""
    width = g_idx.numel()
    if width % 2:
        raise ValueError(f"a 4-bit layer needs an even input width, got {width}")
    perm = torch.argsort(g_idx, stable=True)
    ordered = g_idx[perm]
    starts = torch.nonzero(ordered[1:] != ordered[:-1]).reshape(-1) + 1
    bounds = [0, *starts.tolist(), width]
    group_size = 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        group_size = math.gcd(group_size, end - start)
    if bool((perm == torch.arange(width)).all()):
        perm_or_none = None
    else:
        values, perm_or_none = values[:, perm], perm
    source = ordered[::group_size]
    return CanonicalInt4(
        qweight=pack_nibbles(values),
        scales=scales[:, source].float().contiguous(),
        zeros=zeros[:, source].float().contiguous(),
        group_size=group_size,
        perm=perm_or_none,
    )


def _int4_kernels():
    """:mod:`llmlab.kernels.int4` when it is there (it holds the fast W4A16 kernels)."""
    try:
        from llmlab.kernels import int4
    except ImportError:
        return None
    return int4


class W4A16Linear(nn.Module):
    """A linear layer holding 4-bit weights in the canonical layout (module docstring):
    buffers ``qweight`` uint8 ``[out, in / 2]``, ``scales`` float32 and ``zeros`` uint8
    ``[out, in / group_size]``, ``perm`` int64 ``[in]`` or None; ``bias`` a float
    parameter in the model dtype (``dtype``, also the activations'). Inference only.

    ``kernel`` says what runs: ``"int4"`` or ``"dequantize"`` (module docstring), set by
    :meth:`finalize` once the buffers are filled."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None, group_size: int | None = None,
                 source: str = "") -> None:
        super().__init__()
        if in_features % 2:
            raise ValueError(f"in_features must be even for 4-bit weights, got {in_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.activation_dtype = dtype
        self.source = source  # the checkpoint format, for logs and repr
        self.register_buffer("qweight", torch.empty(
            out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("perm", None)
        self.group_size = 0
        self._allocate_groups(group_size or in_features, device)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                         requires_grad=False)
            if bias else None
        )
        self.kernel = "dequantize"
        self._handle = None

    def _allocate_groups(self, group_size: int, device=None) -> None:
        if self.in_features % group_size:
            raise ValueError(
                f"group_size={group_size} does not divide in_features={self.in_features}"
            )
        if group_size == self.group_size:
            return
        shape = (self.out_features, self.in_features // group_size)
        device = device if device is not None else self.qweight.device
        self.register_buffer("scales", torch.empty(shape, dtype=torch.float32, device=device))
        self.register_buffer("zeros", torch.empty(shape, dtype=torch.uint8, device=device))
        self.group_size = group_size

    def set_layout(self, group_size: int, perm: torch.Tensor | None) -> None:
        """The layer's canonical group size and input permutation (at load time, from its
        first checkpoint part; the scales are reallocated when the size changes)."""
        self._allocate_groups(group_size)
        self.perm = None if perm is None else perm.to(self.qweight.device, torch.int64)

    def load_rows(self, row_offset: int, part: CanonicalInt4) -> None:
        """Copy one part (q, k or v of a fused ``qkv_proj``; all of an unfused layer) into
        its output rows; its layout must be the layer's (:meth:`set_layout`)."""
        rows = part.qweight.shape[0]
        with torch.no_grad():
            self.qweight[row_offset:row_offset + rows].copy_(part.qweight)
            self.scales[row_offset:row_offset + rows].copy_(part.scales)
            self.zeros[row_offset:row_offset + rows].copy_(part.zeros)

    @property
    def holds_canonical(self) -> bool:
        """Whether the canonical buffers still hold the weight (not released to a kernel
        handle)."""
        return self.qweight.numel() > 0 or self.out_features == 0

    def finalize(self, kernel: str | None = None) -> None:
        """Prepare for ``forward`` once the buffers hold their values. ``kernel``: None
        picks ``"int4"`` where :mod:`llmlab.kernels.int4` exists and takes the layer (its
        handle made, the canonical buffers released), else ``"dequantize"``; naming one
        forces it (``"int4"`` raises ``ValueError`` where it cannot run)."""
        if kernel not in (None, *KERNELS):
            raise ValueError(f"kernel must be one of {KERNELS} or None, got {kernel!r}")
        if not self.holds_canonical:
            raise ValueError("finalize: this layer's weight was already handed to a kernel")
        self.kernel, self._handle = "dequantize", None
        int4 = _int4_kernels() if kernel != "dequantize" else None
        if int4 is None:
            if kernel == "int4":
                raise ValueError("kernel='int4' needs llmlab.kernels.int4, which is missing")
            return
        try:
            handle = int4.prepare(self.qweight, self.scales, self.zeros.float(),
                                  self.group_size, dtype=self.activation_dtype)
        except (ValueError, NotImplementedError, RuntimeError) as err:
            if kernel == "int4":
                raise ValueError(f"kernel='int4' cannot run {self.extra_repr()}: {err}") from err
            logger.debug("int4 kernel not used for %s: %s", self.extra_repr(), err)
            return
        self.kernel, self._handle = "int4", handle
        kept = {t.untyped_storage().data_ptr() for t in _handle_tensors(handle)}
        if self.qweight.untyped_storage().data_ptr() not in kept:
            # The handle repacked the weight: one copy is enough.
            for name in ("qweight", "scales", "zeros"):
                tensor = getattr(self, name)
                self.register_buffer(name, tensor.new_empty((0,) * tensor.dim()))

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` in the layer's input order (``perm`` undone):
        ``F.linear(x, dequantized_weight())`` is what ``forward`` computes. Exact from the
        canonical buffers; once they are released, read back through the kernel (an
        identity matrix multiplied in the activation dtype: the weight as it computes with
        it, rounded to that dtype)."""
        if self.holds_canonical:
            weight = dequantize(self.qweight, self.scales, self.zeros, self.group_size)
        else:
            eye = torch.eye(self.in_features, dtype=self.activation_dtype,
                            device=_handle_device(self._handle))
            weight = _int4_kernels().linear(eye, self._handle).t().float()
        if self.perm is None:
            return weight
        unpermuted = torch.empty_like(weight)
        unpermuted[:, self.perm] = weight
        return unpermuted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        if self.kernel == "int4":
            y = _int4_kernels().linear(rows, self._handle, self.bias)
        else:
            weight = dequantize(self.qweight, self.scales, self.zeros, self.group_size)
            y = F.linear(rows, weight.to(rows.dtype), self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = self.kernel
        if self.kernel == "int4":
            kernel += f" ({getattr(self._handle, 'kernel', '?')})"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, group_size={self.group_size}, "
            f"act_order={self.perm is not None}, kernel={kernel}"
            + (f", {self.source}" if self.source else "")
        )


def _handle_tensors(handle: object) -> list[torch.Tensor]:
    """The tensors a kernel handle holds (its ``tensors`` dict, if it has one)."""
    tensors = getattr(handle, "tensors", None)
    return list(tensors.values()) if isinstance(tensors, dict) else []


def _handle_device(handle: object) -> torch.device:
    device = getattr(handle, "device", None)
    if device is not None:
        return torch.device(device)
    tensors = _handle_tensors(handle)
    return tensors[0].device if tensors else torch.device("cpu")

"""The 4-bit formats' tensor layouts, read into one plain form (:class:`Int4Tensors`).

Per checkpoint linear ``X`` (``[out, in]`` in float), with ``G`` groups of input channels:

* **GPTQ**: ``X.qweight`` int32 ``[in / 8, out]``, eight 4-bit values per word along the
  input (value ``j`` of word ``r`` in bits ``4j..4j+3`` is input channel ``8r + j``);
  ``X.qzeros`` int32 ``[G, out / 8]``, packed the same way along the output; ``X.scales``
  ``[G, out]``; ``X.g_idx`` int32 ``[in]``, each input channel's group (``i // group_size``
  unless act-order). v1 checkpoints store each zero point minus one.
* **AWQ (GEMM)**: ``X.qweight`` int32 ``[in, out / 8]`` packed along the output in the
  interleaved order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (value ``i`` of word ``c`` is output
  channel ``8c + order[i]``); ``X.qzeros`` int32 ``[G, out / 8]`` likewise; ``X.scales``
  ``[G, out]``; groups contiguous.
* **compressed-tensors pack-quantized**: ``X.weight_packed`` int32 ``[out, ceil(in / 8)]``
  packed along the input, each value the signed integer plus 8; ``X.weight_scale``
  ``[out, G]``; ``X.weight_zero_point`` (asymmetric) int32 ``[ceil(out / 8), G]`` packed
  along the output, signed plus 8 (older writers: int8 ``[out, G]`` signed);
  ``X.weight_shape`` ``[out, in]``; ``X.weight_g_idx`` ``[in]`` with ``actorder: group``.

Every reader checks shapes and ``g_idx`` before using them and raises ``ValueError`` naming
the tensor and its file. The result keeps the checkpoint's input order; regrouping for the
canonical layout is :func:`llmlab.quantization.w4a16.canonical_layout`'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from llmlab.quantization.int4_formats import Int4Format

# Which tensors make up one quantized linear, per method: (required, optional) suffixes.
PARTS = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "compressed-tensors": (
        ("weight_packed", "weight_scale", "weight_shape"), ("weight_zero_point", "weight_g_idx"),
    ),
}
# The tensor whose presence marks a checkpoint linear as 4-bit.
MARKERS = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}
# AWQ's GEMM packing: value i of a word holds output channel 8c + _AWQ_ORDER[i].
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(_AWQ_ORDER.index(k) for k in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@attrs.frozen
class Int4Tensors:
    """One checkpoint linear's 4-bit weight, unpacked: ``w[o, i] = (values[o, i] -
    zeros[o, g_idx[i]]) * scales[o, g_idx[i]]``.

    Attributes:
        values: uint8 ``[out, in]``, 0..15, in the checkpoint's input order.
        scales: float32 ``[out, groups]``.
        zeros: float32 ``[out, groups]``, integer zero points (8 where symmetric).
        g_idx: int64 ``[in]``: each input channel's group.
    """

    values: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor


@attrs.frozen
class Where:
    """Names a checkpoint linear in errors: its prefix and how to find a tensor's file."""

    prefix: str
    files: Mapping[str, str] = attrs.field(factory=dict)  # tensor name -> file

    def tensor(self, suffix: str) -> str:
        name = f"{self.prefix}.{suffix}"
        file = self.files.get(name)
        return f"{name} (in {file})" if file else name


def unpack_words(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words ``[a, b]`` -> their eight 4-bit values each (low bits first) as uint8,
    spread along ``dim``: ``[8a, b]`` for dim 0, ``[a, 8b]`` for dim 1."""
    a, b = words.shape
    values = (words.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF  # [a, b, 8]
    if dim == 1:
        return values.reshape(a, b * 8).to(torch.uint8)
    return values.permute(0, 2, 1).reshape(a * 8, b).to(torch.uint8)


def _shape_error(where: Where, suffix: str, tensor: torch.Tensor, expected: str) -> ValueError:
    return ValueError(
        f"checkpoint tensor {where.tensor(suffix)} has shape {tuple(tensor.shape)} and dtype "
        f"{tensor.dtype}; expected {expected} for this 4-bit layer"
    )


def _check(where: Where, suffix: str, tensor: torch.Tensor, shape: tuple[int, ...],
           integer: bool = False) -> None:
    bad_dtype = integer and (tensor.dtype.is_floating_point or tensor.dtype == torch.bool)
    if tuple(tensor.shape) != shape or bad_dtype:
        kind = "an integer tensor of shape" if integer else "shape"
        raise _shape_error(where, suffix, tensor, f"{kind} {shape}")


def _groups(fmt: Int4Format, in_features: int, where: Where, suffix: str) -> int:
    group = fmt.group_size or in_features
    if in_features % group:
        raise ValueError(
            f"checkpoint tensor {where.tensor(suffix)} has {in_features} input channels, "
            f"which {fmt.group_field}={fmt.group_size} in {fmt.config_path} does not divide"
        )
    return in_features // group


def check_g_idx(g_idx: torch.Tensor, fmt: Int4Format, in_features: int, groups: int,
                where: Where, suffix: str) -> torch.Tensor:
    """``g_idx`` as int64 after checking it against the layer: ``[in]`` integers in
    ``[0, groups)``, each group holding exactly ``group_size`` channels."""
    _check(where, suffix, g_idx, (in_features,), integer=True)
    g_idx = g_idx.to(torch.int64)
    if in_features and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise ValueError(
            f"checkpoint tensor {where.tensor(suffix)} holds group indices from "
            f"{int(g_idx.min())} to {int(g_idx.max())}; allowed: 0 to {groups - 1} (the "
            "layer's scale groups)"
        )
    counts = torch.bincount(g_idx, minlength=groups)
    size = in_features // groups
    if bool((counts != size).any()):
        bad = int(torch.nonzero(counts != size)[0])
        raise ValueError(
            f"checkpoint tensor {where.tensor(suffix)} puts {int(counts[bad])} channels in "
            f"group {bad}; every group must hold {fmt.group_field}={size} of them "
            f"({fmt.config_path})"
        )
    return g_idx


def _contiguous_g_idx(in_features: int, groups: int) -> torch.Tensor:
    return torch.arange(in_features, dtype=torch.int64) // (in_features // groups)


def unpack_gptq(parts: Mapping[str, torch.Tensor], fmt: Int4Format, where: Where
                ) -> Int4Tensors:
    """A GPTQ linear (v1 or v2 zero points, with or without act-order)."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise _shape_error(where, "qweight", qweight, "int32 [in / 8, out]")
    in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
    groups = _groups(fmt, in_features, where, "qweight")
    _check(where, "scales", scales, (groups, out_features))
    if out_features % 8:
        raise _shape_error(where, "qweight", qweight, "an output width divisible by 8")
    _check(where, "qzeros", qzeros, (groups, out_features // 8), integer=True)
    zeros = unpack_words(qzeros, dim=1).float() + fmt.zero_offset  # [groups, out]
    if "g_idx" in parts:
        g_idx = check_g_idx(parts["g_idx"], fmt, in_features, groups, where, "g_idx")
    elif fmt.act_order:
        raise ValueError(
            f"checkpoint linear {where.prefix} has no {where.prefix}.g_idx, which desc_act="
            f"true in {fmt.config_path} needs"
        )
    else:
        g_idx = _contiguous_g_idx(in_features, groups)
    return Int4Tensors(
        values=unpack_words(qweight, dim=0).t().contiguous(),
        scales=scales.float().t().contiguous(),
        zeros=zeros.t().contiguous(),
        g_idx=g_idx,
    )


def unpack_awq(parts: Mapping[str, torch.Tensor], fmt: Int4Format, where: Where
               ) -> Int4Tensors:
    """An AWQ GEMM linear."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise _shape_error(where, "qweight", qweight, "int32 [in, out / 8]")
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    groups = _groups(fmt, in_features, where, "qweight")
    _check(where, "scales", scales, (groups, out_features))
    _check(where, "qzeros", qzeros, (groups, out_features // 8), integer=True)
    undo = list(_AWQ_UNDO)

    def outputs_in_order(words: torch.Tensor) -> torch.Tensor:
        rows = words.shape[0]
        values = unpack_words(words, dim=1).reshape(rows, -1, 8)[:, :, undo]
        return values.reshape(rows, -1)

    return Int4Tensors(
        values=outputs_in_order(qweight).t().contiguous(),
        scales=scales.float().t().contiguous(),
        zeros=outputs_in_order(qzeros).float().t().contiguous(),
        g_idx=_contiguous_g_idx(in_features, groups),
    )


def unpack_compressed(parts: Mapping[str, torch.Tensor], fmt: Int4Format, where: Where
                      ) -> Int4Tensors:
    """A compressed-tensors pack-quantized linear (group or channel strategy)."""
    packed, scales, shape = parts["weight_packed"], parts["weight_scale"], parts["weight_shape"]
    if shape.numel() != 2:
        raise _shape_error(where, "weight_shape", shape, "[out, in]")
    out_features, in_features = (int(v) for v in shape.reshape(-1).tolist())
    _check(where, "weight_packed", packed, (out_features, -(-in_features // 8)), integer=True)
    groups = _groups(fmt, in_features, where, "weight_packed")
    _check(where, "weight_scale", scales, (out_features, groups))
    zero_point = parts.get("weight_zero_point")
    if zero_point is None:
        if not fmt.symmetric:
            raise ValueError(
                f"checkpoint linear {where.prefix} has no {where.prefix}.weight_zero_point, "
                f"which symmetric=false in {fmt.config_path} needs"
            )
        zeros = torch.full((out_features, groups), 8.0)
    elif tuple(zero_point.shape) == (out_features, groups):
        # Signed, one per group (symmetric checkpoints: all zero; older asymmetric ones).
        _check(where, "weight_zero_point", zero_point, (out_features, groups), integer=True)
        zeros = zero_point.float() + 8
    else:
        # Packed along the output, unsigned (signed + 8): compressed-tensors >= 0.10.
        packed_shape = (-(-out_features // 8), groups)
        if zero_point.dtype != torch.int32:
            raise _shape_error(where, "weight_zero_point", zero_point,
                               f"int32 {packed_shape} or {(out_features, groups)}")
        _check(where, "weight_zero_point", zero_point, packed_shape)
        zeros = unpack_words(zero_point, dim=0)[:out_features].float()
    if "weight_g_idx" in parts:
        g_idx = check_g_idx(parts["weight_g_idx"], fmt, in_features, groups, where,
                            "weight_g_idx")
    elif fmt.act_order:
        raise ValueError(
            f"checkpoint linear {where.prefix} has no {where.prefix}.weight_g_idx, which "
            f"actorder='group' in {fmt.config_path} needs"
        )
    else:
        g_idx = _contiguous_g_idx(in_features, groups)
    return Int4Tensors(
        values=unpack_words(packed, dim=1)[:, :in_features].contiguous(),
        scales=scales.float().contiguous(),
        zeros=zeros.contiguous(),
        g_idx=g_idx,
    )


UNPACKERS = {"gptq": unpack_gptq, "awq": unpack_awq, "compressed-tensors": unpack_compressed}


def unpack(parts: Mapping[str, torch.Tensor], fmt: Int4Format, where: Where) -> Int4Tensors:
    """One checkpoint linear's tensors (by suffix) in :class:`Int4Tensors` form."""
    return UNPACKERS[fmt.method](parts, fmt, where)

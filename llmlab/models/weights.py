"""Copying checkpoint tensors into a model whose layout differs from the checkpoint's.

Our models fuse projections (q/k/v into one ``qkv_proj``, gate/up into ``gate_up_proj``) so
the hot path runs one matmul instead of three, and under tensor parallelism each rank holds
only a slice of most of them. Each model therefore supplies a name mapper from a checkpoint
name to one or more :class:`WeightTarget` (which parameter, which rows, whether to
transpose, which slice of the checkpoint tensor); :func:`load_mapped_weights` does the
copying and all the checking, so a model's loader is a short table of renames.

Checkpoint tensors may arrive lazily (:class:`LazyTensor`, a safetensors slice handle): a
rank then reads only the slices its targets name, never the whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
import torch
from torch import nn


@attrs.frozen
class WeightTarget:
    """Where one checkpoint tensor (or a slice of it) goes.

    Attributes:
        param: name of the model parameter (as in ``model.named_parameters()``).
        row_offset: first row of ``param`` the tensor fills; a fused parameter receives
            several tensors stacked along dim 0.
        transpose: the checkpoint stores the matrix as ``[in, out]`` (GPT-2's Conv1D).
        shard: ``(dim, start, length)``: only that slice of the checkpoint tensor, in the
            checkpoint's own dimensions (before ``transpose``); None: all of it.
        zero: fill the destination rows with zeros instead (a row-parallel layer's bias
            lives on rank 0 only, so the all-reduce adds it once).
    """

    param: str
    row_offset: int = 0
    transpose: bool = False
    shard: tuple[int, int, int] | None = None
    zero: bool = False


# Returns None for a checkpoint tensor the model deliberately ignores (a precomputed
# buffer, a tied head); any other name must map to one or more real parameters.
NameMapper = Callable[[str], "WeightTarget | list[WeightTarget] | None"]


class LazyTensor:
    """A checkpoint tensor not read yet: its shape, and reads of all of it or one slice
    (a safetensors ``get_slice`` handle, valid while its file is open)."""

    def __init__(self, handle) -> None:
        self._handle = handle
        self.shape = torch.Size(handle.get_shape())

    def read(self, shard: tuple[int, int, int] | None = None) -> torch.Tensor:
        if shard is None:
            return self._handle[:]
        dim, start, length = shard
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._handle[tuple(index)]


def strip_prefixes(name: str, prefixes: tuple[str, ...]) -> str:
    """Drop each wrapper prefix in order when present (``model.``, ``transformer.``, ...).

    Real checkpoints disagree on these: ``gpt2`` on the Hub has bare ``h.0...`` names while
    a re-saved GPT2LMHeadModel has ``transformer.h.0...``; OPT has both ``decoder.`` and
    ``model.decoder.`` variants.
    """
    for prefix in prefixes:
        name = name.removeprefix(prefix)
    return name


def _read(tensor: torch.Tensor | LazyTensor, shard: tuple[int, int, int] | None) -> torch.Tensor:
    if isinstance(tensor, LazyTensor):
        return tensor.read(shard)
    if shard is None:
        return tensor
    dim, start, length = shard
    return tensor.narrow(dim, start, length)


# A quantized checkpoint (llmlab.quantization) stores beside each quantized ``X.weight``
# its per-output-channel scales ``X.weight_scale``, already a vector of output channels.
SCALE_SUFFIX = ".weight_scale"


def _is_quantized_dtype(dtype: torch.dtype) -> bool:
    return dtype == torch.int8 or (dtype.is_floating_point and dtype.itemsize == 1)


def scale_target(target: WeightTarget) -> WeightTarget:
    """Where a weight's per-output-channel scale goes: the same rows of the parameter's
    ``_scale`` companion, sliced only where the weight's output dimension is (a
    row-parallel weight's scale is whole on every rank)."""
    out_dim = 1 if target.transpose else 0
    shard = None
    if target.shard is not None and target.shard[0] == out_dim:
        shard = (0, target.shard[1], target.shard[2])
    return WeightTarget(f"{target.param}_scale", row_offset=target.row_offset, shard=shard)


def _map_with_scales(map_name: NameMapper, name: str) -> list[WeightTarget] | None:
    scaled = name.endswith(SCALE_SUFFIX)
    targets = map_name(name.removesuffix("_scale") if scaled else name)
    if targets is None:
        return None
    if isinstance(targets, WeightTarget):
        targets = [targets]
    return [scale_target(t) for t in targets] if scaled else targets


def load_mapped_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | LazyTensor]],
    map_name: NameMapper,
) -> None:
    """Copy ``weights`` into ``model`` via ``map_name``; every parameter row must be filled.

    Raises:
        ValueError: on an unknown name, a shape mismatch, or parameters left unfilled.
    """
    params = dict(model.named_parameters())
    model_name = type(model).__name__
    filled_rows: dict[str, int] = {}
    for name, tensor in weights:
        targets = _map_with_scales(map_name, name)
        if targets is None:
            continue
        for target in targets:
            param = params.get(target.param)
            if param is None:
                raise ValueError(
                    f"unexpected weight {name!r} for {model_name} (mapped to "
                    f"{target.param!r}, which the model does not have); is the checkpoint "
                    "for a different architecture?"
                )
            if target.shard is not None and target.shard[2] + target.shard[1] > (
                tensor.shape[target.shard[0]]
            ):
                raise ValueError(
                    f"weight {name!r} with shape {tuple(tensor.shape)} is too small for its "
                    f"tensor-parallel slice {target.shard} (dim, start, length); does the "
                    "config match the checkpoint?"
                )
            if target.zero:
                shape = list(tensor.shape)
                if target.shard is not None:
                    shape[target.shard[0]] = target.shard[2]
                source = torch.zeros(shape, dtype=param.dtype)
            else:
                source = _read(tensor, target.shard)
            if target.transpose:
                source = source.t()
            rows = source.shape[0] if source.dim() > 0 else 1
            if target.row_offset + rows > param.shape[0]:
                raise ValueError(
                    f"weight {name!r} with shape {tuple(source.shape)} does not fit "
                    f"{target.param!r} {tuple(param.shape)} at row {target.row_offset}"
                )
            dest = param.data.narrow(0, target.row_offset, rows)
            if dest.shape != source.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(source.shape)} but {model_name}."
                    f"{target.param} expects {tuple(dest.shape)}; does the config match the "
                    "checkpoint?"
                )
            if _is_quantized_dtype(dest.dtype) and source.dtype != dest.dtype:
                # Casting floats into int8 / fp8 would truncate them, not quantize them.
                raise ValueError(
                    f"weight {name!r} is {source.dtype} but {model_name}.{target.param} "
                    f"holds quantized {dest.dtype}; is the checkpoint quantized?"
                )
            with torch.no_grad():
                dest.copy_(source)
            filled_rows[target.param] = filled_rows.get(target.param, 0) + rows

    # Compare row counts rather than names so a fused parameter with only q and k loaded
    # (or with q loaded twice) is caught too.
    wrong = [n for n, p in params.items() if filled_rows.get(n, 0) != p.shape[0]]
    if wrong:
        detail = ", ".join(
            f"{n} ({filled_rows.get(n, 0)}/{params[n].shape[0]} rows)" for n in wrong[:8]
        )
        raise ValueError(
            f"checkpoint does not fill {len(wrong)} {model_name} parameter(s) exactly once: "
            f"{detail}{' ...' if len(wrong) > 8 else ''}"
        )

"""Loading a 4-bit checkpoint (GPTQ, AWQ, compressed-tensors W4A16) into llmlab's models.

Two passes over the checkpoint, driven by :func:`llmlab.models.loader.load_model`:

1. :meth:`Int4Loader.prepare`, on the model built on the meta device: the checkpoint's
   tensor names and shapes (safetensors headers; no weight is read) say which linears are
   4-bit (those with ``X.qweight`` / ``X.weight_packed``). Each is mapped through the
   model's own checkpoint-name map (``_map_weight_name(X.weight)``), so q/k/v land in
   ``qkv_proj``, gate/up in ``gate_up_proj``, and an MoE expert's in its own
   :class:`~llmlab.models.llama.GatedMLP`; the model linears they fill become
   :class:`~llmlab.quantization.w4a16.W4A16Linear` (an MoE router too, if the checkpoint
   quantized it). Refused here, by name: a linear both
   4-bit and float (a fused layer whose parts disagree), a 4-bit head or embedding, a
   4-bit layer the config says stays in float, a layer missing one of its tensors.
2. :meth:`Int4Loader.read`, a filter on the weight stream: each 4-bit linear's tensors are
   gathered, unpacked (:mod:`llmlab.quantization.int4_unpack`), sliced for this rank under
   tensor parallelism (output rows for a column-parallel layer, input channels for a
   row-parallel one), put in the canonical layout and copied into the layer's rows. Every
   other tensor (embeddings, norms, biases, float layers) goes on to the model's ordinary
   loader. At the end every 4-bit layer must be filled exactly, then each is finalized.

Fused parts share one input, so they must share one input order: a layer whose parts'
``g_idx`` give different permutations is refused, naming both tensors.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import attrs
import torch
from torch import nn

from llmlab.models.loader import iterate_weights, load_model
from llmlab.models.weights import LazyTensor, WeightTarget
from llmlab.quantization.base import linear_children
from llmlab.quantization.int4_formats import Int4Format
from llmlab.quantization.int4_unpack import MARKERS, PARTS, Where, unpack
from llmlab.quantization.w4a16 import W4A16Linear, canonical_layout


@attrs.define
class _CheckpointLinear:
    """One 4-bit linear of the checkpoint: the tensors it has, where they go, and the ones
    read so far."""

    prefix: str
    suffixes: frozenset[str]
    targets: list[WeightTarget]
    parts: dict[str, torch.Tensor] = attrs.Factory(dict)
    loaded: bool = False


def _tensor_files(model_path: pathlib.Path, names: list[str]) -> dict[str, str]:
    """Each tensor's file, for error messages: the shard index's map, or the one file."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (model_path / index).is_file():
            weight_map = json.loads((model_path / index).read_text()).get("weight_map", {})
            return {name: str(model_path / file) for name, file in weight_map.items()}
    files = sorted(model_path.glob("*.safetensors")) or sorted(model_path.glob("*.bin"))
    return {name: str(files[0]) for name in names} if len(files) == 1 else {}


def _targets(model: nn.Module, name: str) -> list[WeightTarget]:
    targets = model._map_weight_name(name)
    if targets is None:
        return []
    return [targets] if isinstance(targets, WeightTarget) else list(targets)


@attrs.define
class Int4Loader:
    """Fills a model's linears from a 4-bit checkpoint (see the module docstring): pass
    :meth:`prepare` and :meth:`read` to :func:`~llmlab.models.loader.load_model`."""

    fmt: Int4Format
    model_path: str
    load_format: str = "auto"
    model: nn.Module | None = None
    linears: dict[str, _CheckpointLinear] = attrs.Factory(dict)
    # W4A16 module name -> its checkpoint parts (prefix, target), and rows filled so far.
    modules: dict[str, list[tuple[str, WeightTarget]]] = attrs.Factory(dict)
    filled: dict[str, int] = attrs.Factory(dict)
    # Module name -> (the checkpoint linear that set its layout, its group size, perm).
    layouts: dict[str, tuple[str, int, torch.Tensor | None]] = attrs.Factory(dict)
    files: dict[str, str] = attrs.Factory(dict)

    def where(self, prefix: str) -> Where:
        return Where(prefix, self.files)

    # -- pass 1: which linears are 4-bit ---------------------------------------------------

    def prepare(self, model: nn.Module) -> None:
        """Swap the linears the checkpoint holds in 4 bits for :class:`W4A16Linear` (on
        the meta device, before the model is materialised)."""
        if not hasattr(model, "_map_weight_name"):
            raise ValueError(
                f"{type(model).__name__} has no checkpoint name map (_map_weight_name): "
                "4-bit checkpoints load into llmlab's built-in architectures"
            )
        self.model = model
        names = [name for name, _ in iterate_weights(self.model_path, lazy=True,
                                                     load_format=self.load_format)]
        self.files = _tensor_files(pathlib.Path(self.model_path), names)
        marker = f".{MARKERS[self.fmt.method]}"
        required, optional = PARTS[self.fmt.method]
        prefixes = {n.removesuffix(marker) for n in names if n.endswith(marker)}
        if not prefixes:
            raise ValueError(
                f"{self.fmt.config_path} declares a 4-bit checkpoint ({self.fmt.describe()}), "
                f"but its weight files hold no 4-bit linear (no *{marker} tensor)"
            )
        suffixes: dict[str, set[str]] = {p: set() for p in prefixes}
        for name in names:
            prefix, _, suffix = name.rpartition(".")
            if prefix in suffixes and suffix in (*required, *optional):
                suffixes[prefix].add(suffix)
        floats = {n.removesuffix(".weight") for n in names if n.endswith(".weight")}
        linears = {id(linear) for _, _, linear in linear_children(model)}
        float_modules: dict[str, str] = {}
        for prefix in sorted(floats - prefixes):
            for target in _targets(model, f"{prefix}.weight"):
                float_modules.setdefault(target.param.removesuffix(".weight"), prefix)
        for prefix in sorted(prefixes):
            self._plan_linear(prefix, frozenset(suffixes[prefix]), required, floats,
                              float_modules, linears)
        for module_name in self.modules:
            parent_name, _, attribute = module_name.rpartition(".")
            parent = model.get_submodule(parent_name)
            linear = getattr(parent, attribute)
            # The checkpoint's group size where it divides this rank's input (else the
            # first part's layout sets it: a row-parallel rank can hold part of a group).
            group = self.fmt.group_size or linear.in_features
            setattr(parent, attribute, W4A16Linear(
                linear.in_features, linear.out_features, linear.bias is not None,
                linear.weight.dtype, linear.weight.device,
                group_size=group if linear.in_features % group == 0 else None,
                source=self.fmt.describe(),
            ))
            self.filled[module_name] = 0

    def _plan_linear(self, prefix: str, suffixes: frozenset[str], required: tuple[str, ...],
                     floats: set[str], float_modules: dict[str, str], linears: set[int]
                     ) -> None:
        """Check one 4-bit checkpoint linear and record which model linears it fills
        (``linears``: ids of those a scheme may quantize; ``float_modules``: model linears
        filled by a float checkpoint tensor, and which)."""
        where, marker = self.where(prefix), MARKERS[self.fmt.method]
        if self.fmt.excludes(prefix):
            field = "ignore" if self.fmt.method == "compressed-tensors" else (
                "modules_to_not_convert")
            raise ValueError(
                f"checkpoint tensor {where.tensor(marker)} is 4-bit, but {prefix} is listed "
                f"in {self.fmt.config_path}'s quantization_config as kept in float ({field})"
            )
        missing = [s for s in required if s not in suffixes]
        if missing:
            raise ValueError(
                f"checkpoint linear {prefix} is 4-bit ({where.tensor(marker)}) but has no "
                f"{', '.join(f'{prefix}.{s}' for s in missing)}"
            )
        if prefix in floats:
            raise ValueError(
                f"checkpoint holds both {prefix}.weight and {where.tensor(marker)}: a "
                "linear is either float or 4-bit"
            )
        targets = _targets(self.model, f"{prefix}.weight")
        self.linears[prefix] = _CheckpointLinear(prefix, suffixes, targets)
        for target in targets:
            module_name = target.param.removesuffix(".weight")
            module = self._module(module_name)
            if not target.param.endswith(".weight") or id(module) not in linears:
                raise ValueError(
                    f"checkpoint tensor {where.tensor(marker)} is 4-bit, but it goes to "
                    f"{target.param}, which llmlab keeps in float (heads and embeddings are "
                    "not quantized)"
                )
            if module_name in float_modules:
                raise ValueError(
                    f"{type(self.model).__name__}.{module_name} fuses "
                    f"{float_modules[module_name]}.weight (float) with {where.tensor(marker)} "
                    "(4-bit): the parts of a fused layer must all be 4-bit or all float"
                )
            self.modules.setdefault(module_name, []).append((prefix, target))

    def _module(self, name: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(name)
        except AttributeError:
            return None

    # -- pass 2: the weights ---------------------------------------------------------------

    def read(self, stream: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The weight stream with the 4-bit linears' tensors taken out (and loaded into
        their layers); raises ``ValueError`` at its end for a layer left unfilled."""
        for name, tensor in stream:
            prefix, _, suffix = name.rpartition(".")
            linear = self.linears.get(prefix)
            if linear is None or (suffix not in linear.suffixes and suffix != "bias"):
                yield name, tensor
                continue
            if suffix == "bias":
                if self._keeps_bias(linear, name, tensor):
                    yield name, tensor
                continue
            linear.parts[suffix] = tensor.read() if isinstance(tensor, LazyTensor) else tensor
            if linear.parts.keys() == linear.suffixes:
                self._load(linear)
        self._check_filled()
        for module_name in self.modules:
            self.model.get_submodule(module_name).finalize()

    def _keeps_bias(self, linear: _CheckpointLinear, name: str, tensor: Any) -> bool:
        """Some GPTQ writers store a bias (of zeros) for layers that have none; vLLM skips
        those too. A non-zero one for a layer without a bias is an error."""
        modules = [self._module(t.param.removesuffix(".weight")) for t in linear.targets]
        if not modules or any(m.bias is not None for m in modules):
            return True
        values = tensor.read() if isinstance(tensor, LazyTensor) else tensor
        if bool(values.ne(0).any()):
            raise ValueError(
                f"checkpoint tensor {self.where(linear.prefix).tensor('bias')} is not zero, "
                f"but {type(self.model).__name__}'s layer for {linear.prefix} has no bias"
            )
        return False

    def _load(self, linear: _CheckpointLinear) -> None:
        where = self.where(linear.prefix)
        tensors = unpack(linear.parts, self.fmt, where)
        linear.parts, linear.loaded = {}, True
        for target in linear.targets:
            module_name = target.param.removesuffix(".weight")
            module: W4A16Linear = self.model.get_submodule(module_name)
            values, scales, zeros, g_idx = (tensors.values, tensors.scales, tensors.zeros,
                                            tensors.g_idx)
            if target.shard is not None:
                dim, start, length = target.shard
                if dim == (1 if target.transpose else 0):  # column-parallel: output rows
                    values = values[start:start + length]
                    scales, zeros = scales[start:start + length], zeros[start:start + length]
                else:  # row-parallel: input channels
                    values, g_idx = values[:, start:start + length], g_idx[start:start + length]
            rows, width = values.shape
            if width != module.in_features or target.row_offset + rows > module.out_features:
                raise ValueError(
                    f"checkpoint tensor {where.tensor(MARKERS[self.fmt.method])} holds "
                    f"[{rows}, {width}] (out, in) for rows {target.row_offset}.. of "
                    f"{module_name} [{module.out_features}, {module.in_features}]; does the "
                    "config match the checkpoint?"
                )
            part = canonical_layout(values, scales, zeros, g_idx)
            self._check_layout(module_name, module, linear.prefix, part)
            module.load_rows(target.row_offset, part)
            self.filled[module_name] += rows

    def _check_layout(self, module_name: str, module: W4A16Linear, prefix: str, part) -> None:
        first = self.layouts.get(module_name)
        if first is None:
            module.set_layout(part.group_size, part.perm)
            self.layouts[module_name] = (prefix, part.group_size, part.perm)
            return
        first_prefix, group_size, perm = first
        same_perm = (perm is None and part.perm is None) or (
            perm is not None and part.perm is not None and torch.equal(perm, part.perm)
        )
        if group_size != part.group_size or not same_perm:
            g_idx = "weight_g_idx" if self.fmt.method == "compressed-tensors" else "g_idx"
            raise ValueError(
                f"checkpoint tensors {self.where(first_prefix).tensor(g_idx)} and "
                f"{self.where(prefix).tensor(g_idx)} order their input channels differently, "
                f"but both feed {module_name} (one fused layer, one input): their act-order "
                "groups must agree"
            )

    def _check_filled(self) -> None:
        unread = [p for p, linear in self.linears.items() if linear.targets and not linear.loaded]
        if unread:
            linear = self.linears[unread[0]]
            missing = sorted(linear.suffixes - linear.parts.keys())
            raise ValueError(
                f"the checkpoint's weight files did not hold all of {len(unread)} 4-bit "
                f"linear(s), e.g. {', '.join(f'{linear.prefix}.{s}' for s in missing)}"
            )
        wrong = [n for n, rows in self.filled.items()
                 if rows != self.model.get_submodule(n).out_features]
        if wrong:
            detail = ", ".join(
                f"{n} ({self.filled[n]}/{self.model.get_submodule(n).out_features} rows)"
                for n in wrong[:8]
            )
            raise ValueError(
                f"checkpoint does not fill {len(wrong)} 4-bit layer(s) exactly once: {detail}"
            )


def load_int4_model(fmt: Int4Format, model_path: str | os.PathLike, hf_config: object,
                    dtype: torch.dtype, device: torch.device, tp=None, *,
                    load_format: str = "auto") -> nn.Module:
    """:func:`~llmlab.models.loader.load_model` for a 4-bit checkpoint in ``fmt``: its
    4-bit linears as :class:`W4A16Linear` (this rank's slices under tensor parallelism),
    everything else as the float loader does it."""
    loader = Int4Loader(fmt, str(model_path), load_format)
    return load_model(model_path, hf_config, dtype, device, tp=tp, prepare=loader.prepare,
                      read_weights=loader.read, load_format=load_format)

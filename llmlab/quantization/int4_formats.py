"""4-bit weight-only checkpoints (W4A16): reading what their ``quantization_config`` says.

Three families of checkpoint store 4-bit integer weights with a float scale and an integer
zero point per group of input channels, ``w = (q - zero) * scale``; they differ in how the
integers are packed into int32 words and in how the zero points are written:

* **GPTQ** (``quant_method: "gptq"``; AutoGPTQ, GPTQModel; Frantar et al., 2022): ``bits``,
  ``group_size`` (-1: one group per output channel), ``sym``, ``desc_act`` (act-order: a
  ``g_idx`` per layer says which group each input channel belongs to), and
  ``checkpoint_format``: ``"gptq"`` (v1, AutoGPTQ's: zero points stored minus one) or
  ``"gptq_v2"`` (GPTQModel's: stored as they are).
* **AWQ** (``quant_method: "awq"``; AutoAWQ; Lin et al., 2023): ``bits``, ``group_size``,
  ``zero_point``, and ``version``: only ``"gemm"`` (its packing; GEMV and the others
  interleave differently).
* **compressed-tensors** ``format: "pack-quantized"`` (llm-compressor's W4A16): one config
  group of ``weights: {num_bits: 4, type: "int", strategy: "group" | "channel",
  symmetric, group_size, actorder}``, no activation quantization.

:func:`int4_format` turns such a config into an :class:`Int4Format`, or refuses it with a
``ValueError`` naming the config file, the field, its value and what is allowed; nothing
here reads a weight. :func:`check_group_sizes` checks the group size against every layer's
input width (from the model built on the meta device) before loading. The tensor layouts
themselves are :mod:`llmlab.quantization.int4_unpack`'s.
"""

from __future__ import annotations

import os
import re
from typing import Any

import attrs

INT4_METHODS = ("gptq", "awq")
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
AWQ_VERSIONS = ("gemm",)
CT_PACKED_FORMAT = "pack-quantized"
CT_STRATEGIES = ("group", "channel")
# compressed-tensors' actorder values: "group" stores a g_idx per layer; "weight" and
# "static" quantize in activation order but keep groups contiguous (no g_idx needed).
CT_ACTORDERS = (None, False, True, "group", "weight", "static", "dynamic")


def config_file(hf_config: Any) -> str:
    """Where a checkpoint's ``config.json`` is (for error messages)."""
    folder = getattr(hf_config, "_name_or_path", None) or ""
    return os.path.join(str(folder), "config.json") if folder else "config.json"


@attrs.frozen
class Int4Format:
    """A 4-bit checkpoint's format, as its ``config.json`` declares it.

    Attributes:
        method: ``"gptq"``, ``"awq"`` or ``"compressed-tensors"``.
        group_size: input channels per scale; None: one group over a layer's whole input
            (per output channel).
        symmetric: zero points are the midpoint (8) rather than stored per group.
        act_order: layers carry a ``g_idx`` (GPTQ ``desc_act``, compressed-tensors
            ``actorder: "group"``), so a group's channels need not be contiguous.
        zero_offset: added to the zero points as stored (GPTQ v1 stores them minus one).
        excluded: modules the config keeps in float (``modules_to_not_convert``,
            compressed-tensors ``ignore``): names, or ``re:`` patterns (compressed-tensors).
        config_path: the ``config.json`` it came from (named in errors).
        group_field: the config field holding the group size (named in errors).
    """

    method: str
    group_size: int | None
    symmetric: bool
    act_order: bool = False
    zero_offset: int = 0
    excluded: tuple[str, ...] = ()
    config_path: str = "config.json"
    group_field: str = "group_size"

    def describe(self) -> str:
        """One line for logs and errors: ``gptq 4-bit, group 128, asymmetric, act-order``."""
        group = f"group {self.group_size}" if self.group_size else "per channel"
        parts = [f"{self.method} 4-bit", group, "symmetric" if self.symmetric else "asymmetric"]
        if self.act_order:
            parts.append("act-order")
        return ", ".join(parts)

    def excludes(self, module: str) -> bool:
        """Whether the config keeps checkpoint module ``module`` (``model.layers.0.mlp.
        down_proj``) in float: an entry equal to it, or to a dotted suffix or prefix of it
        (``lm_head``, ``mlp.gate``), or a compressed-tensors ``re:`` pattern matching it."""
        for entry in self.excluded:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry) or module.startswith(
                entry + "."
            ):
                return True
        return False


def _refuse(path: str, method: str, field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(
        f"{path}: quantization_config (quant_method={method!r}) has {field}={value!r}, "
        f"which llmlab does not support; allowed: {allowed}"
    )


def _names(path: str, method: str, field: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise _refuse(path, method, field, value, "a list of module names")
    return tuple(value)


def _bits(path: str, method: str, field: str, value: Any) -> None:
    if value == 8:
        raise _refuse(
            path, method, field, value,
            "4 (8-bit weights load from compressed-tensors int-quantized, 'int8' or 'fp8' "
            "checkpoints)",
        )
    if value != 4:
        raise _refuse(path, method, field, value, "4 (or 8 in another format)")


def _group_size(path: str, method: str, field: str, value: Any) -> int | None:
    if value == -1:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise _refuse(path, method, field, value,
                      "a positive group size (e.g. 32, 64, 128), or -1 for one per channel")
    return value


def _flag(path: str, method: str, field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _refuse(path, method, field, value, "true or false")
    return value


def _gptq(config: dict, path: str) -> Int4Format:
    method = "gptq"
    _bits(path, method, "bits", config.get("bits"))
    group = _group_size(path, method, "group_size", config.get("group_size", 128))
    sym = _flag(path, method, "sym", config.get("sym", True))
    desc_act = _flag(path, method, "desc_act", config.get("desc_act", False))
    fmt_field = "checkpoint_format" if "checkpoint_format" in config else "format"
    fmt = config.get(fmt_field) or "gptq"
    if fmt not in GPTQ_CHECKPOINT_FORMATS:
        raise _refuse(path, method, fmt_field, fmt, ", ".join(map(repr, GPTQ_CHECKPOINT_FORMATS)))
    if config.get("lm_head"):
        raise _refuse(path, method, "lm_head", config["lm_head"],
                      "false (a quantized lm_head is not supported)")
    if config.get("dynamic"):
        raise _refuse(path, method, "dynamic", config["dynamic"],
                      "empty (per-module overrides are not supported)")
    pack_dtype = config.get("pack_dtype", "int32")
    if str(pack_dtype).removeprefix("torch.") != "int32":
        raise _refuse(path, method, "pack_dtype", pack_dtype, "'int32'")
    return Int4Format(
        method, group, sym, act_order=desc_act, zero_offset=1 if fmt == "gptq" else 0,
        excluded=_names(path, method, "modules_to_not_convert",
                        config.get("modules_to_not_convert")),
        config_path=path,
    )


def _awq(config: dict, path: str) -> Int4Format:
    method = "awq"
    bits_field = "bits" if "bits" in config or "w_bit" not in config else "w_bit"
    _bits(path, method, bits_field, config.get(bits_field))
    group_field = "group_size" if "group_size" in config or "q_group_size" not in config else (
        "q_group_size")
    group = _group_size(path, method, group_field, config.get(group_field, 128))
    version = config.get("version", "gemm")
    if str(version).lower() not in AWQ_VERSIONS:
        raise _refuse(path, method, "version", version,
                      "'gemm' (GEMV, GEMV-fast, exllama, ipex and marlin pack differently)")
    backend = config.get("backend", "autoawq")
    if backend not in (None, "autoawq"):
        raise _refuse(path, method, "backend", backend, "'autoawq'")
    # zero_point false: AutoAWQ's GEMM layout still stores qzeros, read as they are (vLLM
    # reads them the same way).
    zero_point = _flag(path, method, "zero_point", config.get("zero_point", True))
    return Int4Format(
        method, group, symmetric=not zero_point,
        excluded=_names(path, method, "modules_to_not_convert",
                        config.get("modules_to_not_convert")),
        config_path=path, group_field=group_field,
    )


def _compressed(config: dict, path: str) -> Int4Format | None:
    """None where the config is not 4-bit (an 8-bit one, read by ``checkpoint.py``)."""
    method = "compressed-tensors"
    groups = config.get("config_groups") or {}
    weights = [(name, (group or {}).get("weights") or {}) for name, group in groups.items()]
    for name, w in weights:
        if w and w.get("num_bits") not in (4, 8):
            raise _refuse(path, method, f"config_groups.{name}.weights.num_bits",
                          w.get("num_bits"), "4 (pack-quantized) or 8")
    if not any(w.get("num_bits") == 4 for _, w in weights):
        return None
    if len(groups) != 1:
        raise _refuse(path, method, "config_groups", sorted(groups),
                      "one config group (llmlab takes one scheme for every layer)")
    name, weights = weights[0]
    group = groups[name]
    where = f"config_groups.{name}"
    fmt_field = f"{where}.format" if group.get("format") else "format"
    fmt = group.get("format") or config.get("format")
    if fmt != CT_PACKED_FORMAT:
        raise _refuse(path, method, fmt_field, fmt,
                      f"{CT_PACKED_FORMAT!r} for 4-bit weights")
    if weights.get("type") != "int":
        raise _refuse(path, method, f"{where}.weights.type", weights.get("type"), "'int'")
    strategy = weights.get("strategy")
    if strategy not in CT_STRATEGIES:
        raise _refuse(path, method, f"{where}.weights.strategy", strategy,
                      ", ".join(map(repr, CT_STRATEGIES)))
    group_size = None
    if strategy == "group":
        group_size = _group_size(path, method, f"{where}.weights.group_size",
                                 weights.get("group_size"))
        if group_size is None:
            raise _refuse(path, method, f"{where}.weights.group_size", -1,
                          "a positive group size with strategy 'group'")
    if weights.get("dynamic"):
        raise _refuse(path, method, f"{where}.weights.dynamic", weights["dynamic"], "false")
    if weights.get("block_structure"):
        raise _refuse(path, method, f"{where}.weights.block_structure",
                      weights["block_structure"], "null")
    actorder = weights.get("actorder")
    if actorder not in CT_ACTORDERS:
        raise _refuse(path, method, f"{where}.weights.actorder", actorder,
                      ", ".join(map(repr, CT_ACTORDERS)))
    if group.get("input_activations"):
        raise _refuse(path, method, f"{where}.input_activations",
                      group["input_activations"], "null (weight-only W4A16)")
    symmetric = _flag(path, method, f"{where}.weights.symmetric",
                      weights.get("symmetric", True))
    return Int4Format(
        method, group_size, symmetric, act_order=actorder in (True, "group"),
        excluded=_names(path, method, "ignore", config.get("ignore")), config_path=path,
        group_field=f"{where}.weights.group_size",
    )


def int4_format(config: dict, path: str = "config.json") -> Int4Format | None:
    """The :class:`Int4Format` a ``quantization_config`` declares; None when it is not a
    4-bit one this module reads (an 8-bit compressed-tensors, ``int8`` or ``fp8`` config:
    :mod:`llmlab.quantization.checkpoint` reads those). Raises ``ValueError`` naming
    ``path``, the field, its value and what is allowed for a GPTQ or AWQ config llmlab
    cannot load, and for a 4-bit compressed-tensors one."""
    method = config.get("quant_method")
    if method == "gptq":
        return _gptq(config, path)
    if method == "awq":
        return _awq(config, path)
    if method == "compressed-tensors":
        return _compressed(config, path)
    return None


def check_group_sizes(fmt: Int4Format, hf_config: Any) -> None:
    """Every quantizable linear's input width must be a multiple of ``fmt.group_size``
    (and even: two 4-bit values per byte). The widths come from the model built on the
    meta device (one rank's full sizes), so nothing is read; raises ``ValueError`` naming
    the config file, ``group_size``, the layer and its width."""
    import torch

    from llmlab.models.loader import build_model_class
    from llmlab.models.registry import get_model_class
    from llmlab.quantization.base import linear_children

    with torch.device("meta"):
        model = build_model_class(get_model_class(hf_config.architectures), hf_config)
    names = {id(module): name for name, module in model.named_modules()}
    for _, _, linear in linear_children(model):
        width = linear.in_features
        group = fmt.group_size or width
        if width % group or width % 2:
            raise ValueError(
                f"{fmt.config_path}: quantization_config {fmt.group_field}={fmt.group_size} "
                f"does not divide the input width {width} of layer {names[id(linear)]} (from "
                "the model config's sizes); allowed: a group size dividing every layer's "
                "input width (an even one)"
            )

"""Quantized checkpoints: reading their ``quantization_config``, filtering their tensors on
the way into a model, and writing one from a float checkpoint (:func:`save_quantized`).

The layout is compressed-tensors' (what llm-compressor writes and vLLM loads): each
quantized linear keeps its Hugging Face name, ``X.weight`` holds int8 or float8 e4m3
values, ``X.weight_scale`` the float32 scales (``[out, 1]`` per channel, or one per tensor),
and ``config.json`` carries ``quantization_config`` with ``quant_method:
"compressed-tensors"``. Read as well: vLLM's own ``quant_method: "fp8"`` (per-tensor scales,
e.g. Neural Magic's ``*-FP8`` checkpoints) and ``"int8"``. Static activation scales
(``input_scale``) are dropped: llmlab quantizes activations dynamically (fp8) or not at all
(int8). Block-wise fp8 and grouped or asymmetric 8-bit formats are refused by name.

4-bit checkpoints (``quant_method`` ``"gptq"`` / ``"awq"``, compressed-tensors
``pack-quantized``) are scheme ``"w4a16"``; their formats are
:mod:`llmlab.quantization.int4_formats`'s.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import torch

from llmlab.models.weights import SCALE_SUFFIX, LazyTensor
from llmlab.quantization.int4_formats import Int4Format, config_file, int4_format

# Tensors of a quantized checkpoint llmlab does not use: static activation and KV scales.
IGNORED_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale")
ZERO_POINT_SUFFIX = ".weight_zero_point"
_CT_TYPES = {"int": "int8", "float": "fp8"}
_CT_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")


def _unsupported(detail: str, path: str = "config.json") -> ValueError:
    return ValueError(
        f"{path}: the checkpoint's quantization_config is not supported: {detail}; llmlab "
        "loads 4-bit weights (quant_method 'gptq', 'awq', or 'compressed-tensors' "
        "pack-quantized) and 8-bit weights per channel or per tensor (quant_method "
        "'compressed-tensors' int-/float-quantized, 'fp8' or 'int8')"
    )


def _quantization_config(hf_config: Any) -> dict | None:
    config = getattr(hf_config, "quantization_config", None)
    if config is None or isinstance(config, dict):
        return config
    return config.to_dict() if hasattr(config, "to_dict") else vars(config)


def checkpoint_int4_format(hf_config: Any) -> Int4Format | None:
    """The 4-bit format a checkpoint's ``quantization_config`` declares (None: not a
    4-bit checkpoint); raises ``ValueError`` as :func:`checkpoint_scheme` does."""
    config = _quantization_config(hf_config)
    return None if config is None else int4_format(config, config_file(hf_config))


def checkpoint_scheme(hf_config: Any) -> str | None:
    """The scheme (``"int8"`` / ``"fp8"`` / ``"w4a16"``) a checkpoint's
    ``quantization_config`` says its weights are in; None for a float checkpoint. Raises
    ``ValueError`` naming the config file and what is not supported (an unknown
    ``quant_method``, a block-wise fp8, bits other than 4 or 8, a 4-bit format other than
    GPTQ, AWQ GEMM or compressed-tensors pack-quantized, ...)."""
    config = _quantization_config(hf_config)
    if config is None:
        return None
    path = config_file(hf_config)
    if int4_format(config, path) is not None:
        return "w4a16"
    method = config.get("quant_method")
    if method in ("int8", "fp8"):
        block = config.get("weight_block_size")
        if block:
            raise _unsupported(f"quant_method={method!r} with weight_block_size={block}", path)
        return method
    if method != "compressed-tensors":
        raise _unsupported(
            f"quant_method={method!r} (allowed: 'gptq', 'awq', 'compressed-tensors', 'fp8', "
            "'int8')", path,
        )
    fmt = config.get("format")
    if fmt not in (*_CT_FORMATS, None):
        raise _unsupported(f"compressed-tensors format={fmt!r}", path)
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise _unsupported(
            f"{len(groups)} compressed-tensors config_groups (llmlab takes one)", path)
    weights = next(iter(groups.values())).get("weights") or {}
    kind = _CT_TYPES.get(weights.get("type"))
    strategy = weights.get("strategy")
    if (
        weights.get("num_bits") != 8 or kind is None or weights.get("symmetric") is False
        or strategy not in ("channel", "tensor")
    ):
        raise _unsupported(
            f"weights num_bits={weights.get('num_bits')!r} type={weights.get('type')!r} "
            f"symmetric={weights.get('symmetric')!r} strategy={strategy!r} (8-bit: "
            "symmetric int or float per channel or tensor; 4-bit: pack-quantized int)", path,
        )
    return kind


def quantization_config(scheme: str) -> dict:
    """The ``quantization_config`` :func:`save_quantized` writes: compressed-tensors, one
    group over every Linear but the head, 8-bit symmetric per-channel weights; fp8 with
    dynamic per-token fp8 activations (llm-compressor's FP8_DYNAMIC), int8 weight-only
    (W8A16)."""
    activations = None
    if scheme == "fp8":
        activations = {"num_bits": 8, "type": "float", "symmetric": True,
                       "strategy": "token", "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if scheme == "int8" else "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int" if scheme == "int8" else "float",
                        "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": activations,
        }},
        "ignore": ["lm_head"],
        "producer": "llmlab",
    }


def _read(tensor: torch.Tensor | LazyTensor) -> torch.Tensor:
    return tensor.read() if isinstance(tensor, LazyTensor) else tensor


def checkpoint_weights(
    stream: Iterator[tuple[str, Any]], model_path: str | os.PathLike
) -> Iterator[tuple[str, Any]]:
    """A quantized checkpoint's ``(name, tensor)`` stream as the models' weight maps take
    it: every ``weight_scale`` a float32 vector of output channels (a per-tensor scale
    spread over its weight's rows, whose count comes from the checkpoint's header); static
    activation scales dropped; zero points checked to be zero (symmetric)."""
    shapes: dict[str, tuple[int, ...]] | None = None
    for name, tensor in stream:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name.endswith(ZERO_POINT_SUFFIX):
            if bool(_read(tensor).ne(0).any()):
                raise _unsupported(f"{name} is not zero (asymmetric quantization)")
            continue
        if not name.endswith(SCALE_SUFFIX):
            yield name, tensor
            continue
        scale = _read(tensor).float()
        if scale.numel() == 1:
            if shapes is None:
                # safetensors: headers only (the lazy handles read nothing).
                from llmlab.models.loader import iterate_weights

                shapes = {n: tuple(t.shape) for n, t in iterate_weights(model_path, lazy=True)}
            weight_shape = shapes.get(name.removesuffix("_scale"))
            if weight_shape is None:
                raise ValueError(f"{name} has no {name.removesuffix('_scale')!r} beside it")
            scale = scale.reshape(()).expand(weight_shape[0]).contiguous()
        yield name, scale.reshape(-1)


def _linear_params(model: torch.nn.Module) -> set[str]:
    """Names of the parameters a scheme quantizes (``...qkv_proj.weight``, ...)."""
    from llmlab.quantization.base import linear_children

    names = {id(linear): None for _, _, linear in linear_children(model)}
    return {
        f"{module_name}.weight" for module_name, module in model.named_modules()
        if id(module) in names
    }


def save_quantized(
    model_dir: str | os.PathLike, out_dir: str | os.PathLike, scheme: str
) -> pathlib.Path:
    """Write ``model_dir`` (a float Hugging Face checkpoint of a supported architecture)
    to ``out_dir`` with its linear layers quantized in ``scheme`` (``"int8"`` or
    ``"fp8"``), per output channel, exactly as loading it with ``quantization=scheme``
    would; embeddings, norms and the head stay as they were. Everything else in the folder
    (tokenizer, generation config) is copied; ``config.json`` gains the
    ``quantization_config`` (:func:`quantization_config`). ``LLM(out_dir)`` then runs the
    scheme without re-quantizing. Returns ``out_dir``."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from llmlab.models.loader import build_model_class, iterate_weights
    from llmlab.models.registry import get_model_class
    from llmlab.quantization.fp8 import quantize_fp8
    from llmlab.quantization.int8 import quantize_int8

    quantize = {"int8": quantize_int8, "fp8": quantize_fp8}.get(scheme)
    if quantize is None:
        raise ValueError(f"scheme must be one of 'int8', 'fp8', got {scheme!r}")
    source, out = pathlib.Path(model_dir), pathlib.Path(out_dir)
    if source.resolve() == out.resolve():
        raise ValueError("out_dir must differ from model_dir (the float weights are read)")
    hf_config = AutoConfig.from_pretrained(source)
    if checkpoint_scheme(hf_config) is not None:
        raise ValueError(f"{source} is already quantized; save_quantized takes a float one")
    with torch.device("meta"):
        model = build_model_class(get_model_class(hf_config.architectures), hf_config)
    map_name = getattr(model, "_map_weight_name", None)
    if map_name is None:
        raise ValueError(
            f"{type(model).__name__} has no checkpoint name map (_map_weight_name); "
            "save_quantized supports llmlab's built-in architectures"
        )
    quantized = _linear_params(model)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iterate_weights(source):
        targets = map_name(name)
        targets = [targets] if not isinstance(targets, list) else targets
        if targets and all(t is not None and t.param in quantized for t in targets):
            # A Conv1D checkpoint (GPT-2) stores [in, out]: its output channels are dim 1.
            q, scale = quantize(tensor, dim=1 if targets[0].transpose else 0)
            tensors[name] = q.contiguous()
            tensors[name + "_scale"] = scale.reshape(-1, 1).contiguous()
        else:
            tensors[name] = tensor.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and not item.name.endswith((".safetensors", ".bin")) and (
            item.name != "model.safetensors.index.json"
        ):
            shutil.copy2(item, out / item.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out

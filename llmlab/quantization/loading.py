"""Deciding the scheme before any weight loads, and loading a model in it.

:func:`resolve_quantization` runs in the engine builder's plan (nothing loaded yet): it
reads the checkpoint's ``quantization_config``, reconciles it with the ``quantization``
argument and the device, and raises ``ValueError`` naming what cannot run. The
:class:`QuantizationSpec` it returns is plain and picklable, so every tensor-parallel rank
loads its shard the same way: a float checkpoint is loaded, then each rank quantizes its
own shard (per-channel scales are computed from the rows it holds); a quantized checkpoint
fills quantized modules directly, each rank reading its slices of the weights and scales.
"""

from __future__ import annotations

import os

import attrs
import torch
from torch import nn

from llmlab.models.loader import load_model
from llmlab.quantization.base import (
    QuantizedLinear,
    empty_quantized_linears,
    finalize_quantized,
    quantize_linears,
)
from llmlab.quantization.checkpoint import checkpoint_scheme, checkpoint_weights
from llmlab.quantization.fp8 import Fp8Linear
from llmlab.quantization.int8 import Int8Linear

# Scheme name -> its quantized linear; the names are EngineConfig's quantization values.
SCHEMES: dict[str, type[QuantizedLinear]] = {"int8": Int8Linear, "fp8": Fp8Linear}
# Device types each scheme runs on.
SCHEME_DEVICES = {"int8": ("cpu", "cuda"), "fp8": ("cuda",)}


@attrs.frozen
class QuantizationSpec:
    """How the model's linears are quantized: ``scheme`` (``"int8"`` / ``"fp8"``), and
    whether the checkpoint already holds them in it (``prequantized``: loaded as it is)."""

    scheme: str
    prequantized: bool = False

    @property
    def linear_class(self) -> type[QuantizedLinear]:
        return SCHEMES[self.scheme]

    def load_model(
        self,
        model_path: str | os.PathLike,
        hf_config: object,
        dtype: torch.dtype,
        device: torch.device,
        tp=None,
        *,
        load_format: str = "auto",
    ) -> nn.Module:
        """:func:`llmlab.models.loader.load_model` with the linears in this scheme.

        ``load_format="dummy"`` quantizes random float weights; a checkpoint saved
        quantized cannot be drawn at random (its weights and scales are the checkpoint's),
        so it is refused with ``ValueError``."""
        cls = self.linear_class
        if not self.prequantized:
            model = load_model(model_path, hf_config, dtype, device, tp=tp,
                               load_format=load_format)
            quantize_linears(model, cls)
            return model
        if load_format == "dummy":
            raise ValueError(
                f"load_format='dummy' is not supported for a checkpoint saved quantized "
                f"({self.scheme!r}, its config.json quantization_config): its weights and "
                "scales come from its files; use load_format 'auto', 'safetensors' or 'pt', "
                "or the float checkpoint with quantization set"
            )
        model = load_model(
            model_path, hf_config, dtype, device, tp=tp,
            prepare=lambda meta_model: empty_quantized_linears(meta_model, cls),
            read_weights=lambda stream: checkpoint_weights(stream, model_path),
            load_format=load_format,
        )
        finalize_quantized(model)
        return model


def resolve_quantization(
    quantization: str | None, hf_config: object, device: torch.device
) -> QuantizationSpec | None:
    """The scheme to run, from the ``quantization`` argument and the checkpoint: None for a
    float model run in float. A quantized checkpoint runs in its own scheme when the
    argument is None (as vLLM does). Raises ``ValueError`` naming the values for a scheme
    llmlab does not have, a checkpoint that disagrees with the argument, or a device the
    scheme cannot run on; reads no weights."""
    if quantization is not None and quantization not in SCHEMES:
        raise ValueError(
            f"quantization must be one of {', '.join(map(repr, SCHEMES))} or None, "
            f"got {quantization!r}"
        )
    saved = checkpoint_scheme(hf_config)
    if quantization is not None and saved is not None and quantization != saved:
        raise ValueError(
            f"quantization={quantization!r} does not match the checkpoint, which is "
            f"quantized as {saved!r} (its config.json quantization_config); pass "
            f"quantization={saved!r} or None, or use the float checkpoint"
        )
    scheme = quantization or saved
    if scheme is None:
        return None
    if device.type not in SCHEME_DEVICES[scheme]:
        allowed = [name for name, devices in SCHEME_DEVICES.items() if device.type in devices]
        raise ValueError(
            f"quantization={scheme!r} is not supported on device {device.type!r}: it runs on "
            f"{' and '.join(SCHEME_DEVICES[scheme])}"
            + (f" (on {device.type}: {', '.join(map(repr, allowed))})" if allowed else "")
        )
    return QuantizationSpec(scheme, prequantized=saved is not None)

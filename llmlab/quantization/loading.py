"""Deciding the scheme before any weight loads, and loading a model in it.

:func:`resolve_quantization` runs in the engine builder's plan (nothing loaded yet): it
reads the checkpoint's ``quantization_config``, reconciles it with the ``quantization``
argument and the device, and raises ``ValueError`` naming what cannot run. The
:class:`QuantizationSpec` it returns is plain and picklable, so every tensor-parallel rank
loads its shard the same way: a float checkpoint is loaded, then each rank quantizes its
own shard (per-channel scales are computed from the rows it holds); a quantized checkpoint
fills quantized modules directly, each rank reading its slices of the weights and scales.
A 4-bit checkpoint (scheme ``"w4a16"``: GPTQ, AWQ, compressed-tensors pack-quantized)
loads through :mod:`llmlab.quantization.int4_loading`; it cannot be produced at load time
(``quantization=`` names only the 8-bit schemes), and its group size is checked against
every layer's width here, before loading. Each quantized load logs the weights' memory
(:func:`llmlab.quantization.memory.weight_memory`).
"""

from __future__ import annotations

import logging
import os

import attrs
import torch
from torch import nn

from llmlab.config import CHECKPOINT_QUANTIZATION
from llmlab.models.loader import load_model
from llmlab.quantization.base import (
    QuantizedLinear,
    empty_quantized_linears,
    finalize_quantized,
    quantize_linears,
)
from llmlab.quantization.checkpoint import (
    checkpoint_int4_format,
    checkpoint_scheme,
    checkpoint_weights,
)
from llmlab.quantization.fp8 import Fp8Linear
from llmlab.quantization.int4_formats import Int4Format, check_group_sizes
from llmlab.quantization.int4_loading import load_int4_model
from llmlab.quantization.int8 import Int8Linear
from llmlab.quantization.memory import weight_memory

logger = logging.getLogger(__name__)

# Scheme name -> its quantized linear; the names are EngineConfig's quantization values.
SCHEMES: dict[str, type[QuantizedLinear]] = {"int8": Int8Linear, "fp8": Fp8Linear}
# Device types each scheme runs on ("w4a16": 4-bit checkpoints, never made at load time).
SCHEME_DEVICES = {"int8": ("cpu", "cuda"), "fp8": ("cuda",), "w4a16": ("cpu", "cuda")}


@attrs.frozen
class QuantizationSpec:
    """How the model's linears are quantized: ``scheme`` (``"int8"`` / ``"fp8"`` /
    ``"w4a16"``), whether the checkpoint already holds them in it (``prequantized``:
    loaded as it is), and for a 4-bit checkpoint its format (``int4``)."""

    scheme: str
    prequantized: bool = False
    int4: Int4Format | None = None

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
        if self.prequantized and load_format == "dummy":
            raise ValueError(
                f"load_format='dummy' is not supported for a checkpoint saved quantized "
                f"({self.scheme!r}, its config.json quantization_config): its weights and "
                "scales come from its files; use load_format 'auto', 'safetensors' or 'pt', "
                "or the float checkpoint with quantization set"
            )
        if self.int4 is not None:
            model = load_int4_model(self.int4, model_path, hf_config, dtype, device, tp=tp,
                                    load_format=load_format)
        elif not self.prequantized:
            model = load_model(model_path, hf_config, dtype, device, tp=tp,
                               load_format=load_format)
            quantize_linears(model, self.linear_class)
        else:
            cls = self.linear_class
            model = load_model(
                model_path, hf_config, dtype, device, tp=tp,
                prepare=lambda meta_model: empty_quantized_linears(meta_model, cls),
                read_weights=lambda stream: checkpoint_weights(stream, model_path),
                load_format=load_format,
            )
            finalize_quantized(model)
        logger.info("%s (%s)", weight_memory(model).describe(),
                    self.int4.describe() if self.int4 is not None else self.scheme)
        return model


def _saved_method(hf_config: object) -> str | None:
    """The ``quant_method`` a checkpoint's ``quantization_config`` declares (None: none)."""
    config = getattr(hf_config, "quantization_config", None)
    if config is not None and not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    return None if config is None else config.get("quant_method")


def resolve_quantization(
    quantization: str | None, hf_config: object, device: torch.device
) -> QuantizationSpec | None:
    """The scheme to run, from the ``quantization`` argument and the checkpoint: None for a
    float model run in float. A quantized checkpoint runs in its own scheme when the
    argument is None (as vLLM does). Raises ``ValueError`` naming the values for a scheme
    llmlab does not have, a checkpoint that disagrees with the argument, or a device the
    scheme cannot run on; reads no weights."""
    if quantization in CHECKPOINT_QUANTIZATION:  # a format's name: the checkpoint's own
        method = _saved_method(hf_config)
        if quantization.removesuffix("_marlin") != method:
            raise ValueError(
                f"quantization={quantization!r} names a checkpoint format, but this "
                f"checkpoint's config.json quantization_config has quant_method={method!r}; "
                "pass quantization=None to load it as it is saved"
            )
        quantization = None
    if quantization is not None and quantization not in SCHEMES:
        raise ValueError(
            f"quantization must be one of {', '.join(map(repr, SCHEMES))}, a checkpoint "
            f"format ({', '.join(map(repr, CHECKPOINT_QUANTIZATION))}) or None, "
            f"got {quantization!r}"
        )
    saved = checkpoint_scheme(hf_config)
    int4 = checkpoint_int4_format(hf_config) if saved == "w4a16" else None
    if quantization is not None and saved is not None and quantization != saved:
        what = repr(saved) if int4 is None else f"{int4.describe()} ('w4a16')"
        fix = f"quantization={saved!r} or None" if int4 is None else "quantization=None"
        raise ValueError(
            f"quantization={quantization!r} does not match the checkpoint, which is "
            f"quantized as {what} (its config.json quantization_config); pass {fix}, or "
            "use the float checkpoint"
        )
    scheme = quantization or saved
    if scheme is None:
        return None
    if device.type not in SCHEME_DEVICES[scheme]:
        allowed = [name for name in SCHEMES if device.type in SCHEME_DEVICES[name]]
        raise ValueError(
            f"quantization={scheme!r} is not supported on device {device.type!r}: it runs on "
            f"{' and '.join(SCHEME_DEVICES[scheme])}"
            + (f" (on {device.type}: {', '.join(map(repr, allowed))})" if allowed else "")
        )
    if int4 is not None:
        check_group_sizes(int4, hf_config)
    return QuantizationSpec(scheme, prequantized=saved is not None, int4=int4)

"""Loading a PEFT LoRA adapter and checking it against the served model.

A PEFT adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``, ...) and ``adapter_model.safetensors`` with, per
targeted module, ``lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]``. The
update to a module's output is ``scale * x A^T B^T`` with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``; Hu et al., 2021; Kalajdzievski, 2023).

Everything that could make the adapter unusable is refused here, with a ``ValueError``
naming the field, before the request reaches a step: a rank above ``max_lora_rank``,
modules llmlab cannot apply, shapes that do not fit the served model, options it does not
implement (DoRA, biases, ``modules_to_save``, per-module ranks), unreadable files.
"""

from __future__ import annotations

import json
import math
import pathlib

import attrs
import torch

from llmlab.lora.request import LoRARequest
from llmlab.lora.targets import SUPPORTED_TARGETS, LoRATargets

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@attrs.frozen(eq=False)
class LoRAAdapter:
    """An adapter loaded in host memory, checked against the model.

    Attributes:
        request: the request it was loaded for (its id keys caches).
        rank: ``r``.
        scale: ``lora_alpha / r`` (or ``/ sqrt(r)``); already folded into the B matrices.
        weights: per target path, per slice of that module, ``(A [r, in], scale * B
            [out_slice, r])`` or None where the adapter leaves the slice alone.
    """

    request: LoRARequest
    rank: int
    scale: float
    weights: dict[str, tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]]

    @property
    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for slices in self.weights.values() for pair in slices if pair is not None
            for a, b in (pair,)
        )


def load_adapter(
    request: LoRARequest,
    targets: LoRATargets,
    *,
    max_lora_rank: int,
    dtype: torch.dtype,
    base_model_names: frozenset[str] = frozenset(),
) -> LoRAAdapter:
    """Read and check the adapter ``request`` names. Raises ``ValueError`` naming the
    field (``lora_path``, ``r``/``max_lora_rank``, ``target_modules``,
    ``base_model_name``, ...) for anything the served model cannot run."""
    if not isinstance(request, LoRARequest):
        raise TypeError(
            f"lora_request must be a LoRARequest or None, got {type(request).__name__}"
        )
    if request.base_model_name is not None and base_model_names and (
        request.base_model_name not in base_model_names
    ):
        raise ValueError(
            f"base_model_name={request.base_model_name!r} of LoRA adapter "
            f"{request.lora_name!r} is not the served model (one of "
            f"{sorted(base_model_names)})"
        )
    if not request.lora_path:
        raise ValueError(f"lora_path of LoRA adapter {request.lora_name!r} is empty")
    root = pathlib.Path(request.lora_path)
    config = _read_config(request, root / CONFIG_FILE)
    rank, scale = _rank_and_scale(request, config, max_lora_rank)
    tensors = _read_tensors(request, root / WEIGHTS_FILE)
    weights = _place(request, tensors, targets, rank, scale, dtype)
    return LoRAAdapter(request, rank, scale, weights)


def _where(request: LoRARequest) -> str:
    return f"LoRA adapter {request.lora_name!r} (lora_path={request.lora_path!r})"


def _read_config(request: LoRARequest, path: pathlib.Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(
            f"{_where(request)}: no {CONFIG_FILE} there (lora_path must be a PEFT adapter "
            "directory)"
        ) from None
    except OSError as err:
        raise ValueError(f"{_where(request)}: cannot read {CONFIG_FILE}: {err}") from None
    try:
        config = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{_where(request)}: {CONFIG_FILE} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{_where(request)}: {CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{_where(request)}: peft_type={peft_type!r}; only 'LORA' is supported")
    refused = {
        "use_dora": "DoRA is not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) is not supported",
        "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "layer_replication": "layer_replication is not supported",
    }
    for field, why in refused.items():
        if config.get(field):
            raise ValueError(f"{_where(request)}: {field}={config[field]!r}: {why}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise ValueError(f"{_where(request)}: bias={bias!r}; only 'none' is supported")
    wanted = config.get("target_modules")
    if isinstance(wanted, (list, tuple)):
        unknown = sorted(set(map(str, wanted)) - set(SUPPORTED_TARGETS))
        if unknown:
            raise ValueError(
                f"{_where(request)}: target_modules {unknown} cannot be applied; supported: "
                f"{', '.join(SUPPORTED_TARGETS)}"
            )
    return config


def _rank_and_scale(request: LoRARequest, config: dict, max_lora_rank: int) -> tuple[int, float]:
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{_where(request)}: r={rank!r} in {CONFIG_FILE} must be an int >= 1")
    if rank > max_lora_rank:
        raise ValueError(
            f"{_where(request)}: rank r={rank} is more than max_lora_rank={max_lora_rank} "
            "(an engine setting: LLM(max_lora_rank=...), --max-lora-rank)"
        )
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{_where(request)}: lora_alpha={alpha!r} must be a number")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _read_tensors(request: LoRARequest, path: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise ValueError(
            f"{_where(request)}: no {WEIGHTS_FILE} there (llmlab reads safetensors adapters)"
        )
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"{_where(request)}: {WEIGHTS_FILE} is unreadable: {err}") from None


def _peft_module(key: str) -> tuple[str, str]:
    """``("layers.0.self_attn.q_proj", "lora_A")`` from PEFT's tensor name."""
    name = key
    for prefix in ("base_model.model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    module, _, leaf = name.rpartition(".")  # leaf: "weight" (or an adapter-named one)
    module, _, kind = module.rpartition(".")
    if leaf != "weight" or kind not in ("lora_A", "lora_B"):
        return name, ""
    return module, kind


def _place(request, tensors, targets: LoRATargets, rank, scale, dtype):
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, kind = _peft_module(key)
        if not kind or module not in targets.by_peft_name:
            leaf = module.rsplit(".", 1)[-1]
            if kind and leaf in SUPPORTED_TARGETS:
                raise ValueError(
                    f"{_where(request)}: tensor {key!r} names {module!r}, which the served "
                    f"model does not have ({targets.num_layers} layers): a base-model "
                    "mismatch (base_model_name)"
                )
            raise ValueError(
                f"{_where(request)}: tensor {key!r} targets a module llmlab cannot apply "
                f"(target_modules; supported: {', '.join(SUPPORTED_TARGETS)})"
            )
        found.setdefault(module, {})[kind] = tensor
    weights: dict[str, list] = {}
    for module, pair in found.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{_where(request)}: {module!r} has lora_A or lora_B, not both")
        target, j = targets.by_peft_name[module]
        a, b = pair["lora_A"], pair["lora_B"]
        _, _, out = target.slices[j]
        if tuple(a.shape) != (rank, target.in_features) or tuple(b.shape) != (out, rank):
            raise ValueError(
                f"{_where(request)}: {module!r} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, but the served model needs ({rank}, "
                f"{target.in_features}) and ({out}, {rank}) for r={rank}: the adapter was "
                "trained for another base model (base-model mismatch)"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"{_where(request)}: {module!r} has non-finite weights")
        slices = weights.setdefault(target.path, [None] * len(target.slices))
        slices[j] = (
            a.to(dtype).contiguous(),
            (b.float() * scale).to(dtype).contiguous(),
        )
    if not weights:
        raise ValueError(f"{_where(request)}: {WEIGHTS_FILE} holds no LoRA weights")
    return {path: tuple(slices) for path, slices in weights.items()}

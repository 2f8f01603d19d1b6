"""Loading a PEFT LoRA adapter and checking it against the served model.

A PEFT adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``, ...) and ``adapter_model.safetensors`` with, per
targeted module, ``lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]``. The
update to a module's output is ``scale * x A^T B^T`` with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``; Hu et al., 2021; Kalajdzievski, 2023).

Everything that could make the adapter unusable is refused here, with a ``ValueError``
naming the field, before the request reaches a step: a rank above ``max_lora_rank``,
modules llmlab cannot apply, shapes that do not fit the served model, options it does not
implement (DoRA, biases, ``modules_to_save``, per-module ranks), unreadable files, and
numbers that would overflow in a step (:mod:`llmlab.lora.bounds`: the scale, and each
module's update against its base weight).

The files are read as untrusted input (a server loads whatever path a client names): each
must be a regular file (checked with ``os.stat`` before opening, and again on the open
descriptor, which is opened with ``O_NONBLOCK``: a FIFO or device swapped in cannot block
the load), no larger than a cap (:data:`MAX_CONFIG_BYTES`; :func:`max_weights_bytes`).
Whatever is wrong with the path itself (missing, a file, no config, a FIFO, no
permission) is one :class:`AdapterNotFoundError` with one message, which tells nothing
about what exists on the server's filesystem.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping, Sequence

import attrs
import torch

from llmlab.lora.bounds import MAX_LORA_SCALE, MAX_UPDATE_RATIO, update_norm
from llmlab.lora.request import LoRARequest
from llmlab.lora.targets import SUPPORTED_TARGETS, LoRATargets

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# A PEFT config is about a kilobyte; a mebibyte leaves room for long target lists.
MAX_CONFIG_BYTES = 1 << 20
# Room in the weights file for its JSON header (about 150 bytes per tensor).
WEIGHTS_HEADER_BYTES = 1 << 20


class AdapterNotFoundError(ValueError):
    """``lora_path`` is not a readable PEFT adapter directory (the server's 404)."""


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


def max_weights_bytes(targets: LoRATargets, max_lora_rank: int) -> int:
    """The largest ``adapter_model.safetensors`` read: every module the model can adapt, at
    ``max_lora_rank``, in 8-byte floats, plus :data:`WEIGHTS_HEADER_BYTES`. Any adapter
    the model can run fits (most are 2 or 4 bytes a weight, on fewer modules)."""
    weights = sum(
        max_lora_rank * (target.in_features + size)
        for target in targets.targets for _, _, size in target.slices
    )
    return 8 * weights + WEIGHTS_HEADER_BYTES


def load_adapter(
    request: LoRARequest,
    targets: LoRATargets,
    *,
    max_lora_rank: int,
    dtype: torch.dtype,
    base_model_names: frozenset[str] = frozenset(),
    base_norms: Mapping[str, Sequence[float]] | None = None,
) -> LoRAAdapter:
    """Read and check the adapter ``request`` names. Raises ``ValueError`` naming the
    field (``lora_path``, ``r``/``max_lora_rank``, ``lora_alpha``, ``target_modules``,
    ``base_model_name``, a module's weights, ...) for anything the served model cannot
    run; :class:`AdapterNotFoundError` when ``lora_path`` holds no readable adapter.

    ``base_norms``: per target path, the Frobenius norm of each slice's base weight
    (:func:`llmlab.lora.bounds.base_norms`); each module's update is bounded by
    :data:`~llmlab.lora.bounds.MAX_UPDATE_RATIO` times it. None: no base to compare with
    (the update must still be finite in float64 and in ``dtype``)."""
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
    config = _read_config(request, _read_file(
        request, CONFIG_FILE, MAX_CONFIG_BYTES, "MAX_CONFIG_BYTES"))
    rank, scale = _rank_and_scale(request, config, max_lora_rank)
    data = _read_file(
        request, WEIGHTS_FILE, max_weights_bytes(targets, max_lora_rank),
        f"every module the model can adapt at max_lora_rank={max_lora_rank}, 8 bytes a weight",
    )
    weights = _place(request, _read_tensors(request, data), targets, rank, scale, dtype,
                     base_norms)
    return LoRAAdapter(request, rank, scale, weights)


def _where(request: LoRARequest) -> str:
    return f"LoRA adapter {request.lora_name!r} (lora_path={request.lora_path!r})"


def _not_an_adapter(request: LoRARequest) -> AdapterNotFoundError:
    # One message for every way the path can be wrong: which way would tell a client what
    # exists on the server.
    return AdapterNotFoundError(
        f"{_where(request)}: lora_path is not a readable PEFT adapter directory (it must "
        f"hold {CONFIG_FILE} and {WEIGHTS_FILE} as regular files)"
    )


def _read_file(request: LoRARequest, name: str, max_bytes: int, cap: str) -> bytes:
    """The bytes of ``lora_path/name``, a regular file of at most ``max_bytes`` (``cap``
    says where that number comes from)."""
    path = os.path.join(request.lora_path, name)
    try:
        # Checked before opening: opening a device can itself act (a tape rewinds, a
        # watchdog arms), and opening a FIFO waits for a writer.
        regular = stat.S_ISREG(os.stat(path).st_mode)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)) if regular else -1
    except (OSError, ValueError):  # ValueError: a NUL byte or an unencodable path
        fd = -1
    if fd < 0:
        raise _not_an_adapter(request)
    with open(fd, "rb") as file:
        try:
            # Checked again on the descriptor: the path may have been swapped meanwhile.
            info = os.fstat(fd)
            regular = stat.S_ISREG(info.st_mode)
            # One byte past the cap tells a file that grew after fstat.
            fits = regular and info.st_size <= max_bytes
            data = file.read(max_bytes + 1) if fits else b""
        except OSError:
            regular = False
    if not regular:
        raise _not_an_adapter(request)
    if not fits or len(data) > max_bytes:
        raise ValueError(
            f"{_where(request)}: {name} is more than {max_bytes} bytes, the most read for "
            f"it ({cap})"
        )
    return data


def _read_config(request: LoRARequest, data: bytes) -> dict:
    try:
        config = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as err:  # RecursionError: nesting too deep
        raise ValueError(f"{_where(request)}: {CONFIG_FILE} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{_where(request)}: {CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{_where(request)}: peft_type={peft_type!r}; only 'LORA' is supported")
    if config.get("target_parameters"):  # PEFT's LoRA on parameters: MoE experts' weights
        raise ValueError(
            f"{_where(request)}: target_parameters={config['target_parameters']!r}: LoRA on "
            "parameters (a mixture-of-experts model's experts) is not supported; llmlab "
            "applies adapters to the attention and dense MLP projections (target_modules)"
        )
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
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{_where(request)}: lora_alpha={alpha!r} must be a number")
    try:  # an int too large for a float is refused like an infinite one
        alpha_f = float(alpha)
    except OverflowError:
        alpha_f = math.inf
    scale = alpha_f / math.sqrt(rank) if config.get("use_rslora") else alpha_f / rank
    if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
        how = "lora_alpha / sqrt(r)" if config.get("use_rslora") else "lora_alpha / r"
        raise ValueError(
            f"{_where(request)}: lora_alpha={alpha_f:.6g} with r={rank} gives the scale "
            f"{how} = {scale:.6g}; its size must be at most MAX_LORA_SCALE="
            f"{MAX_LORA_SCALE:g} (trained adapters use about 0.25 to 4)"
        )
    return rank, float(scale)


def _read_tensors(request: LoRARequest, data: bytes) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, ValueError, RuntimeError, TypeError) as err:
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


def _place(request, tensors, targets: LoRATargets, rank, scale, dtype, base_norms):
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, kind = _peft_module(key)
        if not kind or module not in targets.by_peft_name:
            leaf = module.rsplit(".", 1)[-1]
            if kind and (".experts." in module or module.endswith(".experts")):
                raise ValueError(
                    f"{_where(request)}: tensor {key!r} adapts a mixture-of-experts "
                    f"expert ({module!r}); llmlab applies LoRA to the attention and dense "
                    "MLPs of MoE models, not to experts (target_modules)"
                )
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
        base = None if base_norms is None else base_norms[target.path][j]
        _check_update(request, module, a, b, scale, base)
        slices = weights.setdefault(target.path, [None] * len(target.slices))
        slices[j] = (
            a.to(dtype).contiguous(),
            (b.float() * scale).to(dtype).contiguous(),
        )
        if not (torch.isfinite(slices[j][0]).all() and torch.isfinite(slices[j][1]).all()):
            raise ValueError(
                f"{_where(request)}: {module!r}: lora_A, or lora_B times the scale "
                f"{scale:.6g}, overflows the model's dtype {dtype}"
            )
    if not weights:
        raise ValueError(f"{_where(request)}: {WEIGHTS_FILE} holds no LoRA weights")
    return {path: tuple(slices) for path, slices in weights.items()}


def _check_update(request, module: str, a, b, scale: float, base: float | None) -> None:
    """Refuse a module whose update ``scale * B A`` is beyond float64 or more than
    ``MAX_UPDATE_RATIO`` times its base weight (Frobenius norms; :mod:`~llmlab.lora.bounds`)."""
    norm = update_norm(a, b, scale)
    bound = math.inf if base is None else MAX_UPDATE_RATIO * base
    if math.isfinite(norm) and norm <= bound:
        return
    limit = "float64" if base is None else (
        f"MAX_UPDATE_RATIO={MAX_UPDATE_RATIO:g} x the base weight's norm {base:.6g} = "
        f"{bound:.6g}"
    )
    raise ValueError(
        f"{_where(request)}: {module!r}: its update scale * lora_B @ lora_A (scale "
        f"{scale:.6g}) has Frobenius norm {norm:.6g}, beyond the bound {limit}; a trained "
        "adapter changes a weight by a small part of it"
    )

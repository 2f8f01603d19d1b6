"""Layers shared by the model families: norms, rotary embeddings, activations.

Everything here works on flat ``[T, ...]`` tensors; none of it mixes tokens, so it is
indifferent to how many sequences the batch holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------- activations


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# Keys are Hugging Face ``hidden_act`` / ``activation_function`` names. gelu_new (GPT-2's
# hand-written tanh formula) is mathematically the tanh approximation torch implements.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Look up an activation by its Hugging Face config name."""
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise ValueError(
            f"unsupported activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}"
        )
    return fn


# ---------------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019), as Llama-family models use it.

    Statistics are taken in float32 whatever the activation dtype, because bf16 sums of
    squares over thousands of channels lose the precision the checkpoint was trained with.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


# ---------------------------------------------------------------------------- config access


def config_value(hf_config: object, *names: str, default: object = None) -> object:
    """First attribute of ``hf_config`` among ``names`` that is set and not None.

    Config spellings drift across model families and ``transformers`` versions
    (``n_embd``/``hidden_size``, ``torch_dtype``/``dtype``), and old configs on disk may
    lack newer fields entirely.
    """
    for name in names:
        value = getattr(hf_config, name, None)
        if value is not None:
            return value
    return default


# ---------------------------------------------------------------------------- rotary


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@attrs.frozen
class RopeSpec:
    """Rotary-embedding settings, normalised from any ``transformers`` config spelling.

    Attributes:
        head_dim: per-head size of q and k.
        rotary_dim: leading channels of each head that rotate (``head_dim`` unless the
            model uses partial rotary); the rest pass through unchanged.
        theta: frequency base.
        rope_type: ``default``, ``linear`` or ``llama3``.
        params: the type's extra settings (``factor``, ``low_freq_factor``, ...).
    """

    head_dim: int
    rotary_dim: int
    theta: float
    rope_type: str = attrs.field()
    params: dict = attrs.field(factory=dict, eq=False)

    @rope_type.validator
    def _check_type(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {value!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @classmethod
    def from_config(cls, hf_config: object, head_dim: int) -> RopeSpec:
        # transformers >= 5 folds everything into ``rope_parameters``; 4.x configs have a
        # top-level ``rope_theta`` plus an optional ``rope_scaling`` dict using either
        # ``type`` or ``rope_type`` as the key.
        params = dict(
            config_value(hf_config, "rope_parameters", default=None)
            or config_value(hf_config, "rope_scaling", default=None)
            or {}
        )
        theta = params.get("rope_theta") or config_value(hf_config, "rope_theta", default=10000.0)
        rope_type = params.get("rope_type") or params.get("type") or "default"
        partial = params.get("partial_rotary_factor") or config_value(
            hf_config, "partial_rotary_factor", default=1.0
        )
        if rope_type == "llama3" and "original_max_position_embeddings" not in params:
            params["original_max_position_embeddings"] = config_value(
                hf_config, "max_position_embeddings"
            )
        return cls(
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            theta=float(theta),
            rope_type=rope_type,
            params=params,
        )

    def inv_freq(self) -> torch.Tensor:
        """``[rotary_dim // 2]`` float32 angular frequencies, after any context scaling."""
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            # Position interpolation (Chen et al., 2023): stretch positions by ``factor``.
            return inv_freq / float(self.params["factor"])
        if self.rope_type == "llama3":
            return _llama3_scaled(inv_freq, self.params)
        return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling (Meta, "The Llama 3 Herd of Models", 2024).

    Long wavelengths (beyond the pretraining context / ``low_freq_factor``) are divided by
    ``factor``, short ones (below context / ``high_freq_factor``) are kept, and the band in
    between is interpolated linearly in ``context / wavelength``.
    """
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    context = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    blend = ((context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    # blend is 0 for long wavelengths (fully scaled) and 1 for short ones (untouched).
    return (1 - blend) * inv_freq / factor + blend * inv_freq


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., "RoFormer", 2021), split-halves layout.

    Channel ``i`` pairs with ``i + rotary_dim / 2`` (Hugging Face's ``rotate_half``), not
    with its neighbour, which is how HF-format checkpoints permute their q/k weights.
    The angles are computed from the positions each step rather than from a cached table,
    which costs one ``[T, rotary_dim / 2]`` outer product and needs no max length.
    """

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        self.spec = spec
        # Not a buffer: a model cast to bf16 would otherwise round the frequencies,
        # which visibly shifts angles at large positions.
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_freq_by_device.get(device)
        if cached is None:
            cached = self.spec.inv_freq().to(device)
            self._inv_freq_by_device[device] = cached
        return cached

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, rotary_dim]`` cos and sin for ``positions`` (compute once per step)."""
        angles = positions.float()[:, None] * self._inv_freq(positions.device)[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


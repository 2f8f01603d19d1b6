"""The image side of a LLaVA-style model: a CLIP vision transformer and the projector.

CLIP's vision tower (Radford et al., 2021) cuts an image into square patches, embeds each
with one strided convolution, prepends a learned class (CLS) token, adds learned position
embeddings, applies a "pre" LayerNorm and runs pre-norm transformer blocks with full
(bidirectional) attention. LLaVA (Liu et al., 2023, "Visual Instruction Tuning") reads the
hidden states of one block (``vision_feature_layer``, -2 in LLaVA-1.5: the second to last),
drops the CLS token unless ``vision_feature_select_strategy`` is ``"full"``, and maps each
patch into the language model's embedding space with a linear-act-linear projector.

Unlike the decoder models in this package an image is one fixed-size, unpaged sequence, so
the tower works on ``[images, tokens, hidden]`` batches and attends with SDPA; no KV cache.
Only the blocks up to the selected layer are built: the checkpoint's later blocks and its
``post_layernorm`` (CLIP's pooled output, which LLaVA never reads) are not loaded.
"""

from __future__ import annotations

import re

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from llmlab.models.layers import config_value, get_activation
from llmlab.models.weights import WeightTarget


def _positive(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


def _feature_layers(value: object) -> tuple[int, ...]:
    """``vision_feature_layer`` as a tuple (LLaVA accepts one index or a list of them)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and value and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise ValueError(
        f"vision_feature_layer must be an int or a non-empty list of ints, got {value!r}"
    )


SELECT_STRATEGIES = ("default", "full")


@attrs.frozen
class VisionTowerSpec:
    """A CLIP vision tower's shape, and which of its hidden states LLaVA reads.

    Attributes:
        num_layers: blocks in the checkpoint (``num_hidden_layers``).
        feature_layers: indices into the tower's hidden states, as Hugging Face numbers
            them: 0 is the embeddings after ``pre_layrnorm``, ``i`` the output of block
            ``i``; negative counts from the end (-1: the last block). Several are
            concatenated along the channels, in the order given.
        drop_cls: drop the CLS token from the features (``"default"`` strategy); keep it
            (``"full"``) otherwise.
    """

    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    image_size: int = attrs.field(validator=_positive)
    patch_size: int = attrs.field(validator=_positive)
    num_channels: int = attrs.field(validator=_positive)
    layer_norm_eps: float
    hidden_act: str
    feature_layers: tuple[int, ...] = attrs.field(converter=_feature_layers)
    drop_cls: bool = True

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_heads})"
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size ({self.image_size}) must be a multiple of patch_size "
                f"({self.patch_size})"
            )
        states = self.num_layers + 1
        for layer in self.feature_layers:
            if not -states <= layer < states:
                raise ValueError(
                    f"vision_feature_layer {layer} is out of range for a tower of "
                    f"{self.num_layers} layers: allowed {-states}..{states - 1}"
                )
        get_activation(self.hidden_act)  # refuse an unknown one now, not at the first image

    @classmethod
    def from_configs(
        cls, vision_config: object, feature_layer: object, select_strategy: str
    ) -> VisionTowerSpec:
        """From a ``CLIPVisionConfig`` and LLaVA's two feature-selection fields."""
        if select_strategy not in SELECT_STRATEGIES:
            raise ValueError(
                f"vision_feature_select_strategy must be one of {SELECT_STRATEGIES}, got "
                f"{select_strategy!r}"
            )
        return cls(
            hidden_size=vision_config.hidden_size,
            intermediate_size=vision_config.intermediate_size,
            num_layers=vision_config.num_hidden_layers,
            num_heads=vision_config.num_attention_heads,
            image_size=vision_config.image_size,
            patch_size=vision_config.patch_size,
            num_channels=config_value(vision_config, "num_channels", default=3),
            layer_norm_eps=config_value(vision_config, "layer_norm_eps", default=1e-5),
            hidden_act=config_value(vision_config, "hidden_act", default="quick_gelu"),
            feature_layers=feature_layer,
            drop_cls=select_strategy == "default",
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Features (placeholder tokens in the prompt) per image."""
        return self.num_patches + (0 if self.drop_cls else 1)

    @property
    def hidden_state_indices(self) -> tuple[int, ...]:
        """``feature_layers`` as non-negative indices into the hidden states."""
        return tuple(layer % (self.num_layers + 1) for layer in self.feature_layers)

    @property
    def layers_needed(self) -> int:
        """Blocks that must run to reach every selected hidden state."""
        return max(self.hidden_state_indices)


class CLIPAttention(nn.Module):
    """Bidirectional multi-head attention over one image's tokens; q/k/v fused at load."""

    def __init__(self, spec: VisionTowerSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.head_dim = spec.hidden_size // spec.num_heads
        self.qkv_proj = nn.Linear(spec.hidden_size, 3 * spec.hidden_size)
        self.out_proj = nn.Linear(spec.hidden_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, tokens, _ = x.shape
        qkv = self.qkv_proj(x).view(images, tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [images, heads, tokens, dim]
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(images, tokens, -1))


class CLIPEncoderLayer(nn.Module):
    """A pre-norm block: ``x + attn(ln1(x))``, then ``x + fc2(act(fc1(ln2(x))))``."""

    def __init__(self, spec: VisionTowerSpec) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = CLIPAttention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)
        self.act = get_activation(spec.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class CLIPVisionTower(nn.Module):
    """CLIP's vision transformer, returning the hidden states LLaVA selects.

    Parameter names follow the checkpoint's (``embeddings.patch_embedding``,
    ``pre_layrnorm`` with CLIP's own spelling, ``encoder.layers.i``) except the fused
    ``self_attn.qkv_proj`` and the MLP's ``fc1`` / ``fc2`` one level up.
    """

    def __init__(self, spec: VisionTowerSpec) -> None:
        super().__init__()
        self.spec = spec
        hidden = spec.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(
            spec.num_channels, hidden, kernel_size=spec.patch_size, stride=spec.patch_size,
            bias=False,
        )
        self.position_embedding = nn.Embedding(spec.num_patches + 1, hidden)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=spec.layer_norm_eps)
        self.layers = nn.ModuleList(CLIPEncoderLayer(spec) for _ in range(spec.layers_needed))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, channels, size, size]`` pixels to the selected features
        ``[images, num_image_tokens, hidden * len(feature_layers)]``."""
        spec = self.spec
        expected = (spec.num_channels, spec.image_size, spec.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(
                f"pixel_values must be [images, {', '.join(map(str, expected))}] (channels, "
                f"image_size, image_size from the vision config), got "
                f"{list(pixel_values.shape)}"
            )
        dtype = self.patch_embedding.weight.dtype
        patches = self.patch_embedding(pixel_values.to(dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.position_embedding.weight
        x = self.pre_layrnorm(x)
        wanted = spec.hidden_state_indices
        states = {0: x} if 0 in wanted else {}
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x)
            if i in wanted:
                states[i] = x
        selected = [states[i] for i in wanted]
        if spec.drop_cls:
            selected = [s[:, 1:] for s in selected]
        return selected[0] if len(selected) == 1 else torch.cat(selected, dim=-1)


# Checkpoint names inside the tower (after its ``vision_model.`` wrapper, if any).
_TOWER_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_QKV_ROWS = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


def map_vision_tower_name(spec: VisionTowerSpec, name: str, prefix: str) -> WeightTarget | None:
    """Where a CLIP vision checkpoint tensor goes in a :class:`CLIPVisionTower` whose
    parameters live under ``prefix``; None for a tensor LLaVA never reads (blocks after the
    selected layer, ``post_layernorm``). ``name`` is relative to the tower."""
    name = name.removeprefix("vision_model.")
    if name.startswith("post_layernorm.") or name.endswith("position_ids"):
        return None
    if name.startswith("embeddings."):
        return WeightTarget(prefix + name.removeprefix("embeddings."))
    match = _TOWER_LAYER.match(name)
    if match is None:
        return WeightTarget(prefix + name)
    index, module, leaf = int(match[1]), match[2], match[3]
    if index >= spec.layers_needed:
        return None
    layer = f"{prefix}layers.{index}."
    projection = module.removeprefix("self_attn.")
    if projection in _QKV_ROWS:
        offset = _QKV_ROWS[projection] * spec.hidden_size
        return WeightTarget(f"{layer}self_attn.qkv_proj.{leaf}", row_offset=offset)
    return WeightTarget(f"{layer}{module.removeprefix('mlp.')}.{leaf}")


class LlavaProjector(nn.Module):
    """LLaVA-1.5's multimodal projector: ``linear_2(act(linear_1(features)))``, from the
    vision features' width to the language model's hidden size."""

    def __init__(
        self, in_features: int, text_hidden: int, hidden_act: str, bias: bool = True
    ) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, text_hidden, bias=bias)
        self.act = get_activation(hidden_act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))

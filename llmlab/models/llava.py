"""LLaVA (Liu et al., 2023, "Visual Instruction Tuning"; LLaVA-1.5: "Improved Baselines
with Visual Instruction Tuning"): a CLIP vision tower, a projector, and a decoder LM.

A prompt holds one placeholder token (``image_token_id``) per image feature: the processor
expands each ``<image>`` into ``num_image_tokens`` copies. The model embeds the prompt's
token ids as usual and overwrites the placeholders' rows, in order, with the projected
image features; from there on it is the text model, unchanged, on the paged KV cache.

The two halves are separate calls so an engine can run the encoder once per image and
cache its output (:meth:`LlavaForConditionalGeneration.encode_images`), then hand the
features to the step that prefills the placeholders
(:meth:`~LlavaForConditionalGeneration.embed_input_ids` and
:meth:`~LlavaForConditionalGeneration.forward_embeds`). The text model is llmlab's own
class for ``text_config`` (the Llama family, which includes Mistral, Qwen2/3 and the MoE
models), driven from its input embeddings (``LlamaForCausalLM.embed`` /
``forward_embeds``).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable

import attrs
import torch
from torch import nn

from llmlab.attention.backend import AttentionContext
from llmlab.models.layers import config_value
from llmlab.models.llama import LlamaForCausalLM
from llmlab.models.registry import MODEL_REGISTRY
from llmlab.models.vision import (
    CLIPVisionTower,
    LlavaProjector,
    VisionTowerSpec,
    map_vision_tower_name,
)
from llmlab.models.weights import WeightTarget, load_mapped_weights

# text_config.model_type -> architecture, for configs whose text_config names none (the
# usual case: LlavaConfig saves the text config without ``architectures``).
_TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Checkpoint spellings differ by transformers version: the Hub's llava-hf checkpoints say
# ``vision_tower.vision_model.*`` / ``language_model.model.*`` / ``language_model.lm_head``;
# transformers 4.5x saves ``model.vision_tower.*`` / ``model.language_model.*`` /
# ``lm_head``; 5.x saves ``vision_tower.*`` without ``vision_model.``.
_PARTS = ("vision_tower.", "multi_modal_projector.", "language_model.")


def text_model_class(text_config: object) -> type[LlamaForCausalLM]:
    """llmlab's class for a LLaVA ``text_config``: its ``architectures`` if it names a
    registered one, else its ``model_type``. Only the Llama family is supported (its
    ``forward_embeds`` takes the embeddings with the image rows written in)."""
    names = list(config_value(text_config, "architectures", default=None) or [])
    model_type = config_value(text_config, "model_type", default=None)
    if model_type in _TEXT_ARCHITECTURES:
        names.append(_TEXT_ARCHITECTURES[model_type])
    for name in names:
        cls = MODEL_REGISTRY.get(name)
        if cls is not None and issubclass(cls, LlamaForCausalLM):
            return cls
    raise ValueError(
        f"text_config (model_type={model_type!r}, architectures="
        f"{config_value(text_config, 'architectures', default=None)!r}) is not a supported "
        f"LLaVA language model; supported model_type: {', '.join(_TEXT_ARCHITECTURES)}"
    )


def _image_token_id(hf_config: object) -> int:
    value = config_value(hf_config, "image_token_id", "image_token_index", default=None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"image_token_index must be a non-negative int, got {value!r}")
    return value


class LlavaForConditionalGeneration(nn.Module):
    """``transformers``' ``LlavaForConditionalGeneration`` for llmlab (single device).

    Attributes:
        vision_tower: the CLIP blocks up to ``vision_feature_layer``.
        multi_modal_projector: vision features to the text model's hidden size.
        language_model: llmlab's text model (its ``lm_head`` is LLaVA's).
        image_token_id: the placeholder token each image feature replaces.
        num_image_tokens: placeholders (features) per image.
    """

    supports_tensor_parallel = False

    def __init__(self, hf_config: object) -> None:
        super().__init__()
        text_config = hf_config.text_config
        self.language_model = text_model_class(text_config)(text_config)
        self.vision_spec = VisionTowerSpec.from_configs(
            hf_config.vision_config,
            config_value(hf_config, "vision_feature_layer", default=-2),
            config_value(hf_config, "vision_feature_select_strategy", default="default"),
        )
        self.vision_tower = CLIPVisionTower(self.vision_spec)
        features = self.vision_spec.hidden_size * len(self.vision_spec.feature_layers)
        self.multi_modal_projector = LlavaProjector(
            features,
            self.language_model.spec.hidden_size,
            config_value(hf_config, "projector_hidden_act", default="gelu"),
            bias=bool(config_value(hf_config, "multimodal_projector_bias", default=True)),
        )
        self.image_token_id = _image_token_id(hf_config)
        self.num_image_tokens = self.vision_spec.num_image_tokens
        self.kv_layout = self.language_model.kv_layout
        self.vocab_size = self.language_model.vocab_size

    # ------------------------------------------------------------------ the encoder side

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Image features in the text model's embedding space, ``[images,
        num_image_tokens, text_hidden]`` (row ``i`` is image ``i``'s), from the image
        processor's ``pixel_values`` ``[images, channels, size, size]``. Each image is
        independent of the others in the batch, so features can be cached per image."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    # ------------------------------------------------------------------ the decoder side

    def embed_input_ids(
        self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Input embeddings ``[T, text_hidden]`` of the token ids ``[T]``, with the rows of
        placeholder tokens replaced, in order, by the rows of ``image_embeds``
        (``[images, num_image_tokens, text_hidden]`` or already flat ``[n, text_hidden]``);
        the counts must match."""
        hidden = self.language_model.embed(input_ids)
        placeholders = input_ids == self.image_token_id
        num_placeholders = int(placeholders.sum())
        if image_embeds is None:
            if num_placeholders:
                raise ValueError(
                    f"input_ids hold {num_placeholders} image placeholder token(s) (id "
                    f"{self.image_token_id}) but no image_embeds were given"
                )
            return hidden
        features = image_embeds.reshape(-1, hidden.shape[-1])
        if features.shape[0] != num_placeholders:
            raise ValueError(
                f"image_embeds hold {features.shape[0]} feature rows but input_ids hold "
                f"{num_placeholders} image placeholder tokens (id {self.image_token_id}); "
                f"each image needs {self.num_image_tokens}"
            )
        hidden = hidden.clone()
        hidden[placeholders] = features.to(hidden.dtype)
        return hidden

    def forward_embeds(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        """The text model from input embeddings ``[T, text_hidden]``: final hidden states."""
        return self.language_model.forward_embeds(inputs_embeds, positions, attn)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionContext,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The :class:`~llmlab.models.base.CausalLM` forward, plus the step's image
        features for the placeholders among ``input_ids`` (None: a text-only step)."""
        if image_embeds is None and not bool((input_ids == self.image_token_id).any()):
            return self.language_model(input_ids, positions, attn)
        return self.forward_embeds(self.embed_input_ids(input_ids, image_embeds), positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a LLaVA checkpoint's tensors in (any of the spellings in ``_PARTS``'s
        comment); ``ValueError`` on an unknown name or a parameter left unfilled."""
        load_mapped_weights(self, weights, self._map_weight_name)

    def _map_weight_name(self, name: str) -> WeightTarget | list[WeightTarget] | None:
        if name.startswith("model.") and name.removeprefix("model.").startswith(_PARTS):
            name = name.removeprefix("model.")
        if name.startswith("vision_tower."):
            return map_vision_tower_name(
                self.vision_spec, name.removeprefix("vision_tower."), "vision_tower."
            )
        if name.startswith("multi_modal_projector."):
            return WeightTarget(name)
        if name.startswith("language_model.") or name == "lm_head.weight":
            targets = self.language_model._map_weight_name(name.removeprefix("language_model."))
            if targets is None:
                return None
            if isinstance(targets, WeightTarget):
                targets = [targets]
            return [attrs.evolve(t, param=f"language_model.{t.param}") for t in targets]
        return WeightTarget(name)  # unknown: load_mapped_weights names it

    def required_vision_tensors(self) -> list[str]:
        """The checkpoint tensors (relative to the tower, as the Hub spells them without
        ``vision_model.``) and projector tensors this model reads."""
        spec = self.vision_spec
        names = [
            "vision_tower.embeddings.class_embedding",
            "vision_tower.embeddings.patch_embedding.weight",
            "vision_tower.embeddings.position_embedding.weight",
            "vision_tower.pre_layrnorm.weight",
            "vision_tower.pre_layrnorm.bias",
        ]
        modules = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                   "self_attn.out_proj", "layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2")
        for i in range(spec.layers_needed):
            names += [f"vision_tower.encoder.layers.{i}.{m}.{leaf}"
                      for m in modules for leaf in ("weight", "bias")]
        leaves = ("weight", "bias") if self.multi_modal_projector.linear_1.bias is not None else (
            "weight",)
        names += [f"multi_modal_projector.linear_{n}.{leaf}" for n in (1, 2) for leaf in leaves]
        return names

    def check_checkpoint(self, where: str, names: set[str]) -> None:
        """Refuse, before any weight is read, a checkpoint (tensor ``names``, from
        ``where``) that lacks a vision-tower or projector tensor this model reads."""
        present = set()
        for name in names:
            if name.startswith("model.") and name.removeprefix("model.").startswith(_PARTS):
                name = name.removeprefix("model.")
            present.add(name.replace("vision_tower.vision_model.", "vision_tower.", 1))
        missing = [n for n in self.required_vision_tensors() if n not in present]
        if missing:
            shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise ValueError(
                f"checkpoint {where} lacks {len(missing)} vision tensor(s) that LLaVA needs "
                f"(vision_feature_layer={list(self.vision_spec.feature_layers)}): {shown}"
            )


def load_llava(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    hf_config: object | None = None,
) -> LlavaForConditionalGeneration:
    """A :class:`LlavaForConditionalGeneration` filled from the checkpoint at ``path``,
    in eval mode without gradients (until the architecture is registered and
    :func:`llmlab.models.load_model` builds it like any other)."""
    from llmlab.models.loader import checkpoint_names, iterate_weights

    if hf_config is None:
        import transformers

        hf_config = transformers.AutoConfig.from_pretrained(str(path))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlavaForConditionalGeneration(hf_config)
    finally:
        torch.set_default_dtype(previous)
    listed = checkpoint_names(pathlib.Path(path))
    if listed is not None:
        model.check_checkpoint(*listed)
    model = model.to_empty(device=torch.device(device))
    model.load_weights(iterate_weights(path))
    model.eval()
    model.requires_grad_(False)
    return model

"""A tiny random-weight LLaVA checkpoint in real Hugging Face format, built offline.

:func:`build_tiny_llava` writes what ``llava-hf/llava-1.5-7b-hf`` ships, shrunk: a
``LlavaConfig`` (a CLIP vision tower of 32x32 images in 8x8 patches, a two-layer Llama),
``model.safetensors``, the tiny models' byte-level BPE tokenizer plus an ``<image>`` token,
a ``CLIPImageProcessor`` and a ``LlavaProcessor``, so ``AutoProcessor.from_pretrained(path)``
expands ``<image>`` into the right number of placeholders with no network.

As in :mod:`llmlab.testing.tiny`, weights are redrawn after ``transformers`` initialises
them (norm scales near 1, not exactly 1; biases non-zero), so a loader that drops or
misplaces one cannot pass a comparison.
"""

from __future__ import annotations

import functools
import os
import pathlib

import torch

from llmlab.testing.tiny import (
    _SHARED_LLAMA_STYLE,
    hf_tokenizer,
    save_tokenizer,
    train_bpe_tokenizer,
)
from llmlab.testing.tiny_corpus import corpus_lines

IMAGE_TOKEN = "<image>"

# LLaVA-1.5's choices (second-to-last layer, CLS dropped, quick_gelu tower, biased
# projector) at a size that builds in a second.
_VISION_DEFAULTS = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 32,
    "patch_size": 8,
    "projection_dim": 32,
    "hidden_act": "quick_gelu",
}
_TEXT_DEFAULTS = {**_SHARED_LLAMA_STYLE, "tie_word_embeddings": False}  # the tiny Llama's
_LLAVA_DEFAULTS = {
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "projector_hidden_act": "gelu",
    "multimodal_projector_bias": True,
}


@functools.lru_cache(maxsize=4)
def _tokenizer_json(text_vocab_size: int) -> str:
    return train_bpe_tokenizer(corpus_lines(), text_vocab_size)


def _redraw_weights(model: torch.nn.Module, seed: int) -> None:
    """Each matrix from N(0, 1/fan_in) so activations stay O(1) through both towers; the
    class embedding from N(0, 1); biases small; norm scales near 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() >= 2:
                param.copy_(noise * (param[0].numel() ** -0.5))
            elif name.endswith("class_embedding"):
                param.copy_(noise)
            elif name.endswith("bias"):
                param.copy_(noise * 0.1)
            else:
                param.copy_(1.0 + noise * 0.1)


def build_tiny_llava(
    path: str | os.PathLike, seed: int = 0, *, vocab_size: int = 512, **overrides: object
) -> pathlib.Path:
    """Write a tiny random-weight ``LlavaForConditionalGeneration`` checkpoint with its
    tokenizer and processor to ``path``; return it.

    ``overrides`` are ``LlavaConfig`` fields (``vision_feature_layer``,
    ``vision_feature_select_strategy``, ``projector_hidden_act``,
    ``multimodal_projector_bias``, ...), except ``vision_config`` and ``text_config``:
    dicts merged into the tiny ``CLIPVisionConfig`` and ``LlamaConfig`` fields. The
    ``<image>`` token is the vocabulary's last id, ``vocab_size - 1``. The result depends
    only on the arguments.
    """
    import transformers

    vision_fields = {**_VISION_DEFAULTS, **dict(overrides.pop("vision_config", None) or {})}
    text_fields = {**_TEXT_DEFAULTS, **dict(overrides.pop("text_config", None) or {})}
    llava_fields = {**_LLAVA_DEFAULTS, **overrides}
    if vision_fields["image_size"] % vision_fields["patch_size"]:
        raise ValueError(
            f"vision_config image_size ({vision_fields['image_size']}) must be a multiple of "
            f"its patch_size ({vision_fields['patch_size']})"
        )
    image_token_id = vocab_size - 1
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**vision_fields),
        text_config=transformers.LlamaConfig(
            vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=None,
            **text_fields,
        ),
        image_token_index=image_token_id,
        image_seq_length=_num_image_tokens(vision_fields, llava_fields),
        **llava_fields,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    torch_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.LlavaForConditionalGeneration(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(torch_state)
    _redraw_weights(model, seed)
    model.generation_config = transformers.GenerationConfig(bos_token_id=0, eos_token_id=1)

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    _save_processor(out, vocab_size, vision_fields, llava_fields, text_fields)
    return out


def _num_image_tokens(vision_fields: dict, llava_fields: dict) -> int:
    patches = (vision_fields["image_size"] // vision_fields["patch_size"]) ** 2
    return patches + (llava_fields["vision_feature_select_strategy"] == "full")


def _save_processor(
    out: pathlib.Path, vocab_size: int, vision_fields: dict, llava_fields: dict,
    text_fields: dict,
) -> None:
    import transformers

    # The BPE takes every id but the last, which the <image> token gets.
    max_length = text_fields["max_position_embeddings"]
    tokenizer = hf_tokenizer(_tokenizer_json(vocab_size - 1), max_length)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if image_token_id != vocab_size - 1 or tokenizer.bos_token_id != 0:
        raise AssertionError(
            f"tokenizer ids drifted from the config's: <image> is {image_token_id}, expected "
            f"{vocab_size - 1}; <s> is {tokenizer.bos_token_id}, expected 0"
        )
    size = vision_fields["image_size"]
    # transformers 5 names the PIL-backed processor apart (the default one needs
    # torchvision); 4.x has only CLIPImageProcessor, PIL-backed.
    processor_cls = getattr(transformers, "CLIPImageProcessorPil", transformers.CLIPImageProcessor)
    image_processor = processor_cls(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=vision_fields["patch_size"],
        vision_feature_select_strategy=llava_fields["vision_feature_select_strategy"],
        num_additional_image_tokens=1,  # CLIP's CLS token
        image_token=IMAGE_TOKEN,
    )
    processor.save_pretrained(out)
    save_tokenizer(tokenizer, out)  # again, in the form transformers 4.x also loads

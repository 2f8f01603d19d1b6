"""LLaVA's model side against transformers: the image encoder, the merged prompt's logits,
greedy tokens, and checkpoint loading (issue 44, item 1: the model, before the engine)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from llmlab.attention import (
    AttentionContext,
    AttentionInputs,
    TorchPagedAttention,
    block_table_tensor,
)
from llmlab.models.llava import LlavaForConditionalGeneration, load_llava
from llmlab.testing.tiny_vlm import IMAGE_TOKEN, build_tiny_llava

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

# (id, build_tiny_llava overrides): LLaVA-1.5's choices, then each switch flipped.
VARIANTS = {
    "llava15": {},
    "full-cls": {"vision_feature_select_strategy": "full"},
    "last-layer": {"vision_feature_layer": -1},
    "embeddings-layer": {"vision_feature_layer": 0, "vision_feature_select_strategy": "full"},
    "two-layers": {"vision_feature_layer": [-2, -1]},
    "gelu-nobias-tied": {
        "vision_config": {"hidden_act": "gelu", "image_size": 28, "patch_size": 14},
        "text_config": {"tie_word_embeddings": True},
        "projector_hidden_act": "quick_gelu",
        "multimodal_projector_bias": False,
    },
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny_llava")
    return {name: build_tiny_llava(root / name, seed=3, **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="module")
def load_trio(checkpoints):
    """``load_trio(variant)`` -> (ours, HF reference, HF processor), float32, cached."""
    cache = {}

    def load(variant: str):
        if variant not in cache:
            path = checkpoints[variant]
            reference = transformers.LlavaForConditionalGeneration.from_pretrained(
                path, dtype=torch.float32
            ).eval()
            processor = transformers.AutoProcessor.from_pretrained(path)
            cache[variant] = (load_llava(path), reference, processor)
        return cache[variant]

    return load


def draw_images(count: int, seed: int = 0) -> list:
    """Images of different sizes and content: a colour gradient, noise, a checkerboard
    (the processor resizes and crops each to the tower's size)."""
    rng = np.random.default_rng(seed)
    images = []
    for i in range(count):
        height, width = 40 + 7 * i, 52 - 5 * i
        kind = i % 3
        if kind == 0:
            ys, xs = np.mgrid[0:height, 0:width]
            pixels = np.stack([xs / width, ys / height, (xs + ys) / (width + height)], -1)
        elif kind == 1:
            pixels = rng.random((height, width, 3))
        else:
            ys, xs = np.mgrid[0:height, 0:width]
            pixels = np.repeat((((ys // 6) + (xs // 6)) % 2)[..., None], 3, -1) * 0.8 + 0.1
        images.append(Image.fromarray((pixels * 255).astype(np.uint8)))
    return images


def hf_image_features(reference, pixel_values: torch.Tensor) -> torch.Tensor:
    # output_hidden_states=True: transformers 5.2x otherwise asks the tower for the hidden
    # states listed in vision_feature_layer, and a layer of 0 reads as "none".
    with torch.no_grad():
        features = reference.get_image_features(
            pixel_values=pixel_values, output_hidden_states=True
        ).pooler_output
    return torch.stack(list(features))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("num_images", [1, 3])
def test_encode_images_equals_transformers(load_trio, variant, num_images):
    ours, reference, processor = load_trio(variant)
    pixel_values = processor.image_processor(draw_images(num_images), return_tensors="pt")[
        "pixel_values"
    ]
    expected = hf_image_features(reference, pixel_values)
    with torch.no_grad():
        got = ours.encode_images(pixel_values)
    assert got.shape == expected.shape == (
        num_images, ours.num_image_tokens, ours.language_model.spec.hidden_size
    )
    assert expected.abs().max() > 0.5  # features of a real scale, not all ~0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_each_image_encodes_the_same_alone_or_in_a_batch(load_trio):
    # What lets an engine encode an image once and cache the result per image.
    ours, _, processor = load_trio("llava15")
    pixel_values = processor.image_processor(draw_images(3), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        together = ours.encode_images(pixel_values)
        alone = [ours.encode_images(pixel_values[i : i + 1])[0] for i in range(3)]
    for i in range(3):
        torch.testing.assert_close(alone[i], together[i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["llava15", "full-cls", "gelu-nobias-tied"])
def test_processor_expands_each_image_into_the_models_token_count(load_trio, variant):
    ours, _, processor = load_trio(variant)
    inputs = processor(
        images=draw_images(2), text=f"a {IMAGE_TOKEN} and b {IMAGE_TOKEN}.", return_tensors="pt"
    )
    placeholders = int((inputs["input_ids"] == ours.image_token_id).sum())
    assert placeholders == 2 * ours.num_image_tokens


class PagedSequence:
    """One sequence on a paged KV cache (torch backend), fed chunk by chunk from embeddings,
    as a multimodal engine step would feed it."""

    def __init__(self, model: LlavaForConditionalGeneration, block_size: int = 4) -> None:
        self.model = model
        self.backend = TorchPagedAttention()
        self.block_size = block_size
        layout = model.kv_layout
        num_blocks = 64
        shape = self.backend.kv_cache_shape(
            num_blocks, block_size, layout.num_kv_heads, layout.head_dim
        )
        self.kv_caches = [torch.zeros(shape) for _ in range(layout.num_layers)]
        # Descending block ids, so a table that assumed contiguity would read wrong slots.
        self.block_table = list(range(num_blocks - 1, -1, -1))
        self.length = 0

    def _context(self, num_new: int) -> AttentionContext:
        self.length += num_new
        positions = range(self.length - num_new, self.length)
        slots = [self.block_table[p // self.block_size] * self.block_size + p % self.block_size
                 for p in positions]
        num_blocks = -(-self.length // self.block_size)
        inputs = AttentionInputs(
            query_lens=[num_new],
            seq_lens=[self.length],
            block_tables=block_table_tensor([self.block_table[:num_blocks]]),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_size=self.block_size,
            device=torch.device("cpu"),
        )
        return AttentionContext(self.backend, self.backend.build_metadata(inputs), self.kv_caches)

    def step(self, token_ids: list[int], image_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[len(token_ids), vocab]`` for the next chunk; ``image_rows``: the image
        feature rows for the placeholders in this chunk, flat ``[n, hidden]``."""
        start = self.length
        attn = self._context(len(token_ids))
        ids = torch.tensor(token_ids, dtype=torch.long)
        positions = torch.arange(start, start + len(token_ids))
        with torch.no_grad():
            hidden = self.model(ids, positions, attn, image_embeds=image_rows)
            return self.model.compute_logits(hidden)


def _prompt(processor, num_images: int):
    text = "USER: " + " ".join(f"picture {i}: {IMAGE_TOKEN}" for i in range(num_images))
    return processor(images=draw_images(num_images, seed=5), text=text + " what? ASSISTANT:",
                     return_tensors="pt")


@pytest.mark.parametrize("variant", ["llava15", "two-layers", "gelu-nobias-tied"])
def test_prompt_logits_equal_transformers(load_trio, variant):
    ours, reference, processor = load_trio(variant)
    inputs = _prompt(processor, num_images=2)
    with torch.no_grad():
        expected = reference(**inputs).logits[0].float()
        image_rows = ours.encode_images(inputs["pixel_values"]).flatten(0, 1)
    got = PagedSequence(ours).step(inputs["input_ids"][0].tolist(), image_rows)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_chunked_prefill_split_inside_an_image_then_greedy_tokens_equal_transformers(load_trio):
    ours, reference, processor = load_trio("llava15")
    inputs = _prompt(processor, num_images=2)
    token_ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        image_rows = ours.encode_images(inputs["pixel_values"]).flatten(0, 1)
        generated = reference.generate(**inputs, max_new_tokens=8, do_sample=False)
    expected_tokens = generated[0, len(token_ids):].tolist()

    # Split the prompt in the middle of the first image's placeholders: each chunk gets
    # the feature rows of the placeholders it holds.
    split = token_ids.index(ours.image_token_id) + ours.num_image_tokens // 2
    in_first = sum(t == ours.image_token_id for t in token_ids[:split])
    sequence = PagedSequence(ours)
    sequence.step(token_ids[:split], image_rows[:in_first])
    logits = sequence.step(token_ids[split:], image_rows[in_first:])
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < len(expected_tokens):
        tokens.append(int(sequence.step([tokens[-1]])[-1].argmax()))  # text-only decode
    assert tokens == expected_tokens


def test_text_only_prompt_runs_the_text_model(load_trio):
    ours, reference, processor = load_trio("llava15")
    token_ids = processor.tokenizer("no pictures here, only words")["input_ids"]
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([token_ids])).logits[0]
    got = PagedSequence(ours).step(token_ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


# --------------------------------------------------------------------------- bad input


def test_placeholder_count_mismatch_is_refused_with_both_counts(load_trio):
    ours, _, _ = load_trio("llava15")
    n = ours.num_image_tokens
    ids = torch.tensor([0, 5] + [ours.image_token_id] * n + [7])
    rows = torch.zeros(n - 1, ours.language_model.spec.hidden_size)
    with pytest.raises(ValueError, match=rf"{n - 1} feature rows but input_ids hold {n} image"):
        ours.embed_input_ids(ids, rows)
    with pytest.raises(ValueError, match=rf"hold {n} image placeholder token\(s\).*no image_"):
        ours.embed_input_ids(ids)


def test_pixel_values_of_the_wrong_size_are_refused(load_trio):
    ours, _, _ = load_trio("llava15")
    wanted = r"pixel_values must be \[images, 3, 32, 32\].*got \[1, 3, 30, 30\]"
    with pytest.raises(ValueError, match=wanted):
        ours.encode_images(torch.zeros(1, 3, 30, 30))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("vision_feature_select_strategy", "cls", r"vision_feature_select_strategy must be one of"),
        ("vision_feature_layer", 3, r"vision_feature_layer 3 is out of range .* -3\.\.2"),
        ("vision_feature_layer", "last", r"vision_feature_layer must be an int or a non-empty"),
        ("projector_hidden_act", "swiglu", r"unsupported activation 'swiglu'"),
    ],
)
def test_bad_llava_config_fields_are_refused_by_name(checkpoints, field, value, message):
    config = transformers.AutoConfig.from_pretrained(checkpoints["llava15"])
    object.__setattr__(config, field, value)  # past LlavaConfig's own checks
    with pytest.raises(ValueError, match=message):
        LlavaForConditionalGeneration(config)


# --------------------------------------------------------------------------- checkpoints


def _read_checkpoint(path: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _write_variant(source: pathlib.Path, dest: pathlib.Path, tensors: dict) -> pathlib.Path:
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(source, dest)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"))
    return dest


def test_checkpoint_missing_a_vision_tensor_is_refused_by_name(checkpoints, tmp_path):
    tensors = _read_checkpoint(checkpoints["llava15"])
    missing = "vision_tower.encoder.layers.0.self_attn.k_proj.weight"
    del tensors[missing]
    path = _write_variant(checkpoints["llava15"], tmp_path / "broken", tensors)
    with pytest.raises(ValueError, match=rf"lacks 1 vision tensor\(s\).*{missing}"):
        load_llava(path)
    # Without the up-front check the loader still refuses: the fused qkv is a third short.
    config = transformers.AutoConfig.from_pretrained(path)
    model = LlavaForConditionalGeneration(config)
    with pytest.raises(ValueError, match=r"vision_tower\.layers\.0\.self_attn\.qkv_proj\.weight "
                                         r"\(64/96 rows\)"):
        model.load_weights(tensors.items())


def test_checkpoint_missing_a_projector_tensor_is_refused_by_name(checkpoints, tmp_path):
    tensors = _read_checkpoint(checkpoints["llava15"])
    del tensors["multi_modal_projector.linear_2.bias"]
    path = _write_variant(checkpoints["llava15"], tmp_path / "broken", tensors)
    with pytest.raises(ValueError, match=r"multi_modal_projector\.linear_2\.bias"):
        load_llava(path)


def test_blocks_after_the_feature_layer_and_post_layernorm_are_not_needed(load_trio, checkpoints,
                                                                          tmp_path):
    # vision_feature_layer=-2 of 2 blocks reads block 0 only, as in LLaVA-1.5 (23 of 24).
    tensors = {k: v for k, v in _read_checkpoint(checkpoints["llava15"]).items()
               if "encoder.layers.1." not in k and "post_layernorm" not in k}
    path = _write_variant(checkpoints["llava15"], tmp_path / "pruned", tensors)
    pruned = load_llava(path)
    assert len(pruned.vision_tower.layers) == 1
    ours, _, processor = load_trio("llava15")
    pixel_values = processor.image_processor(draw_images(2), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        torch.testing.assert_close(pruned.encode_images(pixel_values),
                                   ours.encode_images(pixel_values), rtol=0, atol=0)


def _hub_name(name: str) -> str:
    """llava-hf's Hub spelling (transformers 4.4x)."""
    if name.startswith("vision_tower."):
        return name.replace("vision_tower.", "vision_tower.vision_model.", 1)
    return name


def _saved_by_4_5x(name: str) -> str:
    """transformers 4.5x's save_pretrained spelling."""
    for part in ("vision_tower.", "multi_modal_projector."):
        if name.startswith(part):
            return "model." + name.replace("vision_tower.", "vision_tower.vision_model.", 1)
    if name == "language_model.lm_head.weight":
        return "lm_head.weight"
    return name.replace("language_model.model.", "model.language_model.", 1)


@pytest.mark.parametrize("rename", [_hub_name, _saved_by_4_5x])
def test_other_transformers_spellings_of_the_checkpoint_load_the_same(
    load_trio, checkpoints, tmp_path, rename
):
    tensors = {rename(k): v for k, v in _read_checkpoint(checkpoints["llava15"]).items()}
    assert set(tensors) != set(_read_checkpoint(checkpoints["llava15"]))
    renamed = load_llava(_write_variant(checkpoints["llava15"], tmp_path / "renamed", tensors))
    ours, _, _ = load_trio("llava15")
    for (name, mine), (_, theirs) in zip(
        ours.state_dict().items(), renamed.state_dict().items(), strict=True
    ):
        assert torch.equal(mine, theirs), name

"""vLLM's multi_modal_data and OpenAI chat content parts: parsed into the same pixels, and
refused with the field named (counts and structure before any image is decoded)."""

from __future__ import annotations

import base64
import copy
import io

import numpy as np
import pytest
from PIL import Image

import llmlab.multimodal.inputs as inputs_module
from llmlab.multimodal import (
    ChatMedia,
    MediaError,
    check_limit_mm_per_prompt,
    check_mm_processor_kwargs,
    check_placeholders,
    parse_chat_content,
    parse_multi_modal_data,
)

PLACEHOLDER = "<image>"


def make_pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(9, 11, 3), dtype=np.uint8)


def png_data_url(array: np.ndarray) -> str:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def refused(call, field: str, match: str) -> MediaError:
    with pytest.raises(MediaError, match=match) as info:
        call()
    assert info.value.field == field and str(info.value).startswith(field), str(info.value)
    return info.value


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if any image is loaded (a refusal must come before decoding)."""
    def refuse(*args, **kwargs):
        raise AssertionError("an image was loaded")
    monkeypatch.setattr(inputs_module, "load_image", refuse)


# --- multi_modal_data -----------------------------------------------------------------------

def test_multi_modal_data_single_and_lists_give_the_same_pixels():
    a, b, c = make_pixels(1), make_pixels(2), make_pixels(3)
    one = parse_multi_modal_data({"image": Image.fromarray(a)})
    assert list(one) == ["image"] and len(one["image"]) == 1
    assert np.array_equal(np.asarray(one["image"][0]), a)
    many = parse_multi_modal_data({"image": [a, png_data_url(b), Image.fromarray(c)]},
                                  limit_mm_per_prompt={"image": 3})
    assert [np.array_equal(np.asarray(img), ref) for img, ref in zip(many["image"], (a, b, c))
            ] == [True, True, True]
    assert parse_multi_modal_data({"image": ()}) == {"image": []}
    assert parse_multi_modal_data({}) == {}


def test_multi_modal_data_errors_name_the_item():
    refused(lambda: parse_multi_modal_data(
        {"image": [make_pixels(1), make_pixels(2), b"junk"]}, limit_mm_per_prompt={"image": 3}),
        "multi_modal_data.image[2]", "undecodable")
    refused(lambda: parse_multi_modal_data({"image": "data:text/plain;base64,aGk="}),
            "multi_modal_data.image", "media type 'text/plain'")
    refused(lambda: parse_multi_modal_data({"image": "/etc/passwd"}),
            "multi_modal_data.image", "allowed_local_media_path")
    refused(lambda: parse_multi_modal_data([make_pixels(1)]), "multi_modal_data",
            "must be a dict like")


def test_multi_modal_data_modalities_and_counts_are_checked_before_decoding(no_loading):
    two = [make_pixels(1), make_pixels(2)]
    refused(lambda: parse_multi_modal_data({"image": two}), "multi_modal_data.image",
            r"at most limit_mm_per_prompt\['image'\] = 1 image\(s\) per prompt, got 2")
    refused(lambda: parse_multi_modal_data({"image": two * 2}, limit_mm_per_prompt={"image": 3}),
            "multi_modal_data.image", "= 3 image.*got 4")
    refused(lambda: parse_multi_modal_data({"image": two[0]}, limit_mm_per_prompt={"image": 0}),
            "multi_modal_data.image", "= 0 image.*got 1")
    refused(lambda: parse_multi_modal_data({"pictures": two}), "multi_modal_data",
            r"unknown modality 'pictures'; allowed: \['image'\]")
    refused(lambda: parse_multi_modal_data({"video": two}), "multi_modal_data",
            "modality 'video', which llmlab does not support")
    refused(lambda: parse_multi_modal_data({"image": two[0]}, model_modalities=()),
            "multi_modal_data.image", "must be absent: this model takes only text")
    refused(lambda: parse_multi_modal_data({"image": two[0]}, limit_mm_per_prompt={"image": -1}),
            "limit_mm_per_prompt", r"limit_mm_per_prompt\['image'\] must be an int >= 0")


def test_limit_mm_per_prompt_and_mm_processor_kwargs_are_checked():
    assert check_limit_mm_per_prompt(None) == {}
    assert check_limit_mm_per_prompt({"image": 4, "video": 0}) == {"image": 4, "video": 0}
    for bad, match in [([1], "must be a dict like"), ({"img": 1}, "unknown modality 'img'"),
                       ({"image": True}, "got bool True"), ({"image": 1.0}, "got float 1.0")]:
        refused(lambda: check_limit_mm_per_prompt(bad), "limit_mm_per_prompt", match)
    assert check_mm_processor_kwargs(None) == {}
    kwargs = {"max_pixels": 1024}
    checked = check_mm_processor_kwargs(kwargs)
    assert checked == kwargs and checked is not kwargs
    for bad in ([("a", 1)], {1: 2}, "max_pixels=4"):
        refused(lambda: check_mm_processor_kwargs(bad), "mm_processor_kwargs",
                "must be a dict with string keys")


# --- chat content parts ----------------------------------------------------------------------

def test_chat_parts_become_text_with_placeholders_in_order_and_images():
    a, b = make_pixels(1), make_pixels(2)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [text_part("Compare"), image_part(png_data_url(a)),
                                     text_part("and"), image_part(png_data_url(b), detail="low"),
                                     text_part("please.")]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": [text_part("Thanks")]},
    ]
    original = copy.deepcopy(messages)
    parsed = parse_chat_content(messages, image_placeholder=PLACEHOLDER,
                                limit_mm_per_prompt={"image": 2})
    assert isinstance(parsed, ChatMedia)
    assert [m["content"] for m in parsed.messages] == [
        "Be brief.", "Compare\n<image>\nand\n<image>\nplease.", None, "Thanks"]
    assert parsed.messages[2]["tool_calls"] == [] and parsed.messages[1]["role"] == "user"
    assert [np.array_equal(np.asarray(img), ref) for img, ref in zip(parsed.images, (a, b))
            ] == [True, True]
    assert parsed.details == ["auto", "low"]
    assert messages == original  # the caller's messages are not changed
    # the flattened text holds one placeholder per image
    text = "".join(m["content"] or "" for m in parsed.messages)
    assert check_placeholders(text, PLACEHOLDER, len(parsed.images)) == 2


def test_chat_image_pil_parts_and_custom_separator():
    a = make_pixels(4)
    parsed = parse_chat_content(
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": Image.fromarray(a)},
                                      text_part("What is it?")]}],
        image_placeholder="<|image_pad|>", separator=" ")
    assert parsed.messages[0]["content"] == "<|image_pad|> What is it?"
    assert np.array_equal(np.asarray(parsed.images[0]), a)


def test_chat_errors_name_the_content_part():
    def chat(*parts, **kwargs):
        messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": list(parts)}]
        return lambda: parse_chat_content(messages, image_placeholder=PLACEHOLDER, **kwargs)

    ok = text_part("look")
    refused(chat(ok, image_part("data:image/png;base64,aGVsbG8=")),
            "messages[1].content[1].image_url.url", "undecodable")
    refused(chat(ok, image_part("data:application/pdf;base64,aGVsbG8=")),
            "messages[1].content[1].image_url.url", "media type 'application/pdf'")
    refused(chat(image_part("file:///etc/hosts")), "messages[1].content[0].image_url.url",
            "unless the engine is started with allowed_local_media_path")
    refused(chat(image_part("https://example.com/a.png")), "messages[1].content[0].image_url.url",
            "fetching http\\(s\\) URLs is disabled")
    refused(chat(ok, image_part(png_data_url(make_pixels(1)), detail="ultra")),
            "messages[1].content[1].image_url.detail", r"one of \['auto', 'low', 'high'\]")
    refused(chat(ok, {"type": "image_url", "image_url": "data:image/png;base64,x"}),
            "messages[1].content[1].image_url", "must be a dict with a 'url'")
    refused(chat({"type": "image_url", "image_url": {"url": 7}}),
            "messages[1].content[0].image_url.url", "must be a string")
    refused(chat({"type": "input_audio", "input_audio": {}}), "messages[1].content[0].type",
            "got 'input_audio' \\(not supported by llmlab\\)")
    refused(chat({"type": "sparkles"}), "messages[1].content[0].type", "got 'sparkles'")
    refused(chat({"text": "no type"}), "messages[1].content[0]", "must be a dict with a 'type'")
    refused(chat({"type": "text", "text": 3}), "messages[1].content[0].text", "must be a string")
    refused(chat({"type": "image_pil", "image_pil": "x.png"}), "messages[1].content[0].image_pil",
            "must be a PIL image")


def test_chat_structure_errors():
    refused(lambda: parse_chat_content("hi", image_placeholder=PLACEHOLDER), "messages",
            "must be a list of messages")
    refused(lambda: parse_chat_content(["hi"], image_placeholder=PLACEHOLDER), "messages[0]",
            "must be a dict")
    refused(lambda: parse_chat_content([{"role": "user", "content": 5}],
                                       image_placeholder=PLACEHOLDER),
            "messages[0].content", "must be a string, a list of content parts or None")
    refused(lambda: parse_chat_content([], image_placeholder=""), "image_placeholder",
            "must be a non-empty string")


def test_chat_counts_and_text_only_models_are_refused_before_decoding(no_loading):
    url = "data:image/png;base64,AAAA"  # never decoded: the refusals come first
    messages = [{"role": "user", "content": [image_part(url)]},
                {"role": "user", "content": [text_part("and"), image_part(url)]}]
    refused(lambda: parse_chat_content(messages, image_placeholder=PLACEHOLDER),
            "messages[*].content",
            r"limit_mm_per_prompt\['image'\] = 1 image\(s\) per prompt, got 2")
    refused(lambda: parse_chat_content(messages, image_placeholder=PLACEHOLDER,
                                       limit_mm_per_prompt={"image": 2}, model_modalities=()),
            "messages[0].content[0]", "must not be an image: this model takes only text")


# --- placeholders ----------------------------------------------------------------------------

def test_placeholder_counts_must_match_the_images():
    assert check_placeholders("a <image> b <image>", PLACEHOLDER, 2) == 2
    assert check_placeholders("no images", PLACEHOLDER, 0) == 0
    assert check_placeholders([5, 99, 6, 99], 99, 2) == 2
    refused(lambda: check_placeholders("a <image> b", PLACEHOLDER, 2), "prompt",
            "it has 1 placeholder\\(s\\) for 2 image\\(s\\)")
    refused(lambda: check_placeholders("<image><image>", PLACEHOLDER, 0), "prompt",
            "it has 2 placeholder\\(s\\) for 0 image\\(s\\)")
    refused(lambda: check_placeholders([99, 99, 99], 99, 1, field="prompt_token_ids"),
            "prompt_token_ids", "it has 3 placeholder\\(s\\) for 1 image\\(s\\)")
    refused(lambda: check_placeholders([1, 2], "<image>", 1), "image_token",
            "must be a token id")
    refused(lambda: check_placeholders("text", 99, 1), "image_token", "must be a non-empty string")

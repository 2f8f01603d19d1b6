"""vLLM's multi-modal input forms, parsed and checked: ``multi_modal_data``, OpenAI chat
content parts, ``limit_mm_per_prompt``, ``mm_processor_kwargs`` and placeholder counts.

Every check runs before any image is decoded (structure, modalities, counts), so a request
refused for a count or a field never allocates pixels; then each image goes through
:func:`llmlab.multimodal.media.load_image` with its own field path. Every error is a
:class:`~llmlab.multimodal.media.MediaError` (a ``ValueError``) whose message starts with
the field.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs

from llmlab.multimodal.media import Fetch, MediaError, MediaLimits, load_image, shown

# The modalities vLLM names; llmlab decodes images only.
KNOWN_MODALITIES = ("image", "video", "audio")
SUPPORTED_MODALITIES = ("image",)
DEFAULT_LIMIT_PER_PROMPT = 1  # vLLM's default for a modality limit_mm_per_prompt leaves out
DETAILS = ("auto", "low", "high")  # OpenAI's image_url.detail
PART_TYPES = ("text", "image_url", "image_pil")
# Content part types of OpenAI's API and vLLM's that llmlab does not take (named in errors).
_OTHER_PART_TYPES = ("input_audio", "audio_url", "video_url", "image_embeds", "input_image",
                     "file", "refusal")


def check_limit_mm_per_prompt(value: Mapping[str, int] | None,
                              field: str = "limit_mm_per_prompt") -> dict[str, int]:
    """``{"image": N}`` as a plain dict (``None``: ``{}``, so each modality gets vLLM's
    default of 1). Keys must be known modalities, values ints >= 0."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise MediaError(field, f"{field} must be a dict like {{'image': 2}}, got {shown(value)}")
    checked = {}
    for modality, limit in value.items():
        if modality not in KNOWN_MODALITIES:
            raise MediaError(field, f"{field} has unknown modality {modality!r}; known: "
                                    f"{list(KNOWN_MODALITIES)}")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise MediaError(field, f"{field}[{modality!r}] must be an int >= 0, got "
                                    f"{shown(limit)}")
        checked[modality] = limit
    return checked


def check_mm_processor_kwargs(value: Mapping[str, Any] | None,
                              field: str = "mm_processor_kwargs") -> dict[str, Any]:
    """A plain dict of keyword arguments for the model's processor (string keys), or ``{}``.
    Which keys a processor takes is the processor's business; this checks only the shape."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise MediaError(field, f"{field} must be a dict with string keys, got {shown(value)}")
    return dict(value)


def parse_multi_modal_data(
    data: Mapping[str, Any],
    *,
    limit_mm_per_prompt: Mapping[str, int] | None = None,
    field: str = "multi_modal_data",
    model_modalities: Collection[str] = SUPPORTED_MODALITIES,
    allowed_local_media_path: str | os.PathLike | None = None,
    fetch: Fetch | None = None,
    limits: MediaLimits = MediaLimits(),
) -> dict[str, list]:
    """vLLM's ``{"image": img | [img, ...]}`` as ``{"image": [RGB PIL images]}``.

    ``model_modalities`` are the modalities the served model takes (``()`` for a text-only
    model). Each image may be any form :func:`load_image` accepts; its field is
    ``multi_modal_data.image[i]`` (``multi_modal_data.image`` for a single one).

    Raises:
        MediaError: an unknown or unsupported modality, more items than
            ``limit_mm_per_prompt`` allows, or an image that does not load.
    """
    caps = check_limit_mm_per_prompt(limit_mm_per_prompt)
    if not isinstance(data, Mapping):
        raise MediaError(field, f"{field} must be a dict like {{'image': image or [images]}}, "
                                f"got {shown(data)}")
    pending: dict[str, list[tuple[str, Any]]] = {}
    for modality, value in data.items():
        _check_modality(modality, f"{field}", model_modalities)
        if isinstance(value, (list, tuple)):
            items = [(f"{field}.{modality}[{i}]", item) for i, item in enumerate(value)]
        else:
            items = [(f"{field}.{modality}", value)]
        _check_count(modality, len(items), caps, f"{field}.{modality}")
        pending[modality] = items
    # Only now, with every count known to fit, is anything decoded.
    return {modality: [_load(source, item_field, allowed_local_media_path, fetch, limits)
                       for item_field, source in items]
            for modality, items in pending.items()}


@attrs.frozen
class ChatMedia:
    """A chat request's messages with their content parts flattened, and its images.

    Attributes:
        messages: the messages, each a new dict; a content given as a list of parts is now
            one string: the parts in order, each image as the placeholder, joined by the
            separator. Other keys are kept as they were.
        images: the decoded RGB images, in the order their placeholders appear.
        details: each image's ``image_url.detail`` (``"auto"`` when not given).
    """

    messages: list[dict[str, Any]]
    images: list[Any]
    details: list[str]


def parse_chat_content(
    messages: Sequence[Mapping[str, Any]],
    *,
    image_placeholder: str,
    limit_mm_per_prompt: Mapping[str, int] | None = None,
    field: str = "messages",
    model_modalities: Collection[str] = SUPPORTED_MODALITIES,
    separator: str = "\n",
    allowed_local_media_path: str | os.PathLike | None = None,
    fetch: Fetch | None = None,
    limits: MediaLimits = MediaLimits(),
) -> ChatMedia:
    """OpenAI chat messages with content parts as :class:`ChatMedia`.

    Parts: ``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {"url":
    ..., "detail": "auto" | "low" | "high"}}`` and vLLM's ``{"type": "image_pil",
    "image_pil": <PIL image>}``. The URL is a data URL, a ``file://`` URL (under
    ``allowed_local_media_path``) or http(s) (only with ``fetch``). Errors name the part,
    e.g. ``messages[0].content[1].image_url.url``.
    """
    caps = check_limit_mm_per_prompt(limit_mm_per_prompt)
    if not isinstance(image_placeholder, str) or not image_placeholder:
        raise MediaError("image_placeholder", f"image_placeholder must be a non-empty string, "
                                              f"got {shown(image_placeholder)}")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise MediaError(field, f"{field} must be a list of messages, got {shown(messages)}")
    flattened: list[dict[str, Any]] = []
    # Per message, its pieces: a string, or an image as (field, source, detail).
    pieces_of: list[list[Any] | None] = []
    images: list[tuple[str, Any, str]] = []
    for m, message in enumerate(messages):
        where = f"{field}[{m}]"
        if not isinstance(message, Mapping):
            raise MediaError(where, f"{where} must be a dict with 'role' and 'content', got "
                                    f"{shown(message)}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            pieces_of.append(None)
        elif isinstance(content, (list, tuple)):
            pieces = [_part(part, f"{where}.content[{p}]", model_modalities)
                      for p, part in enumerate(content)]
            images.extend(piece for piece in pieces if isinstance(piece, tuple))
            pieces_of.append(pieces)
        else:
            raise MediaError(f"{where}.content", f"{where}.content must be a string, a list of "
                                                 f"content parts or None, got {shown(content)}")
        flattened.append(dict(message))
    _check_count("image", len(images), caps, f"{field}[*].content")
    loaded = [_load(source, image_field, allowed_local_media_path, fetch, limits)
              for image_field, source, _ in images]
    for message, pieces in zip(flattened, pieces_of):
        if pieces is not None:
            message["content"] = separator.join(
                image_placeholder if isinstance(piece, tuple) else piece for piece in pieces)
    return ChatMedia(messages=flattened, images=loaded,
                     details=[piece[2] for piece in images])


def check_placeholders(prompt: str | Sequence[int], image_token: str | int, num_images: int,
                       *, field: str = "prompt") -> int:
    """Refuse a prompt whose image placeholders do not match its images one for one.

    ``prompt`` is text (``image_token`` a string, counted as non-overlapping occurrences)
    or token ids (``image_token`` the placeholder's id, before any expansion into an image's
    feature tokens). Returns the count.
    """
    if isinstance(prompt, str):
        if not isinstance(image_token, str) or not image_token:
            raise MediaError("image_token", f"image_token must be a non-empty string for a text "
                                            f"{field}, got {shown(image_token)}")
        count = prompt.count(image_token)
    else:
        if not isinstance(image_token, int) or isinstance(image_token, bool):
            raise MediaError("image_token", f"image_token must be a token id (int) for a "
                                            f"tokenized {field}, got {shown(image_token)}")
        count = sum(1 for token in prompt if token == image_token)
    if count != num_images:
        raise MediaError(field, f"{field} must hold one image placeholder {image_token!r} per "
                                f"image: it has {count} placeholder(s) for {num_images} image(s)")
    return count


def _check_modality(modality: Any, field: str, model_modalities: Collection[str]) -> None:
    if modality not in KNOWN_MODALITIES:
        raise MediaError(field, f"{field} has unknown modality {modality!r}; allowed: "
                                f"{list(SUPPORTED_MODALITIES)}")
    if modality not in SUPPORTED_MODALITIES:
        raise MediaError(field, f"{field} has modality {modality!r}, which llmlab does not "
                                f"support; allowed: {list(SUPPORTED_MODALITIES)}")
    if modality not in model_modalities:
        raise MediaError(f"{field}.{modality}", f"{field}.{modality} must be absent: this model "
                                                f"takes only {_modalities_text(model_modalities)}")


def _modalities_text(model_modalities: Collection[str]) -> str:
    return "text" if not model_modalities else f"text and {', '.join(sorted(model_modalities))}"


def _check_count(modality: str, count: int, caps: Mapping[str, int], field: str) -> None:
    cap = caps.get(modality, DEFAULT_LIMIT_PER_PROMPT)
    if count > cap:
        raise MediaError(field, f"{field} must hold at most limit_mm_per_prompt[{modality!r}] = "
                                f"{cap} {modality}(s) per prompt, got {count}")


def _part(part: Any, where: str, model_modalities: Collection[str]) -> str | tuple[str, Any, str]:
    """A content part as text, or as ``(field, image source, detail)``; structure only."""
    if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
        raise MediaError(where, f"{where} must be a dict with a 'type' in {list(PART_TYPES)}, "
                                f"got {shown(part)}")
    kind = part["type"]
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise MediaError(f"{where}.text", f"{where}.text must be a string, got {shown(text)}")
        return text
    if kind not in PART_TYPES:
        known = " (not supported by llmlab)" if kind in _OTHER_PART_TYPES else ""
        raise MediaError(f"{where}.type", f"{where}.type must be one of {list(PART_TYPES)}, got "
                                          f"{kind!r}{known}")
    if "image" not in model_modalities:
        raise MediaError(where, f"{where} must not be an image: this model takes only "
                                f"{_modalities_text(model_modalities)}")
    if kind == "image_pil":
        from PIL import Image

        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise MediaError(f"{where}.image_pil", f"{where}.image_pil must be a PIL image, got "
                                                   f"{shown(image)}")
        return (f"{where}.image_pil", image, "auto")
    image_url = part.get("image_url")
    if not isinstance(image_url, Mapping):
        raise MediaError(f"{where}.image_url", f"{where}.image_url must be a dict with a 'url', "
                                               f"got {shown(image_url)}")
    url = image_url.get("url")
    if not isinstance(url, str):
        raise MediaError(f"{where}.image_url.url",
                         f"{where}.image_url.url must be a string (a data:, file: or http(s): "
                         f"URL), got {shown(url)}")
    detail = image_url.get("detail", "auto")
    if detail is None:
        detail = "auto"
    if detail not in DETAILS:
        raise MediaError(f"{where}.image_url.detail", f"{where}.image_url.detail must be one of "
                                                      f"{list(DETAILS)}, got {shown(detail)}")
    return (f"{where}.image_url.url", url, detail)


def _load(source: Any, field: str, allowed_local_media_path, fetch, limits):
    return load_image(source, field=field, allowed_local_media_path=allowed_local_media_path,
                      fetch=fetch, limits=limits)

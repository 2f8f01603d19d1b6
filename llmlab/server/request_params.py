"""Request fields as engine arguments: the checks and conversions
:meth:`~llmlab.server.serving.OpenAIServing._params` and its callers share (chat content
parts, ``logit_bias``, the structured-output spellings, unsupported fields)."""

from __future__ import annotations

import json

from llmlab.sampling.params import StructuredOutputsParams
from llmlab.server import protocol as p
from llmlab.server.errors import APIError


def _default(value, default):
    return default if value is None else value


def _fields(request) -> tuple[str, ...]:
    return tuple(type(request).model_fields)


def _unsupported(request) -> None:
    if request.use_beam_search:
        raise APIError("use_beam_search is not supported by the server; use LLM.beam_search",
                       param="use_beam_search")


def _message_text(message: p.ChatMessageParam) -> str | None:
    content = message.content
    if content is None or isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(f"only text content parts are supported, got type {part.type!r}",
                           param="messages")
        parts.append(part.text)
    return "\n".join(parts)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        # Plain ASCII digits only: int() would also read "5_0" as 50 and "５" as 5.
        if not (key.isascii() and key.lstrip("-").isdigit()):
            raise APIError(f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                           param="logit_bias")
        out[int(key)] = value
    return out


def _structured(request) -> StructuredOutputsParams | None:
    """The one structured-output constraint of a request, from any of its spellings."""
    found: list[tuple[str, dict]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError("response_format of type json_schema needs json_schema.schema",
                           param="response_format")
        found.append(("response_format", {"json": fmt.json_schema.json_schema}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            found.append((name, {key: value}))
    if request.structured_outputs is not None:
        given = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(("structured_outputs", given))
    if not found:
        return None
    if len(found) > 1:
        raise APIError(
            f"give one structured-output constraint, got {', '.join(n for n, _ in found)}",
            param=found[1][0])
    name, kwargs = found[0]
    if "json" in kwargs and isinstance(kwargs["json"], str):
        try:
            kwargs["json"] = json.loads(kwargs["json"])
        except json.JSONDecodeError as err:
            raise APIError(f"{name}: the JSON schema is not valid JSON: {err}",
                           param=name) from None
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as err:
        raise APIError(f"{name}: {err}", param=name) from err

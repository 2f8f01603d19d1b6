"""Request fields as engine arguments: the checks and conversions
:meth:`~llmlab.entrypoints.server.serving.OpenAIServing._params` and its callers share (chat content
parts, ``logit_bias``, the structured-output spellings, unsupported fields)."""

from __future__ import annotations

import json

from llmlab.sampling.params import StructuredOutputsParams
from llmlab.entrypoints.server import protocol as p
from llmlab.entrypoints.server.errors import APIError
from llmlab.validation import MAX_JSON_DEPTH, check_encodable, check_json


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
    """The one structured-output constraint of a request, from any of its spellings.

    A JSON schema (given as an object or as JSON text) must nest at most
    ``MAX_JSON_DEPTH`` levels and hold only valid Unicode: a 400 naming the field, such as
    ``response_format.json_schema.schema``, otherwise (checked iteratively, before
    anything walks the schema recursively)."""
    found: list[tuple[str, dict]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError("response_format of type json_schema needs json_schema.schema",
                           param="response_format")
        for name in ("name", "description"):
            field = f"response_format.json_schema.{name}"
            try:
                check_encodable(field, getattr(fmt.json_schema, name) or "")
            except ValueError as err:
                raise APIError(str(err), param=field) from None
        found.append(("response_format", {"json": _checked(
            "response_format.json_schema.schema", fmt.json_schema.json_schema)}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            found.append((name, {key: _checked(name, value) if key == "json" else value}))
    if request.structured_outputs is not None:
        # the schema checked before anything walks it (model_dump would, recursively)
        given = request.structured_outputs.model_dump(by_alias=True, exclude_none=True,
                                                      exclude={"json_"})
        if request.structured_outputs.json_ is not None:
            given["json"] = _checked("structured_outputs.json",
                                     request.structured_outputs.json_)
        found.append(("structured_outputs", given))
    if not found:
        return None
    if len(found) > 1:
        raise APIError(
            f"give one structured-output constraint, got {', '.join(n for n, _ in found)}",
            param=found[1][0])
    name, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as err:
        raise APIError(f"{name}: {err}", param=name) from err


def _checked(field: str, value):
    """A request's JSON value (or JSON text, parsed) if it nests at most
    ``MAX_JSON_DEPTH`` deep and all its text is valid Unicode; else a 400 naming
    ``field`` and the limit (or the place of the bad text)."""
    if isinstance(value, str):
        try:
            check_encodable(field, value)
            # json.loads recurses: text nested past Python's limit fails, not overflows
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise APIError(f"{field}: the JSON schema is not valid JSON: {err}",
                           param=field) from None
        except RecursionError:
            raise APIError(f"{field} must nest at most {MAX_JSON_DEPTH} levels of objects "
                           f"and arrays, got more (nested deeper than {MAX_JSON_DEPTH} "
                           "levels)", param=field) from None
        except ValueError as err:
            raise APIError(str(err), param=field) from None
    try:
        return check_json(field, value)
    except ValueError as err:
        raise APIError(str(err), param=field) from None

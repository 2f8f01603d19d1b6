"""``LoRARequest``: which LoRA adapter a request runs with (vLLM's class, module path and
field names).

Plain, immutable, picklable data: it travels with the request through the scheduler into
the step contract (:class:`~llmlab.scheduler.batch.RowSetup`), so the executor learns each
row's adapter from the batch alone. Nothing here loads weights (``llmlab.lora.adapter``
does, when the request is checked).
"""

from __future__ import annotations

import hashlib
import os

import attrs

from llmlab.validation import check_encodable

# Longer names are refused: a name is echoed in every listing, log line and error, so an
# unbounded one costs every reader of those, and no adapter needs more.
MAX_LORA_NAME_CHARS = 256


def check_lora_name(value: object, field: str = "lora_name") -> str:
    """``value`` if it is a usable adapter name: a non-empty str of at most
    :data:`MAX_LORA_NAME_CHARS` characters, valid Unicode (a lone surrogate would be stored,
    then break every JSON answer that lists it). ``ValueError`` naming ``field`` otherwise;
    the message never echoes an over-long or unencodable name whole."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty str, got {value!r}")
    if len(value) > MAX_LORA_NAME_CHARS:
        raise ValueError(
            f"{field} is {len(value)} characters long; at most {MAX_LORA_NAME_CHARS} are "
            "allowed"
        )
    return check_encodable(field, str(value))


def _int_id(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"lora_int_id must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"lora_int_id must be >= 1 (0 means no adapter), got {value}")
    return int(value)


def _path(value: object) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"lora_path must be a str or path, got {type(value).__name__} {value!r}")
    return value


def _base(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"base_model_name must be a str or None, got {type(value).__name__}")
    return value


@attrs.frozen
class LoRARequest:
    """A LoRA adapter for a request (vLLM's ``vllm.lora.request.LoRARequest``).

    Attributes:
        lora_name: the adapter's name (what the server lists and a request's ``model``
            may name): at most :data:`MAX_LORA_NAME_CHARS` characters of valid Unicode.
        lora_int_id: a unique id >= 1 per adapter: the engine caches loaded adapters, and
            keys the prefix cache, by it (a different adapter needs a different id).
        lora_path: a PEFT adapter directory (``adapter_config.json`` and
            ``adapter_model.safetensors``).
        base_model_name: the model the adapter was trained for; when given, it must name
            the served model.
    """

    lora_name: str = attrs.field(converter=check_lora_name)
    lora_int_id: int = attrs.field(converter=_int_id)
    lora_path: str = attrs.field(default="", converter=_path)
    base_model_name: str | None = attrs.field(default=None, converter=_base, kw_only=True)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def hash_salt(self) -> int:
        """A 63-bit number that names this adapter's weights in the prefix cache's
        chained block hashes (the same in every process, unlike ``hash`` of a str)."""
        key = f"{self.lora_int_id}\0{self.lora_path}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1

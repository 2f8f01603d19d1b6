"""Checks for user-supplied values: right type, right range, or an error naming the field.

Each helper takes the field's name and the value, returns the value as a plain Python type
(``int``, ``float``, ``bool``, ``str``, ``list[int]``) and raises ``TypeError`` for a wrong
type or ``ValueError`` for a value out of range, with a message of the form
``"<field> must be <allowed>, got <value>"``. With ``functools.partial`` they serve as attrs
``converter=``s, so a frozen class stores the converted value.

Python's ``bool`` is an ``int`` and numpy's and torch's scalars are not, so ``isinstance``
alone gets both wrong: ``max_tokens=True`` must fail, ``max_tokens=np.int64(8)`` must work.
Integers go through ``operator.index``, which accepts exactly the integer types (and
rejects ``2.5``, which ``int()`` would truncate), with booleans of every kind refused first.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1


def _got(value: object) -> str:
    """``"float 2.5"``: the type as well as the repr, since ``'3'`` and ``3`` read alike."""
    return f"{type(value).__name__} {value!r}"


def _is_bool(value: object) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return True
    if isinstance(value, np.ndarray):
        return value.dtype == np.bool_
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


def _is_integer_array(value: np.ndarray | torch.Tensor) -> bool:
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "iu"
    return not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)


def _range_text(min: Any, max: Any, min_inclusive: bool = True, max_inclusive: bool = True) -> str:
    if min is not None and max is not None:
        return f"in {'[' if min_inclusive else '('}{min}, {max}{']' if max_inclusive else ')'}"
    if min is not None:
        return f"{'>=' if min_inclusive else '>'} {min}"
    if max is not None:
        return f"{'<=' if max_inclusive else '<'} {max}"
    return ""


def _or_none(text: str, allow_none: bool) -> str:
    return f"{text} or None" if allow_none else text


def _index(value: object) -> int | None:
    """``value`` as a Python int if it is an integer (Python, numpy or 0-d torch), else None."""
    if _is_bool(value):
        return None
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        return None  # operator.index would take any one-element tensor
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_int(
    field: str,
    value: object,
    *,
    min: int | None = None,
    max: int | None = None,
    allow_none: bool = False,
    allowed: str | None = None,
) -> int | None:
    """``value`` as an ``int`` in ``[min, max]`` (either bound optional).

    ``allowed`` replaces the generated description of the range in the error message.
    """
    if value is None and allow_none:
        return None
    converted = _index(value)
    if converted is None:
        raise TypeError(f"{field} must be {_or_none('an int', allow_none)}, got {_got(value)}")
    if (min is not None and converted < min) or (max is not None and converted > max):
        raise ValueError(f"{field} must be {allowed or _range_text(min, max)}, got {converted!r}")
    return converted


def as_seed(field: str, value: object, *, allow_none: bool = False) -> int | None:
    """A random seed: an int in ``[-2**63, 2**64)``, the range ``torch.Generator.manual_seed``
    takes (outside it torch fails deep inside a step, not here)."""
    return as_int(
        field, value, min=_INT64_MIN, max=_UINT64_MAX, allow_none=allow_none,
        allowed="an int in [-2**63, 2**64) (torch.Generator's seed range)",
    )


def as_real(
    field: str,
    value: object,
    *,
    min: float | None = None,
    max: float | None = None,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
    allow_none: bool = False,
    allowed: str | None = None,
) -> float | None:
    """``value`` as a finite ``float`` within the bounds; ints, numpy and 0-d torch numbers
    are accepted, bools, strings, NaN and infinities are not."""
    if value is None and allow_none:
        return None
    text = allowed or _range_text(min, max, min_inclusive, max_inclusive)
    is_number = isinstance(value, numbers.Real) or (
        isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex()
    )
    if _is_bool(value) or not is_number:
        kind = f"a real number {text}".rstrip()
        raise TypeError(f"{field} must be {_or_none(kind, allow_none)}, got {_got(value)}")
    finite = f"a finite number {text}".rstrip()
    try:
        converted = float(value)
    except OverflowError:  # an int too big for a float
        raise ValueError(f"{field} must be {finite}, got {value!r}") from None
    if not math.isfinite(converted):
        raise ValueError(f"{field} must be {finite}, got {converted!r}")
    too_low = min is not None and (converted < min if min_inclusive else converted <= min)
    too_high = max is not None and (converted > max if max_inclusive else converted >= max)
    if too_low or too_high:
        raise ValueError(f"{field} must be {text}, got {converted!r}")
    return converted


def as_bool(field: str, value: object, *, allow_none: bool = False) -> bool | None:
    """``value`` as a ``bool``: only ``True``/``False`` (numpy's and 0-d torch's too), never
    ``0``/``1`` or ``"false"`` (which is truthy)."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or (
        isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.bool
    ):
        return bool(value)
    kind = _or_none("a bool (True or False)", allow_none)
    raise TypeError(f"{field} must be {kind}, got {_got(value)}")


def check_encodable(field: str, text: str) -> str:
    """``text`` if it is valid Unicode (encodes as UTF-8): a lone surrogate such as
    ``"\\ud800"``, which JSON can carry, is refused naming the field and the position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{field} is not valid Unicode text: {ascii(text[err.start:err.end])} at position "
            f"{err.start} is a lone surrogate (only whole characters are allowed)"
        ) from None
    return text


def as_str(
    field: str, value: object, *, allow_none: bool = False, allow_empty: bool = True
) -> str | None:
    """``value`` as a ``str`` of valid Unicode; ``allow_empty=False`` also rejects ``""``."""
    if value is None and allow_none:
        return None
    kind = "a str" if allow_empty else "a non-empty str"
    if not isinstance(value, str):
        raise TypeError(f"{field} must be {_or_none(kind, allow_none)}, got {_got(value)}")
    if not value and not allow_empty:
        raise ValueError(f"{field} must be {_or_none(kind, allow_none)}, got {value!r}")
    return check_encodable(field, str(value))  # a str subclass becomes a plain str


def as_choice(field: str, value: object, choices: Iterable[str]) -> str:
    """``value`` as one of the strings in ``choices``."""
    choices = tuple(choices)
    listed = ", ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise TypeError(f"{field} must be one of {listed}, got {_got(value)}")
    if value not in choices:
        raise ValueError(f"{field} must be one of {listed}, got {value!r}")
    return str(value)


def as_token_ids(field: str, value: object, *, vocab_size: int | None = None) -> list[int]:
    """``value`` as a list of token ids: a list or tuple of ints (numpy and 0-d torch ints
    included), a 1-D numpy integer array or a 1-D torch integer tensor, or any other
    iterable of ints. Ids must be ``>= 0``, and ``< vocab_size`` when it is given.

    Strings, bytes, dicts and sets (which have no order) are refused whole; a bool or float
    element is refused with its index.
    """
    if isinstance(value, (str, bytes, bytearray, memoryview, Mapping, set, frozenset)) or not (
        isinstance(value, Iterable)
    ):
        raise TypeError(f"{field} must be a sequence of token ids (ints), got {_got(value)}")
    if isinstance(value, (np.ndarray, torch.Tensor)):
        if value.ndim != 1:
            shape = tuple(value.shape)
            raise TypeError(f"{field} must be a 1-D sequence of token ids, got shape {shape}")
        all_ints = _is_integer_array(value)
        value = value.tolist()  # ints stay ints; float and bool elements fail below
    else:
        value = list(value)
        all_ints = set(map(type, value)) <= {int}
    # The common case (plain ints, all in range) is checked in bulk; the loop below finds
    # the first bad element for the message, and converts numpy and torch ints.
    if all_ints and (
        not value or (min(value) >= 0 and (vocab_size is None or max(value) < vocab_size))
    ):
        return value
    token_ids = []
    for i, tok in enumerate(value):
        if type(tok) is not int:
            converted = _index(tok)
            if converted is None:
                raise TypeError(
                    f"{field} must be a sequence of token ids (ints), got {_got(tok)} at index {i}"
                )
            tok = converted
        if vocab_size is not None and not 0 <= tok < vocab_size:
            raise ValueError(
                f"{field}: token id {tok} at index {i} is outside the vocabulary [0, {vocab_size})"
            )
        if tok < 0:
            raise ValueError(f"{field}: token id {tok} at index {i} is negative (ids are >= 0)")
        token_ids.append(tok)
    return token_ids


def as_request_ids(value: object) -> set[str]:
    """One request id, or an iterable of them, as a set (``TypeError`` for a non-str id)."""
    if isinstance(value, str):
        return {value}
    ids = set(value)
    bad = [i for i in ids if not isinstance(i, str)]
    if bad:
        raise TypeError(f"request ids must be str, got {bad[0]!r}")
    return ids


class FrozenDict(dict):
    """A ``dict`` that refuses changes: what frozen parameters hold where a mapping is
    given (``logit_bias``, a JSON schema), so data handed to executors stays read-only.
    Equal to, and serialized as, the plain dict; pickles as one."""

    __slots__ = ()

    def _refuse(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse
    __ior__ = _refuse

    def __reduce__(self):
        return (type(self), (dict(self),))

    def __hash__(self):  # type: ignore[override]
        return hash(frozenset(self.items()))


MAX_JSON_DEPTH = 64
"""How deep a client's JSON value (a schema, a tool, template arguments) may nest: 64
levels of objects and arrays, far more than a real schema uses, and few enough that
nothing that walks it (the grammar compiler, ``json.dumps``, a chat template) overflows."""


def json_field(field: str, key: object) -> str:
    """The name of a member of the JSON value ``field``: ``field.key`` for an identifier
    key, ``field["key"]`` (ASCII-escaped) for another, ``field[i]`` for an index."""
    if isinstance(key, int):
        return f"{field}[{key}]"
    if isinstance(key, str) and key.isidentifier() and key.isascii():
        return f"{field}.{key}"
    return f"{field}[{ascii(key)}]"


def _json_path(field: str, link: tuple | None) -> str:
    """``field`` and the keys of a :func:`check_json` link chain (parent link, key)."""
    keys = []
    while link is not None:
        link, key = link
        keys.append(key)
    for key in reversed(keys):
        field = json_field(field, key)
    return field


def check_json(field: str, value: object, *, max_depth: int = MAX_JSON_DEPTH) -> object:
    """``value`` (a JSON value: mappings, lists or tuples, and scalars) if it nests at
    most ``max_depth`` objects and arrays deep and every string in it, object keys
    included, is valid Unicode (:func:`check_encodable`); else ``ValueError`` naming
    ``field``: with the limit for a value nested too deep, with the place inside
    (``field.properties.city.description``) for a string that is not text.

    The walk is iterative, so no depth makes it overflow Python's stack; a nested value
    it visits twice (shared, or a cycle) counts each time, and a cycle is simply too deep.
    """
    # (value, depth of the container holding it, link to it: (parent link, key) or None)
    stack: list[tuple[object, int, tuple | None]] = [(value, 0, None)]
    while stack:
        item, depth, link = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                check_encodable(_json_path(field, link), item)
            continue
        if isinstance(item, Mapping):
            children = item.items()
        elif isinstance(item, (list, tuple)):
            children = enumerate(item)
        else:
            continue
        if depth >= max_depth:
            raise ValueError(
                f"{field} must nest at most {max_depth} levels of objects and arrays, got "
                f"more (nested deeper than {max_depth} levels)")
        for key, child in children:
            if isinstance(key, str) and not key.isascii():
                check_encodable(_json_path(field, (link, key)), key)
            stack.append((child, depth + 1, (link, key)))
    return value


def freeze_json(value: object) -> object:
    """A JSON value with every object as a :class:`FrozenDict` and every array a tuple.

    Iterative (children are frozen before their parents from an explicit stack), so a
    value of any depth freezes without ``RecursionError``; a value that contains itself
    is a ``ValueError``."""
    if not isinstance(value, (dict, list)):
        return value
    frozen: dict[int, object] = {}  # id of a container -> its frozen copy
    open_: set[int] = set()  # the containers whose children are being frozen
    stack: list[tuple[object, bool]] = [(value, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_.discard(key)
            if isinstance(node, dict):
                frozen[key] = FrozenDict(
                    {k: frozen.get(id(v), v) if isinstance(v, (dict, list)) else v
                     for k, v in node.items()})
            else:
                frozen[key] = tuple(frozen.get(id(v), v) if isinstance(v, (dict, list)) else v
                                    for v in node)
            continue
        if key in frozen:
            continue  # the same object met again (shared): frozen once
        if key in open_:
            raise ValueError("a JSON value cannot contain itself, got a cycle")
        open_.add(key)
        stack.append((node, True))
        children = node.values() if isinstance(node, dict) else node
        stack.extend((v, False) for v in children if isinstance(v, (dict, list)))
    return frozen[id(value)]


def check_budget(value: object, field: str = "kv_budget") -> float:
    """``value`` as a kept fraction in (0, 1] (a KV press's budget), or ``ValueError``
    naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(
            f"{field} must be a number in (0, 1] (the fraction of the context kept), "
            f"got {value!r}"
        )
    return float(value)

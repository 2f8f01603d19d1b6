"""The shared checks: plain Python values out, errors naming field, value and index."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from llmlab.validation import as_bool, as_choice, as_int, as_real, as_str, as_token_ids


@pytest.mark.parametrize(
    "value",
    [
        [1, 2, 3],
        (1, 2, 3),
        np.array([1, 2, 3]),
        np.array([1, 2, 3], dtype=np.uint16),
        torch.tensor([1, 2, 3]),
        torch.tensor([1, 2, 3], dtype=torch.int32),
        [np.int64(1), torch.tensor(2), 3],
        range(1, 4),
    ],
    ids=lambda v: type(v).__name__,
)
def test_token_ids_accept_int_sequences_arrays_and_tensors(value):
    ids = as_token_ids("prompt_token_ids", value, vocab_size=10)
    assert ids == [1, 2, 3] and all(type(t) is int for t in ids)


@pytest.mark.parametrize(
    "value, message",
    [
        ("hello", "prompt_token_ids must be a sequence of token ids (ints), got str 'hello'"),
        (b"\x01\x02", "got bytes b'\\x01\\x02'"),
        (bytearray(b"\x01"), "got bytearray bytearray(b'\\x01')"),
        ({1: 2}, "got dict {1: 2}"),
        ({1, 2}, "got set {1, 2}"),
        (None, "got NoneType None"),
        (5, "got int 5"),
        ([1, True], "must be a sequence of token ids (ints), got bool True at index 1"),
        ([1, np.True_], f"got bool {np.True_!r} at index 1"),
        ([1, 2, 3.0], "got float 3.0 at index 2"),
        ([np.float32(1.5)], f"got float32 {np.float32(1.5)!r} at index 0"),
        (["1"], "got str '1' at index 0"),
        ([torch.tensor([1])], "got Tensor tensor([1]) at index 0"),
        (np.array([1.0, 2.0]), "got float 1.0 at index 0"),
        (np.array([True]), "got bool True at index 0"),
        (torch.tensor([0.5]), "got float 0.5 at index 0"),
        (torch.tensor([[1, 2]]), "must be a 1-D sequence of token ids, got shape (1, 2)"),
        (np.array(3), "shape ()"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_token_ids_refuse_non_integers_with_the_element_and_its_index(value, message):
    with pytest.raises(TypeError) as info:
        as_token_ids("prompt_token_ids", value)
    assert message in str(info.value)
    assert str(info.value).startswith("prompt_token_ids")


def test_token_ids_outside_the_vocabulary_name_the_id_and_index():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "prompt_token_ids: token id 1000000 at index 2 is outside the vocabulary [0, 32000)"
        ),
    ):
        as_token_ids("prompt_token_ids", [1, 2, 10**6], vocab_size=32000)
    with pytest.raises(ValueError, match=r"token id -1 at index 1 is outside the vocabulary"):
        as_token_ids("prompt_token_ids", np.array([1, -1]), vocab_size=32000)
    with pytest.raises(ValueError, match=r"stop_token_ids: token id -3 at index 0 is negative"):
        as_token_ids("stop_token_ids", [-3])
    assert as_token_ids("x", [31999, 0], vocab_size=32000) == [31999, 0]
    assert as_token_ids("x", [10**6]) == [10**6]  # no vocabulary given: no upper bound
    assert as_token_ids("x", []) == []


def test_as_int_takes_integers_of_every_library_but_never_bools_or_floats():
    assert as_int("n", np.uint8(7)) == 7 and type(as_int("n", np.uint8(7))) is int
    assert as_int("n", torch.tensor(7)) == 7
    assert as_int("n", None, allow_none=True) is None
    for bad in (True, np.True_, torch.tensor(True), 2.5, 3.0, np.float64(3), "3", None,
                torch.tensor([3])):
        with pytest.raises(TypeError, match=r"^n must be an int, got "):
            as_int("n", bad)
    with pytest.raises(ValueError, match=re.escape("n must be in [1, 4], got 5")):
        as_int("n", 5, min=1, max=4)
    with pytest.raises(ValueError, match=re.escape("n must be <= 4, got 5")):
        as_int("n", 5, max=4)
    with pytest.raises(ValueError, match=re.escape("n must be a power of two, got 5")):
        as_int("n", 5, max=4, allowed="a power of two")


def test_as_real_takes_finite_numbers_only():
    assert as_real("x", 1) == 1.0 and type(as_real("x", 1)) is float
    assert as_real("x", np.float16(0.5)) == 0.5
    assert as_real("x", torch.tensor(0.25)) == 0.25
    assert as_real("x", None, allow_none=True) is None
    for bad in (True, np.False_, "1.0", None, 1j, torch.tensor([1.0])):
        with pytest.raises(TypeError, match=r"^x must be a real number"):
            as_real("x", bad)
    for bad in (math.nan, math.inf, -math.inf, np.float32("nan"), 10**400):
        with pytest.raises(ValueError, match=r"^x must be a finite number"):
            as_real("x", bad)
    with pytest.raises(ValueError, match=re.escape("x must be in (0, 1), got 1.0")):
        as_real("x", 1, min=0, max=1, min_inclusive=False, max_inclusive=False)
    with pytest.raises(ValueError, match=re.escape("x must be > 0, got 0.0")):
        as_real("x", 0, min=0, min_inclusive=False)


def test_as_bool_as_str_and_as_choice():
    assert as_bool("flag", np.True_) is True
    assert as_bool("flag", torch.tensor(False)) is False
    assert as_bool("flag", None, allow_none=True) is None
    for bad in (0, 1, "True", None, torch.tensor([True])):
        with pytest.raises(TypeError, match=r"^flag must be a bool \(True or False\), got "):
            as_bool("flag", bad)
    assert as_str("name", "x") == "x" and as_str("name", None, allow_none=True) is None
    with pytest.raises(ValueError, match="name must be a non-empty str, got ''"):
        as_str("name", "", allow_empty=False)
    with pytest.raises(TypeError, match="name must be a str or None, got int 3"):
        as_str("name", 3, allow_none=True)
    assert as_choice("mode", "b", ("a", "b")) == "b"
    with pytest.raises(ValueError, match="mode must be one of 'a', 'b', got 'c'"):
        as_choice("mode", "c", ("a", "b"))
    with pytest.raises(TypeError, match="mode must be one of 'a', 'b', got NoneType None"):
        as_choice("mode", None, ("a", "b"))


def _nested(levels: int) -> dict:
    """A JSON value ``levels`` objects and arrays deep (built without recursion)."""
    value: object = "leaf"
    for i in range(levels):
        value = {"a": value} if i % 2 else [value]
    return value


def test_check_json_bounds_depth_iteratively_and_names_the_field():
    from llmlab.validation import MAX_JSON_DEPTH, check_json

    ok = _nested(MAX_JSON_DEPTH)
    assert check_json("schema", ok) is ok
    for levels in (MAX_JSON_DEPTH + 1, 500, 100_000):  # far past Python's recursion limit
        with pytest.raises(ValueError, match=r"^schema must nest at most 64 levels of "
                                             r"objects and arrays, got more"):
            check_json("schema", _nested(levels))
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="at most 64 levels"):
        check_json("x", cycle)
    assert check_json("x", _nested(3), max_depth=3) and check_json("x", 5, max_depth=0) == 5


def test_check_json_finds_a_lone_surrogate_anywhere_and_says_where():
    from llmlab.validation import check_json

    assert check_json("t", {"d\u00e9j\u00e0": ["\u00e9t\u00e9", 1, None, {"k": "\U0001f600"}]})
    for value, where in [
        ("a\ud800", "t"),
        ({"properties": {"city": {"description": "x\udfff"}}},
         "t.properties.city.description"),
        ({"enum": ["ok", "\ud800"]}, "t.enum[1]"),
        ({"properties": {"\ud800": {}}}, "t.properties['\\ud800']"),
        ({"a b": ["\ud800"]}, "t['a b'][0]"),
    ]:
        with pytest.raises(ValueError) as err:
            check_json("t", value)
        assert str(err.value).startswith(f"{where} is not valid Unicode text: '\\ud800'"
                                          if "ud800" in repr(value) else
                                          f"{where} is not valid Unicode text: '\\udfff'")


def test_freeze_json_has_no_depth_limit():
    from llmlab.validation import FrozenDict, freeze_json

    frozen = freeze_json({"a": [1, {"b": [2, 3]}], "c": "d"})
    assert frozen == {"a": (1, {"b": (2, 3)}), "c": "d"}
    assert isinstance(frozen, FrozenDict) and isinstance(frozen["a"][1], FrozenDict)
    shared = {"x": 1}
    both = freeze_json([shared, shared])
    assert both == ({"x": 1}, {"x": 1}) and both[0] is both[1]
    deep = freeze_json(_nested(100_000))  # the recursive version raised RecursionError
    for _ in range(100_000):
        deep = deep["a"] if isinstance(deep, FrozenDict) else deep[0]
    assert deep == "leaf"
    cycle: dict = {}
    cycle["self"] = cycle
    with pytest.raises(ValueError, match="cannot contain itself"):
        freeze_json(cycle)


def test_structured_outputs_json_of_any_depth_is_a_value_error_through_the_python_api():
    """Deep schemas reach SamplingParams without the server too: a ValueError naming the
    field, never a RecursionError (dict, or JSON text past the parser's own limit)."""
    from llmlab.sampling.params import StructuredOutputsParams

    deep: dict = {}
    inner = deep
    for _ in range(5000):
        inner["a"] = {}
        inner = inner["a"]
    for value in (deep, "[" * 3000 + "]" * 3000, "[" * 300 + "]" * 300):
        with pytest.raises(ValueError, match="structured_outputs.json"):
            StructuredOutputsParams(json=value)

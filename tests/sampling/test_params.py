"""SamplingParams: every field type- and range-checked at construction, errors naming it."""

from __future__ import annotations

import logging
import math
import re

import attrs
import numpy as np
import pytest
import torch

from llmlab.sampling.params import RequestOutputKind, SamplingParams

# (field, bad value, exception, text the message must contain besides the field name)
BAD = [
    # temperature: real >= 0
    ("temperature", -0.1, ValueError, "-0.1"),
    ("temperature", math.nan, ValueError, "nan"),
    ("temperature", math.inf, ValueError, "inf"),
    ("temperature", True, TypeError, "True"),
    ("temperature", "0.7", TypeError, "'0.7'"),
    ("temperature", None, TypeError, "None"),
    # top_p: real in (0, 1]
    ("top_p", 0.0, ValueError, "0.0"),
    ("top_p", 0, ValueError, "0.0"),
    ("top_p", 1.5, ValueError, "1.5"),
    ("top_p", -math.inf, ValueError, "-inf"),
    ("top_p", np.float64(math.nan), ValueError, "nan"),
    ("top_p", False, TypeError, "False"),
    ("top_p", None, TypeError, "None"),
    ("top_p", "1", TypeError, "'1'"),
    # top_k: int, -1 or >= 0
    ("top_k", -2, ValueError, "-2"),
    ("top_k", 2.0, TypeError, "2.0"),
    ("top_k", True, TypeError, "True"),
    ("top_k", np.True_, TypeError, "True"),
    ("top_k", "5", TypeError, "'5'"),
    ("top_k", None, TypeError, "None"),
    # min_p: real in [0, 1]
    ("min_p", -0.01, ValueError, "-0.01"),
    ("min_p", 1.01, ValueError, "1.01"),
    ("min_p", math.nan, ValueError, "nan"),
    ("min_p", True, TypeError, "True"),
    ("min_p", None, TypeError, "None"),
    # seed: None or an int in [-2**63, 2**64)
    ("seed", 2**64, ValueError, str(2**64)),
    ("seed", -(2**63) - 1, ValueError, str(-(2**63) - 1)),
    ("seed", 1.0, TypeError, "1.0"),
    ("seed", True, TypeError, "True"),
    ("seed", "42", TypeError, "'42'"),
    # max_tokens: None or int >= 1
    ("max_tokens", 0, ValueError, "0"),
    ("max_tokens", -5, ValueError, "-5"),
    ("max_tokens", 2.5, TypeError, "2.5"),
    ("max_tokens", 3.0, TypeError, "3.0"),
    ("max_tokens", np.float32(4.0), TypeError, "4.0"),
    ("max_tokens", torch.tensor(4.0), TypeError, "4."),
    ("max_tokens", torch.tensor([4]), TypeError, "tensor([4])"),
    ("max_tokens", True, TypeError, "True"),
    ("max_tokens", "16", TypeError, "'16'"),
    # min_tokens: int >= 0
    ("min_tokens", -1, ValueError, "-1"),
    ("min_tokens", 1.5, TypeError, "1.5"),
    ("min_tokens", None, TypeError, "None"),
    ("min_tokens", False, TypeError, "False"),
    # stop_token_ids: None or an iterable of non-negative ints
    ("stop_token_ids", "2", TypeError, "'2'"),
    ("stop_token_ids", b"\x02", TypeError, "b'\\x02'"),
    ("stop_token_ids", 2, TypeError, "2"),
    ("stop_token_ids", {2: 3}, TypeError, "{2: 3}"),
    ("stop_token_ids", [2, -1], ValueError, "-1"),
    ("stop_token_ids", [2, 3.0], TypeError, "3.0"),
    ("stop_token_ids", [True], TypeError, "True"),
    ("stop_token_ids", [2, None], TypeError, "None"),
    ("stop_token_ids", np.array([1.0, 2.0]), TypeError, "1.0"),
    ("stop_token_ids", torch.tensor([[1, 2]]), TypeError, "(1, 2)"),
    # bools
    ("ignore_eos", 1, TypeError, "1"),
    ("ignore_eos", "false", TypeError, "'false'"),
    ("ignore_eos", None, TypeError, "None"),
    ("skip_special_tokens", 0, TypeError, "0"),
    ("skip_special_tokens", "yes", TypeError, "'yes'"),
    # n, best_of: ints >= 1
    ("n", 0, ValueError, "0"),
    ("n", 2.0, TypeError, "2.0"),
    ("best_of", 0, ValueError, "0"),
    # penalties: presence / frequency in [-2, 2], repetition in (0, 2]
    ("presence_penalty", 2.5, ValueError, "2.5"),
    ("frequency_penalty", -3, ValueError, "-3"),
    ("frequency_penalty", math.nan, ValueError, "nan"),
    ("repetition_penalty", 0, ValueError, "0.0"),
    ("repetition_penalty", 2.5, ValueError, "2.5"),
    ("repetition_penalty", "1.1", TypeError, "'1.1'"),
    # stop strings and bad words: non-empty strings
    ("stop", "", ValueError, "empty"),
    ("stop", ["ok", ""], ValueError, "stop[1]"),
    ("stop", ["ok", 3], TypeError, "3"),
    ("stop", 3, TypeError, "3"),
    ("bad_words", [""], ValueError, "empty"),
    # logprobs
    ("logprobs", -2, ValueError, "-2"),
    ("logprobs", 2.0, TypeError, "2.0"),
    ("prompt_logprobs", -2, ValueError, "-2"),
    # token-id fields
    ("allowed_token_ids", [], ValueError, "empty"),
    ("allowed_token_ids", [-1], ValueError, "-1"),
    ("logit_bias", [1, 2], TypeError, "[1, 2]"),
    ("logit_bias", {1: 200}, ValueError, "200"),
    ("truncate_prompt_tokens", 0, ValueError, "0"),
    ("truncate_prompt_tokens", -2, ValueError, "-2"),
    ("logits_processors", lambda ids, logits: logits, TypeError, "list of callables"),
    ("logits_processors", [1], TypeError, "1"),
    ("logits_processors", [lambda logits: logits], ValueError, "1 positional"),
    ("detokenize", 1, TypeError, "1"),
    ("include_stop_str_in_output", "no", TypeError, "'no'"),
    ("spaces_between_special_tokens", None, TypeError, "None"),
    ("structured_outputs", "json", TypeError, "'json'"),
    # output_kind
    ("output_kind", 0, TypeError, "0"),
    ("output_kind", "CUMULATIVE", TypeError, "'CUMULATIVE'"),
    ("output_kind", None, TypeError, "None"),
]


@pytest.mark.parametrize("field, value, error, shown", BAD, ids=lambda v: re.sub(" at 0x[0-9a-f]+", "", repr(v))[:30])
def test_bad_value_is_rejected_with_a_message_naming_field_and_value(field, value, error, shown):
    with pytest.raises(error) as info:
        SamplingParams(**{field: value})
    assert type(info.value) is error  # a TypeError is not a ValueError, nor the reverse
    message = str(info.value)
    assert message.startswith(field), message
    assert shown in message, message


@pytest.mark.parametrize(
    "field, value, stored",
    [
        ("temperature", 0, 0.0),
        ("temperature", 2, 2.0),
        ("temperature", np.float32(0.5), 0.5),
        ("temperature", 1e-2, 1e-2),
        ("top_p", 1, 1.0),
        ("top_p", np.float64(0.9), 0.9),
        ("top_k", -1, -1),
        ("top_k", 0, 0),
        ("top_k", 10**9, 10**9),  # the sampler clamps it to the vocabulary
        ("top_k", np.int64(20), 20),
        ("top_k", torch.tensor(20), 20),
        ("min_p", 0, 0.0),
        ("min_p", 1, 1.0),
        ("seed", None, None),
        ("seed", -(2**63), -(2**63)),
        ("seed", 2**64 - 1, 2**64 - 1),
        ("seed", np.uint64(2**64 - 1), 2**64 - 1),
        ("seed", torch.tensor(7, dtype=torch.int32), 7),
        ("max_tokens", None, None),
        ("max_tokens", np.int32(8), 8),
        ("max_tokens", torch.tensor(8), 8),
        ("min_tokens", np.int8(3), 3),
        ("stop_token_ids", None, []),
        ("stop_token_ids", [2, np.int64(3), torch.tensor(4)], [2, 3, 4]),
        ("stop_token_ids", np.array([5, 6], dtype=np.int32), [5, 6]),
        ("stop_token_ids", torch.tensor([7, 8]), [7, 8]),
        ("stop_token_ids", (i for i in (9, 10)), [9, 10]),
        ("stop_token_ids", {11}, [11]),
        ("ignore_eos", np.True_, True),
        ("skip_special_tokens", False, False),
        ("output_kind", RequestOutputKind.FINAL_ONLY, RequestOutputKind.FINAL_ONLY),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_good_value_is_stored_as_a_plain_python_value(field, value, stored):
    got = getattr(SamplingParams(**{field: value}), field)
    assert got == stored
    assert type(got) is type(stored)
    if isinstance(got, tuple):
        assert all(type(t) is int for t in got)


def test_float_max_tokens_is_refused_rather_than_rounded():
    message = "max_tokens must be an int or None, got float 2.5"
    with pytest.raises(TypeError, match=re.escape(message)):
        SamplingParams(max_tokens=2.5)


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(ValueError, match=re.escape("min_tokens must be <= max_tokens (2), got 5")):
        SamplingParams(min_tokens=5, max_tokens=2)
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5


def test_messages_keep_the_field_must_be_allowed_got_value_shape():
    cases = [
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (dict(top_p=2), "top_p must be in (0, 1], got 2.0"),
        (dict(temperature=-1.0), "temperature must be >= 0 (0 means greedy), got -1.0"),
        (dict(min_p=2.0), "min_p must be in [0, 1], got 2.0"),
        (dict(top_k=-3), "top_k must be -1 or 0 (disabled) or a positive integer, got -3"),
        (
            dict(seed=2**64),
            ("seed must be an int in [-2**63, 2**64) (torch.Generator's seed range), "
             f"got {2**64}"),
        ),
        (dict(ignore_eos=1), "ignore_eos must be a bool (True or False), got int 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises((TypeError, ValueError)) as info:
            SamplingParams(**kwargs)
        assert str(info.value) == message


def test_out_of_vocabulary_stop_ids_are_left_to_the_engine():
    # SamplingParams does not know the vocabulary; the engine checks at add_request.
    assert SamplingParams(stop_token_ids=[10**6]).stop_token_ids == [10**6]


@pytest.mark.parametrize("tiny", [1e-3, 1e-8, 5e-324, np.float32(1e-3)])
def test_tiny_positive_temperature_is_raised_to_one_hundredth_with_a_warning(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="llmlab.sampling.params"):
        params = SamplingParams(temperature=tiny)
    assert params.temperature == 1e-2 and not params.greedy
    assert any(
        r.levelno == logging.WARNING and repr(float(tiny)) in r.getMessage() for r in caplog.records
    ), caplog.records


def test_zero_and_ordinary_temperatures_do_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="llmlab.sampling.params"):
        assert SamplingParams(temperature=0).greedy
        assert SamplingParams(temperature=0.7).temperature == 0.7
        assert SamplingParams(temperature=1e-2).temperature == 1e-2
    assert not caplog.records


def test_defaults_are_vllms():
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert (params.seed, params.max_tokens, params.min_tokens) == (None, 16, 0)
    assert params.stop_token_ids == [] and not params.ignore_eos and params.skip_special_tokens
    assert params.output_kind is RequestOutputKind.CUMULATIVE


def test_evolve_revalidates_and_keeps_converted_values():
    params = SamplingParams(top_k=np.int64(5), stop_token_ids=np.array([1, 2]))
    assert attrs.evolve(params, seed=3) == SamplingParams(top_k=5, stop_token_ids=(1, 2), seed=3)
    with pytest.raises(ValueError, match="top_p"):
        attrs.evolve(params, top_p=0)
    params.top_k = np.int64(3)  # mutable, as vLLM's; converted like construction
    assert params.top_k == 3 and type(params.top_k) is int


def test_params_compare_by_value():
    # Mutable (vLLM's), so not hashable; equal by value.
    a = SamplingParams(stop_token_ids=[1, 2], seed=np.int64(4))
    b = SamplingParams(stop_token_ids=(1, 2), seed=4)
    assert a == b


def test_best_of_below_n_names_both():
    with pytest.raises(ValueError, match=r"best_of must be >= n \(3\), got 2"):
        SamplingParams(n=3, best_of=2)
    assert SamplingParams(n=2, best_of=4).num_samples == 4
    assert SamplingParams(n=3).num_samples == 3


def test_structured_outputs_takes_exactly_one_kind_and_the_old_spelling():
    from llmlab.sampling.params import GuidedDecodingParams, StructuredOutputsParams

    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs.choice must list at least one"):
        StructuredOutputsParams(choice=[])
    old = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a", "b"]))
    assert old.structured_outputs.kind == "choice" and old.guided_decoding is old.structured_outputs
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="a"),
                       structured_outputs=StructuredOutputsParams(regex="b"))
    as_dict = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert as_dict.structured_outputs.regex == "[0-9]+"


def test_new_fields_have_vllms_defaults_and_conversions():
    p = SamplingParams(stop="###", logit_bias={"7": 1.5}, allowed_token_ids=[3, 3, 4])
    assert p.stop == ["###"] and p.logit_bias == {7: 1.5} and p.allowed_token_ids == [3, 4]
    d = SamplingParams()
    assert (d.n, d.best_of, d.presence_penalty, d.frequency_penalty, d.repetition_penalty) == (
        1, None, 0.0, 0.0, 1.0
    )
    assert (d.logprobs, d.prompt_logprobs, d.detokenize, d.spaces_between_special_tokens) == (
        None, None, True, True
    )
    assert d.stop == [] and d.bad_words == [] and d.truncate_prompt_tokens is None


def test_clone_copies_stateful_processors_and_from_optional_skips_nones():
    class Counter:
        def __init__(self):
            self.calls = 0

        def __call__(self, ids, logits):
            self.calls += 1
            return logits

    p = SamplingParams(logits_processors=[Counter()])
    q = p.clone()
    assert q.logits_processors[0] is not p.logits_processors[0]
    q.logits_processors[0]([], None)
    assert p.logits_processors[0].calls == 0
    r = SamplingParams.from_optional(temperature=None, top_p=0.5, max_tokens=None, n=None)
    assert (r.temperature, r.top_p, r.max_tokens, r.n) == (1.0, 0.5, None, 1)


def test_a_huge_temperature_is_lowered_to_one_the_float32_columns_hold():
    """1e308 is finite in Python but inf in the executor's float32 columns (and masked
    logits / inf are NaN): it is lowered, as a tiny one is raised."""
    from llmlab.sampling.params import MAX_TEMPERATURE

    assert SamplingParams(temperature=1e308).temperature == MAX_TEMPERATURE
    assert SamplingParams(temperature=2.0).temperature == 2.0

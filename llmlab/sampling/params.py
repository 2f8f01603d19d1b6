"""``SamplingParams``: how one request's tokens are chosen and when it stops (vLLM names).

Every field of vLLM's documented ``SamplingParams`` is here with vLLM's meaning and default,
checked at construction (a ``TypeError`` or ``ValueError`` naming the field, the value and
what is allowed). Structured outputs are described by :class:`StructuredOutputsParams`
(vLLM's older spelling :class:`GuidedDecodingParams` is accepted too); whether a schema or
regex compiles is checked when the engine accepts the request, since that needs the
tokenizer.
"""

from __future__ import annotations

import copy
import enum
import functools
import inspect
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from llmlab.validation import (
    FrozenDict,
    check_json,
    as_bool,
    as_int,
    as_real,
    as_seed,
    as_str,
    as_token_ids,
    check_budget,
    check_encodable,
    freeze_json,
)


class RequestOutputKind(enum.Enum):
    """What ``Engine.step`` reports for a request (vLLM's values).

    CUMULATIVE: everything so far, every step. DELTA: only what is new since the last
    report (text and tokens), every step. FINAL_ONLY: nothing until it finishes.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


logger = logging.getLogger(__name__)

# Below this, logits / temperature overflows to inf and softmax gives NaN (vLLM's _MAX_TEMP
# guard): such a temperature is raised to this one, which is already all but greedy.
MIN_TEMPERATURE = 1e-2
# Above this, the per-row float32 columns would hold inf (and masked logits / inf = NaN):
# such a temperature is lowered to this one, which already samples all but uniformly.
MAX_TEMPERATURE = 1e6

_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _temperature(value: object) -> float:
    t = as_real("temperature", value, min=0, allowed=">= 0 (0 means greedy)")
    if 0 < t < MIN_TEMPERATURE:
        logger.warning(
            "temperature=%r is below %r and would overflow the logits; using %r",
            t, MIN_TEMPERATURE, MIN_TEMPERATURE,
        )
        return MIN_TEMPERATURE
    if t > MAX_TEMPERATURE:
        logger.warning("temperature=%r is above %r; using %r", t, MAX_TEMPERATURE,
                       MAX_TEMPERATURE)
        return MAX_TEMPERATURE
    return t


def _stop_token_ids(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (set, frozenset)):
        value = list(value)  # order does not matter for stop ids, unlike for a prompt
    return list(as_token_ids("stop_token_ids", value))


def _string_list(field: str, value: object) -> list[str]:
    """None, one string, or a sequence of non-empty strings, as a new list (vLLM's type)."""
    return list(_strings(field, value))


def _strings(field: str, value: object) -> tuple[str, ...]:
    """None, one string, or a sequence of non-empty strings, as a tuple."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Sequence):
        raise TypeError(
            f"{field} must be a str, a list of str or None, got {type(value).__name__} {value!r}"
        )
    out = []
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise TypeError(f"{field}[{i}] must be a str, got {type(s).__name__} {s!r}")
        if not s:
            raise ValueError(f"{field}[{i}] is an empty string; each entry must be non-empty")
        out.append(check_encodable(f"{field}[{i}]", str(s)))
    return tuple(out)


def _allowed_token_ids(value: object) -> list[int] | None:
    if value is None:
        return None
    ids = as_token_ids("allowed_token_ids", value)
    if not ids:
        raise ValueError("allowed_token_ids must not be empty (None allows every token)")
    return list(dict.fromkeys(ids))


def _bias_item(key: object, value: object) -> tuple[int, float]:
    # The OpenAI API sends token ids as JSON object keys, i.e. strings.
    plain = isinstance(key, str) and key.isascii() and key.lstrip("-").isdigit()
    tok = int(key) if plain else key
    tok = as_int("logit_bias key", tok, min=0, allowed="a token id >= 0")
    return tok, as_real(f"logit_bias[{tok}]", value, min=-100, max=100)


class LogitBias(dict):
    """``SamplingParams.logit_bias``: a plain ``dict`` (vLLM code mutates it) whose every
    change is checked as construction checks it; a bad item raises naming it and changes
    nothing. The engine's snapshot holds a read-only copy."""

    __slots__ = ()

    def __init__(self, items: Mapping = ()) -> None:
        super().__init__(_bias_item(k, v) for k, v in dict(items).items())

    def __setitem__(self, key: object, value: object) -> None:
        super().__setitem__(*_bias_item(key, value))

    def setdefault(self, key: object, default: object = None) -> float:
        tok, bias = _bias_item(key, default)
        if tok not in self:
            super().__setitem__(tok, bias)
        return self[tok]

    def update(self, *args: Any, **kwargs: Any) -> None:
        checked = dict(_bias_item(k, v) for k, v in dict(*args, **kwargs).items())
        super().update(checked)

    def __ior__(self, other: Mapping) -> LogitBias:
        self.update(other)
        return self

    def copy(self) -> LogitBias:
        return LogitBias(self)

    def __reduce__(self):
        return (type(self), (dict(self),))


def _extra_args(value: object) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"extra_args must be a dict or None, got {type(value).__name__} {value!r}")
    value = dict(value)
    if "kv_budget" in value:
        value["kv_budget"] = check_budget(value["kv_budget"], "extra_args['kv_budget']")
    if "kv_press" in value and not isinstance(value["kv_press"], bool):
        raise ValueError(
            f"extra_args['kv_press'] must be a bool (False: this request's KV is never "
            f"compressed), got {value['kv_press']!r}"
        )
    return value


def _logit_bias(value: object) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(
            f"logit_bias must be a dict {{token_id: bias}}, got {type(value).__name__} {value!r}"
        )
    return LogitBias(value)


def _logprobs(field: str, value: object) -> int | None:
    return as_int(
        field, value, min=-1, allow_none=True,
        allowed="None, an int >= 0, or -1 (the whole vocabulary)",
    )


def _truncate_prompt_tokens(value: object) -> int | None:
    t = as_int(
        "truncate_prompt_tokens", value, min=-1, allow_none=True,
        allowed="None, -1 (max_model_len) or an int >= 1",
    )
    if t == 0:
        raise ValueError(
            "truncate_prompt_tokens must be None, -1 (max_model_len) or an int >= 1, got 0"
        )
    return t


def _logits_processors(value: object) -> list[Callable]:
    if value is None:
        return []
    if callable(value) or not isinstance(value, Sequence):
        raise TypeError(
            "logits_processors must be a list of callables "
            f"fn([prompt_token_ids,] output_token_ids, logits) -> logits, got {value!r}"
        )
    for i, fn in enumerate(value):
        if not callable(fn):
            raise TypeError(f"logits_processors[{i}] must be callable, got {fn!r}")
        arity = _positional_arity(fn)
        if arity is not None and arity not in (2, 3):
            raise ValueError(
                f"logits_processors[{i}] takes {arity} positional arguments; allowed: 2 "
                "(output_token_ids, logits) or 3 (prompt_token_ids, output_token_ids, logits)"
            )
    return list(value)


def _positional_arity(fn: Callable) -> int | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [p for p in sig.parameters.values() if p.kind in kinds]
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values()):
        return None
    return len(params)


def _output_kind(value: object) -> RequestOutputKind:
    if not isinstance(value, RequestOutputKind):
        kinds = ", ".join(f"RequestOutputKind.{k.name}" for k in RequestOutputKind)
        raise TypeError(f"output_kind must be one of {kinds}, got {type(value).__name__} {value!r}")
    return value


# Deep enough for any schema the server passes on (its clients' are bounded at
# MAX_JSON_DEPTH; tool constraints wrap them a few levels deeper), shallow enough that
# nothing downstream (json.dumps, the grammar compiler) recurses past Python's limit.
_MAX_SCHEMA_DEPTH = 256


def _json_schema(value: object) -> str | dict | None:
    if value is None:
        return None
    if isinstance(value, str):
        check_encodable("structured_outputs.json", value)
        try:
            parsed = json.loads(value)
        except RecursionError:
            raise ValueError("structured_outputs.json nests too deeply to parse") from None
        except ValueError as err:
            raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
        check_json("structured_outputs.json", parsed, max_depth=_MAX_SCHEMA_DEPTH)
        return value
    # Frozen (read-only mappings, arrays as tuples): parameters are shared, immutable data.
    if isinstance(value, Mapping):
        # Depth and text first, iteratively: json.dumps of a deep value would overflow.
        check_json("structured_outputs.json", value, max_depth=_MAX_SCHEMA_DEPTH)
        return freeze_json(dict(value))
    schema = getattr(value, "model_json_schema", None)  # a pydantic model class
    if callable(schema):
        return freeze_json(schema())
    raise TypeError(
        "structured_outputs.json must be a JSON schema (a dict or a JSON string) or a "
        f"pydantic model class, got {type(value).__name__} {value!r}"
    )


def _choice(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    choices = _strings("structured_outputs.choice", value)
    if not choices:
        raise ValueError("structured_outputs.choice must list at least one string")
    return choices


@attrs.frozen(kw_only=True)
class StructuredOutputsParams:
    """A constraint on the generated text: exactly one of the fields is set.

    Attributes:
        json: a JSON schema (dict, JSON string, or pydantic model class): the output is a
            JSON document valid against it.
        regex: the output fully matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: an EBNF (GBNF) grammar the output is a sentence of.
        json_object: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
        whitespace_pattern: unused by the xgrammar backend (JSON is generated compact);
            accepted for compatibility.
    """

    json: str | dict | None = attrs.field(default=None, converter=_json_schema)
    regex: str | None = attrs.field(
        default=None,
        converter=functools.partial(as_str, "structured_outputs.regex", allow_none=True,
                                    allow_empty=False),
    )
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choice)
    grammar: str | None = attrs.field(
        default=None,
        converter=functools.partial(as_str, "structured_outputs.grammar", allow_none=True,
                                    allow_empty=False),
    )
    json_object: bool | None = attrs.field(
        default=None,
        converter=functools.partial(as_bool, "structured_outputs.json_object", allow_none=True),
    )
    whitespace_pattern: str | None = None

    def __attrs_post_init__(self) -> None:
        given = self.kinds()
        if len(given) != 1:
            which = ", ".join(given) if given else "none"
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {which}"
            )

    def kinds(self) -> list[str]:
        return [
            k for k in _STRUCTURED_KINDS
            if getattr(self, k) not in (None, False)
        ]

    @property
    def kind(self) -> str:
        """Which constraint this is: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        return self.kinds()[0]


class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name for :class:`StructuredOutputsParams` (same fields)."""


def _structured(value: object) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, Mapping):
        return StructuredOutputsParams(**value)
    raise TypeError(
        "structured_outputs must be StructuredOutputsParams (or GuidedDecodingParams) or None, "
        f"got {type(value).__name__} {value!r}"
    )


def _validate(params: SamplingParams) -> None:
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise ValueError(
            f"min_tokens must be <= max_tokens ({params.max_tokens}), got {params.min_tokens!r}"
        )
    if params.best_of is not None and params.best_of < params.n:
        raise ValueError(f"best_of must be >= n ({params.n}), got {params.best_of!r}")


_PENALTY = functools.partial(as_real, min=-2.0, max=2.0)

# The fields held as lists (vLLM's types): tuples in SamplingParams.snapshot.
_LIST_FIELDS = ("stop", "stop_token_ids", "bad_words", "logits_processors", "allowed_token_ids")


def _as_tuple(value: object) -> object:
    """How list fields compare: a list equals the tuple the engine's snapshot holds."""
    return None if value is None else tuple(value)


class _Assigned:
    """``params`` as it would be after ``name = value`` (for the cross-field checks)."""

    def __init__(self, params: SamplingParams, name: str, value: object) -> None:
        self._params, self._name, self._value = params, name, value

    def __getattr__(self, name: str) -> object:
        return self._value if name == self._name else getattr(self._params, name)


def _on_setattr(instance: SamplingParams, attribute: attrs.Attribute, value: object) -> object:
    """An assignment is converted and checked as construction is; a bad one raises the
    same error and leaves the old value. The engine's snapshot refuses any."""
    if instance._sealed:
        raise attrs.exceptions.FrozenInstanceError()
    value = attrs.setters.convert(instance, attribute, value)
    _validate(_Assigned(instance, attribute.name, value))
    return value


@attrs.define(kw_only=True, on_setattr=_on_setattr)
class SamplingParams:
    """Sampling and stopping parameters of one request, validated at construction and at
    every assignment (``params.seed = 100`` is converted and checked like ``seed=100``; a
    bad value raises and leaves the old one). List-typed fields are lists, as in vLLM; the
    engine snapshots the parameters when a request is added, so changing them afterwards
    does not affect that request.

    A wrong type is a ``TypeError`` (``max_tokens=2.5`` or ``top_k=True`` included: ints
    must be integers, and numpy or torch integer scalars become plain ints); a value out
    of range, NaN or infinity is a ``ValueError``. Either message names the field.

    Processing order of the logits (each step, per request): custom ``logits_processors``,
    ``allowed_token_ids``, ``bad_words``, ``logit_bias``, ``min_tokens``, the structured-output
    mask, the repetition / frequency / presence penalties, then ``temperature``, ``top_k``,
    ``top_p``, ``min_p`` and the draw. Reported logprobs are those of the model's raw
    distribution (vLLM's default ``raw_logprobs``).

    Attributes:
        n: completions returned for the prompt. They share the prompt's KV blocks.
        best_of: completions generated (>= ``n``; default ``n``); the ``n`` with the highest
            cumulative logprob are returned.
        presence_penalty: subtracted once from the logit of every token already generated;
            in [-2, 2] (OpenAI's definition).
        frequency_penalty: subtracted from a token's logit once per time it was generated;
            in [-2, 2].
        repetition_penalty: tokens in the prompt or the output have positive logits divided
            and negative ones multiplied by it (CTRL / HF); > 0 and <= 2, 1 is off.
        temperature: softmax temperature, >= 0; 0 selects the most likely token (greedy).
            A positive value below 1e-2 would overflow the logits, so (as in vLLM) it is
            raised to 1e-2 with a warning.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``; in (0, 1].
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 keeps all, and so does a
            value beyond the vocabulary.
        min_p: drop tokens less likely than ``min_p`` times the most likely one; in [0, 1].
        seed: per-request random seed in [-2**63, 2**64); the same seed gives the same
            tokens whatever else is in the batch (sample ``i`` of ``n`` uses ``seed + i``).
            ``None`` draws from the engine's generator (seeded by ``LLM(seed=...)``).
        stop: strings that end generation; the text is cut before the match (unless
            ``include_stop_str_in_output``) and ``stop_reason`` is the string.
        stop_token_ids: extra token ids that end generation (kept in the output); any
            iterable of non-negative ints, stored as a list.
        bad_words: words never generated: the last token of each word's tokenization (with
            and without a leading space) is banned whenever the tokens before it were just
            generated.
        include_stop_str_in_output: keep the matched stop string in the text.
        ignore_eos: keep generating past the EOS token.
        max_tokens: most tokens to generate, >= 1; ``None`` runs to the model's length limit.
        min_tokens: EOS, ``stop_token_ids`` and stop strings are ignored until this many
            tokens exist; at most ``max_tokens``.
        logprobs: also return the log-probabilities of this many most likely tokens at each
            output position (plus the sampled one); at most the engine's ``max_logprobs``;
            -1 means the whole vocabulary (allowed when ``max_logprobs=-1``).
        prompt_logprobs: the same for every prompt position (the first is None). Such a
            request computes its whole prompt (no prefix-cache hits).
        detokenize: produce text (False: token ids only, and no stop strings).
        skip_special_tokens: drop special tokens from the text.
        spaces_between_special_tokens: put spaces around special tokens in the text (slow
            tokenizers; fast ones decode as the tokenizer does).
        logits_processors: callables ``fn(output_token_ids, logits)`` or
            ``fn(prompt_token_ids, output_token_ids, logits)`` returning the request's new
            logits row (1-D tensor); they run in a per-request loop, unlike the rest.
        truncate_prompt_tokens: keep only the last this-many prompt tokens (-1: up to
            ``max_model_len``).
        output_kind: report everything so far (CUMULATIVE), what is new (DELTA), or only
            the finished output (FINAL_ONLY).
        logit_bias: ``{token_id: bias}`` added to the logits, bias in [-100, 100].
        allowed_token_ids: only these tokens can be generated.
        structured_outputs: a JSON schema, regex, choice or grammar the output must follow
            (``guided_decoding=`` is vLLM's older spelling of the same argument).
        extra_args: free-form arguments for components (vLLM's field). llmlab reads
            ``"kv_budget"``: the fraction of its context a request keeps in the KV cache,
            in (0, 1], with an engine built with a KV press (``LLM(kv_press=...)``); and
            ``"kv_press": False``: this request is never compressed.
    """

    n: int = attrs.field(default=1, converter=functools.partial(as_int, "n", min=1))
    best_of: int | None = attrs.field(
        default=None, converter=functools.partial(as_int, "best_of", min=1, allow_none=True)
    )
    presence_penalty: float = attrs.field(
        default=0.0, converter=functools.partial(_PENALTY, "presence_penalty")
    )
    frequency_penalty: float = attrs.field(
        default=0.0, converter=functools.partial(_PENALTY, "frequency_penalty")
    )
    repetition_penalty: float = attrs.field(
        default=1.0,
        converter=functools.partial(
            as_real, "repetition_penalty", min=0, min_inclusive=False, max=2.0
        ),
    )
    temperature: float = attrs.field(default=1.0, converter=_temperature)
    top_p: float = attrs.field(
        default=1.0,
        converter=functools.partial(as_real, "top_p", min=0, min_inclusive=False, max=1),
    )
    top_k: int = attrs.field(
        default=0,
        converter=functools.partial(
            as_int, "top_k", min=-1, allowed="-1 or 0 (disabled) or a positive integer"
        ),
    )
    min_p: float = attrs.field(
        default=0.0, converter=functools.partial(as_real, "min_p", min=0, max=1)
    )
    seed: int | None = attrs.field(
        default=None, converter=functools.partial(as_seed, "seed", allow_none=True)
    )
    stop: list[str] = attrs.field(
        factory=list, converter=functools.partial(_string_list, "stop"), eq=_as_tuple
    )
    stop_token_ids: list[int] = attrs.field(
        factory=list, converter=_stop_token_ids, eq=_as_tuple
    )
    bad_words: list[str] = attrs.field(
        factory=list, converter=functools.partial(_string_list, "bad_words"), eq=_as_tuple
    )
    include_stop_str_in_output: bool = attrs.field(
        default=False, converter=functools.partial(as_bool, "include_stop_str_in_output")
    )
    ignore_eos: bool = attrs.field(
        default=False, converter=functools.partial(as_bool, "ignore_eos")
    )
    max_tokens: int | None = attrs.field(
        default=16, converter=functools.partial(as_int, "max_tokens", min=1, allow_none=True)
    )
    min_tokens: int = attrs.field(
        default=0, converter=functools.partial(as_int, "min_tokens", min=0)
    )
    logprobs: int | None = attrs.field(
        default=None, converter=functools.partial(_logprobs, "logprobs")
    )
    prompt_logprobs: int | None = attrs.field(
        default=None, converter=functools.partial(_logprobs, "prompt_logprobs")
    )
    detokenize: bool = attrs.field(
        default=True, converter=functools.partial(as_bool, "detokenize")
    )
    skip_special_tokens: bool = attrs.field(
        default=True, converter=functools.partial(as_bool, "skip_special_tokens")
    )
    spaces_between_special_tokens: bool = attrs.field(
        default=True, converter=functools.partial(as_bool, "spaces_between_special_tokens")
    )
    logits_processors: list[Callable] = attrs.field(
        factory=list, converter=_logits_processors, eq=False
    )
    truncate_prompt_tokens: int | None = attrs.field(
        default=None, converter=_truncate_prompt_tokens
    )
    output_kind: RequestOutputKind = attrs.field(
        default=RequestOutputKind.CUMULATIVE, converter=_output_kind
    )
    logit_bias: dict[int, float] | None = attrs.field(
        default=None, converter=_logit_bias, hash=False
    )
    allowed_token_ids: list[int] | None = attrs.field(
        default=None, converter=_allowed_token_ids, eq=_as_tuple
    )
    structured_outputs: StructuredOutputsParams | None = attrs.field(
        default=None, converter=_structured, hash=False
    )
    extra_args: dict[str, Any] | None = attrs.field(
        default=None, converter=_extra_args, hash=False
    )
    # True on the engine's snapshot (see ``snapshot``): read-only, lists as tuples.
    _sealed: bool = attrs.field(default=False, init=False, eq=False, repr=False)

    def __init__(self, *, guided_decoding: StructuredOutputsParams | None = None, **kwargs: Any):
        if kwargs.pop("use_beam_search", False):
            raise ValueError(
                "SamplingParams(use_beam_search=True) is not supported (vLLM removed it too): "
                "use LLM.beam_search(prompts, BeamSearchParams(beam_width=..., max_tokens=...))"
            )
        unknown = sorted(set(kwargs) - {a.name for a in attrs.fields(SamplingParams)})
        if unknown:
            raise TypeError(
                f"SamplingParams got unexpected keyword argument(s) {unknown}"
            )
        if guided_decoding is not None:
            if kwargs.get("structured_outputs") is not None:
                raise ValueError(
                    "pass structured_outputs or guided_decoding (its older name), not both"
                )
            kwargs["structured_outputs"] = guided_decoding
        self.__attrs_init__(**kwargs)

    def __attrs_post_init__(self) -> None:
        _validate(self)

    # -- vLLM's helpers ----------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def guided_decoding(self) -> StructuredOutputsParams | None:
        """vLLM's older name of ``structured_outputs``."""
        return self.structured_outputs

    @property
    def num_samples(self) -> int:
        """Sequences generated: ``best_of`` if set, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    def clone(self) -> SamplingParams:
        """A copy (logits processors are deep-copied, so stateful ones are not shared)."""
        processors = [copy.deepcopy(p) for p in self.logits_processors]
        return attrs.evolve(self, logits_processors=processors)

    def snapshot(self) -> SamplingParams:
        """A read-only copy (lists as tuples, ``logit_bias`` a read-only dict; logits
        processors shared; equal to ``self``):
        what the engine keeps of a request's parameters, so later changes to ``self`` do
        not reach it, and what executors receive (read-only data). Assigning to it raises
        ``attrs.exceptions.FrozenInstanceError``; ``attrs.evolve`` / ``clone`` of it give a
        mutable copy again. Not re-validated (``self`` already is)."""
        if self._sealed:
            return self
        copied = copy.copy(self)
        for name in _LIST_FIELDS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(copied, name, tuple(value))
        if self.logit_bias is not None:
            object.__setattr__(copied, "logit_bias", FrozenDict(self.logit_bias))
        object.__setattr__(copied, "_sealed", True)
        return copied

    def evolve(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied (and validated)."""
        return attrs.evolve(self, **changes)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """Build from keyword arguments where ``None`` means "the default" (as an HTTP
        request's absent fields do). ``max_tokens=None`` stays None (no limit)."""
        keep_none = {"max_tokens", "seed", "best_of", "logprobs", "prompt_logprobs",
                     "truncate_prompt_tokens", "logit_bias", "allowed_token_ids",
                     "structured_outputs", "guided_decoding"}
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k in keep_none})

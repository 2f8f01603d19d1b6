"""``speculative_config``: turning speculative decoding on, as vLLM users spell it.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4})
    LLM(model, speculative_config={"model": "path/to/draft", "num_speculative_tokens": 4})
    LLM(model, speculative_config=MyProposer())          # any object with ``propose``
    llmlab generate "..." --speculative-config '{"method": "suffix", "num_speculative_tokens": 6}'

Methods: ``ngram``, ``suffix``, ``draft_model`` (implied by ``model``), ``synthetic``, any
other registered proposer name (``llmlab components``) or ``"package.module:Class"``.
vLLM methods that need a trained head llmlab does not have (``eagle``, ``eagle3``,
``mtp``, ``medusa``, ``mlp_speculator``) are refused by name. ``speculation_length``
picks the per-step length component: ``"adaptive"`` (default), ``"fixed"``, or an
instance; ``num_speculative_tokens_per_batch_size`` selects the by-batch-size one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from llmlab import registry
from llmlab.speculative.length import AdaptiveLength, BatchSizeLength, FixedLength

_UNSUPPORTED = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "deepseek_mtp")

# Per-method options a config may carry, and the proposer argument each becomes.
_METHOD_OPTIONS = {
    "ngram": {"prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max"},
    "suffix": {
        "suffix_decoding_max_tree_depth": "max_depth",
        "suffix_decoding_max_cached_tokens": "max_global_tokens",
        "suffix_decoding_min_token_prob": "min_token_prob",
        "suffix_decoding_max_spec_factor": "max_spec_factor",
    },
    "draft_model": {"model": "model"},
    "synthetic": {"synthetic_acceptance_rates": "rates"},
}
_COMMON = ("method", "num_speculative_tokens", "speculation_length",
           "num_speculative_tokens_per_batch_size", "proposer")


@attrs.frozen
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's field names).

    Attributes:
        method: the proposer's registered name (see the module).
        num_speculative_tokens: the most tokens drafted per request per step (k >= 1).
        options: the method's own settings (e.g. ``prompt_lookup_max``, ``model``).
        proposer: a proposer instance, when given one instead of a method.
        speculation_length: ``"adaptive"``, ``"fixed"`` or a
            :class:`~llmlab.speculative.length.SpeculationLength` instance.
        per_batch_size: ``num_speculative_tokens_per_batch_size``, when given.
    """

    method: str
    num_speculative_tokens: int
    options: Mapping[str, Any] = attrs.field(factory=dict)
    proposer: Any = None
    speculation_length: Any = "adaptive"
    per_batch_size: Any = None

    @classmethod
    def of(cls, value: Any) -> SpeculativeConfig | None:
        """A config from a dict, a JSON string, a proposer instance or a config; ``ValueError``
        naming the field for anything wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not valid JSON: {err}") from None
        if callable(getattr(value, "propose", None)) and not isinstance(value, Mapping):
            value = {"proposer": value}
        if not isinstance(value, Mapping):
            raise ValueError(
                "speculative_config must be a dict (e.g. {'method': 'ngram', "
                f"'num_speculative_tokens': 4}}), a JSON string or a proposer; got {value!r}"
            )
        return cls._from_dict(dict(value))

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        proposer = d.get("proposer")
        method = d.get("method")
        if method is None:
            method = "custom" if proposer is not None else (
                "draft_model" if d.get("model") is not None else None
            )
        if method is None:
            raise ValueError(
                "speculative_config needs a 'method' (ngram, suffix, draft_model, synthetic, "
                "or a registered proposer), a draft 'model', or a 'proposer'"
            )
        if not isinstance(method, str):
            raise ValueError(f"speculative_config 'method' must be a str, got {method!r}")
        if method in _UNSUPPORTED:
            raise ValueError(
                f"speculative_config method {method!r} needs a trained draft head llmlab does "
                "not support; use ngram, suffix, draft_model or synthetic"
            )
        if proposer is None and method not in _METHOD_OPTIONS and ":" not in method and (
            method not in registry.available("proposer")
        ):
            raise ValueError(
                f"unknown speculative_config method {method!r}; available: "
                f"{', '.join(registry.available('proposer'))} (or 'package.module:Class')"
            )
        allowed = set(_COMMON) | set(_METHOD_OPTIONS.get(method, {}))
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ValueError(
                f"unknown speculative_config key(s) {unknown} for method {method!r}; "
                f"allowed: {', '.join(sorted(allowed))}"
            )
        k = d.get("num_speculative_tokens")
        if k is None and proposer is not None:
            k = getattr(proposer, "num_speculative_tokens", 4)
        if k is None and method == "synthetic" and d.get("synthetic_acceptance_rates"):
            k = len(d["synthetic_acceptance_rates"])
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"speculative_config 'num_speculative_tokens' must be an int >= 1, got {k!r}"
            )
        length = d.get("speculation_length", "adaptive")
        if isinstance(length, str) and length not in ("adaptive", "fixed"):
            raise ValueError(
                f"speculative_config 'speculation_length' must be 'adaptive', 'fixed' or a "
                f"SpeculationLength instance, got {length!r}"
            )
        if not isinstance(length, str) and not callable(getattr(length, "lengths", None)):
            raise ValueError(
                "speculative_config 'speculation_length' must have a lengths(candidates, "
                f"num_running) method; got {length!r}"
            )
        per_batch = d.get("num_speculative_tokens_per_batch_size")
        options = {key: d[key] for key in _METHOD_OPTIONS.get(method, {}) if key in d}
        config = cls(method, k, options, proposer, length, per_batch)
        config.length_policy()  # checks the table now
        return config

    def build_proposer(self) -> Any:
        """A fresh proposer (or the instance given)."""
        if self.proposer is not None:
            registry.check("proposer", self.proposer)
            return self.proposer
        factory = registry.resolve("proposer", self.method)
        names = _METHOD_OPTIONS.get(self.method, {})
        kwargs = {names[key]: value for key, value in self.options.items()}
        if self.method == "synthetic":
            kwargs.setdefault("rates", ())
            kwargs["num_speculative_tokens"] = self.num_speculative_tokens
        try:
            proposer = factory(**kwargs)
        except TypeError as err:
            raise ValueError(f"speculative_config for {self.method!r}: {err}") from None
        registry.check("proposer", proposer)
        return proposer

    def length_policy(self) -> Any:
        """The speculation-length component this config asks for."""
        k = self.num_speculative_tokens
        if not isinstance(self.speculation_length, str):
            return self.speculation_length
        if self.per_batch_size is not None:
            return BatchSizeLength(k, self.per_batch_size)
        if self.speculation_length == "fixed":
            return FixedLength(k)
        return AdaptiveLength(k)

    def to_dict(self) -> dict[str, Any]:
        """vLLM's spelling (for recordings and logs); a proposer instance by class name."""
        out: dict[str, Any] = {
            "method": self.method, "num_speculative_tokens": self.num_speculative_tokens
        }
        out.update(self.options)
        if self.proposer is not None:
            out["proposer"] = type(self.proposer).__name__
        if not isinstance(self.speculation_length, str):
            out["speculation_length"] = type(self.speculation_length).__name__
        elif self.speculation_length != "adaptive":
            out["speculation_length"] = self.speculation_length
        if self.per_batch_size is not None:
            out["num_speculative_tokens_per_batch_size"] = self.per_batch_size
        return out

"""``speculative_config``: turning speculative decoding on, as vLLM users spell it.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4})
    LLM(model, speculative_config={"model": "path/to/draft", "num_speculative_tokens": 4})
    LLM(model, proposer=MyProposer())                    # any object with ``propose``
    LLM(model, proposer="ngram", proposer_config={"prompt_lookup_max": 4})
    llmlab generate "..." --speculative-config '{"method": "suffix", "num_speculative_tokens": 6}'

Methods: ``ngram``, ``suffix``, ``draft_model`` (implied by ``model``), ``synthetic``, any
other registered proposer name (``llmlab components``) or ``"package.module:Class"``.
vLLM methods that need a trained head llmlab does not have (``eagle``, ``eagle3``,
``mtp``, ``medusa``, ``mlp_speculator``) are refused by name. ``speculation_length``
picks the per-step length component: ``"adaptive"`` (default), ``"fixed"``, or an
instance; ``num_speculative_tokens_per_batch_size`` selects the by-batch-size one.

``proposer=`` / ``proposer_config=`` (``LLM``'s, the command line's ``--proposer``) are the
same setting as the config's ``method`` and its constructor's keyword arguments, spelled as
every component kind is (docs/components.md). A :class:`SpeculativeConfig` holds names and
plain settings only: :meth:`SpeculativeConfig.split` takes a proposer or speculation-length
*instance* out of what a user wrote, for the engine builder to hold, and leaves its class
name in the config as a label (``method="custom"``).
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
           "num_speculative_tokens_per_batch_size", "proposer", "proposer_config")
_LENGTHS = ("adaptive", "fixed")
# num_speculative_tokens when the drafter is given as ``proposer`` and the config says none.
_DEFAULT_K = 4


def _label(field: str):
    def check(instance: Any, attribute: attrs.Attribute, value: object) -> None:
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"SpeculativeConfig.{field} holds a name, got {type(value).__name__}: pass the "
                f"instance to LLM({'proposer' if field == 'proposer' else 'speculative_config'}"
                "=...), which hands it to the engine builder"
            )
    return check


@attrs.frozen
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's field names), as plain data.

    Attributes:
        method: the proposer's registered name or ``"package.module:Class"`` (see the
            module); ``"custom"`` for an instance the engine builder holds.
        num_speculative_tokens: the most tokens drafted per request per step (k >= 1).
        options: the method's own settings, vLLM's names (e.g. ``prompt_lookup_max``,
            ``model``).
        proposer_config: keyword arguments for the proposer's constructor (``proposer_config``
            of ``LLM``), in addition to what ``options`` sets.
        proposer: the class name of the proposer instance the engine builder holds
            (``method="custom"``), a label for logs and recordings; None otherwise.
        speculation_length: ``"adaptive"``, ``"fixed"``, or the class name of a
            :class:`~llmlab.speculative.length.SpeculationLength` instance the builder holds.
        per_batch_size: ``num_speculative_tokens_per_batch_size``, when given.
    """

    method: str
    num_speculative_tokens: int
    options: Mapping[str, Any] = attrs.field(factory=dict)
    proposer_config: Mapping[str, Any] = attrs.field(factory=dict)
    proposer: str | None = attrs.field(default=None, validator=_label("proposer"))
    speculation_length: str = attrs.field(default="adaptive",
                                          validator=_label("speculation_length"))
    per_batch_size: Any = None

    @classmethod
    def of(cls, value: Any) -> SpeculativeConfig | None:
        """A config from None, a config, a dict or its JSON (``EngineConfig``'s converter);
        ``ValueError`` naming the field for anything wrong, and for a live instance in it
        (a proposer or a speculation length: give those to ``LLM`` / the engine builder,
        which take them out with :meth:`split`)."""
        config, proposer, length = cls.split(value)
        if proposer is not None or length is not None:
            what = proposer if proposer is not None else length
            raise ValueError(
                f"EngineConfig.speculative_config holds names and settings only, got the "
                f"instance {what!r}: pass it to LLM(proposer=...) (or speculative_config=...), "
                "or EngineBuilder(..., proposer=..., speculation_length=...)"
            )
        return config

    @classmethod
    def split(cls, value: Any, proposer: Any = None, proposer_config: Any = None
              ) -> tuple[SpeculativeConfig | None, Any, Any]:
        """``(config, proposer instance or None, speculation-length instance or None)``
        from what a user wrote: ``speculative_config`` (a dict, its JSON, a proposer
        instance or a config) and ``LLM``'s ``proposer=`` (a name, ``"module:Class"``, a
        class or an instance) and ``proposer_config=``. The config holds plain data only;
        the instances are checked against their contracts here. ``ValueError`` naming the
        field for anything wrong (``TypeError`` for a proposer without ``propose``)."""
        if value is None and proposer is None:
            if proposer_config:
                raise ValueError("proposer_config is set but no proposer is: name one with "
                                 "proposer=... (or speculative_config's 'method')")
            return None, None, None
        if isinstance(value, Mapping) and set(value) == _FIELDS:
            value = cls(**value)  # attrs.asdict's form (a saved config, read back)
        if isinstance(value, SpeculativeConfig) and proposer is None and not proposer_config:
            return value, None, None
        d = cls._as_dict(value)
        if proposer is not None:
            named = d.get("proposer", d.get("method"))
            if named is not None and named != proposer:
                raise ValueError(
                    f"proposer={proposer!r} and speculative_config ({named!r}) both name the "
                    "drafter: name it once (proposer= is speculative_config's method)"
                )
            d.pop("method", None)
            d["proposer"] = proposer
        if proposer_config:
            if d.get("proposer_config"):
                raise ValueError("proposer_config is given twice (as a keyword and in "
                                 "speculative_config): give it once")
            d["proposer_config"] = proposer_config
        return cls._from_dict(d)

    @classmethod
    def _as_dict(cls, value: Any) -> dict[str, Any]:
        if value is None:
            return {}
        if isinstance(value, SpeculativeConfig):
            return value._fields()
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
        return dict(value)

    def _fields(self) -> dict[str, Any]:
        """This config as ``_from_dict`` reads it (labels of builder-held instances left out)."""
        d: dict[str, Any] = {"num_speculative_tokens": self.num_speculative_tokens, **self.options}
        if self.proposer is None:
            d["method"] = self.method
        if self.proposer_config:
            d["proposer_config"] = dict(self.proposer_config)
        if self.speculation_length in _LENGTHS:
            d["speculation_length"] = self.speculation_length
        if self.per_batch_size is not None:
            d["num_speculative_tokens_per_batch_size"] = self.per_batch_size
        return d

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> tuple[SpeculativeConfig, Any, Any]:
        method = d.get("method")
        proposer = d.get("proposer")
        proposer_config = registry.config_dict("proposer", d.get("proposer_config")) or {}
        instance = None
        if isinstance(proposer, str):  # a name: the same setting as 'method'
            if method is not None and method != proposer:
                raise ValueError(
                    f"speculative_config names two drafters: method {method!r} and proposer "
                    f"{proposer!r}; name one"
                )
            method, proposer = proposer, None
        elif proposer is not None:
            instance = registry.build("proposer", proposer, proposer_config)
            proposer_config = {}
            if method not in (None, "custom"):
                raise ValueError(
                    f"speculative_config names two drafters: method {method!r} and the "
                    f"proposer {type(instance).__name__}; name one"
                )
            method = "custom"
        if method is None:
            method = "draft_model" if d.get("model") is not None else None
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
        if instance is None and method not in _METHOD_OPTIONS and ":" not in method and (
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
        if k is None and instance is not None:
            k = getattr(instance, "num_speculative_tokens", _DEFAULT_K)
        elif k is None and method == "synthetic" and d.get("synthetic_acceptance_rates"):
            k = len(d["synthetic_acceptance_rates"])
        elif k is None and d.get("proposer") is not None:
            k = _DEFAULT_K  # given as proposer=name
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"speculative_config 'num_speculative_tokens' must be an int >= 1, got {k!r}"
            )
        length = d.get("speculation_length", "adaptive")
        length_instance = None
        if isinstance(length, str) and length not in _LENGTHS:
            raise ValueError(
                f"speculative_config 'speculation_length' must be 'adaptive', 'fixed' or a "
                f"SpeculationLength instance, got {length!r}"
            )
        if not isinstance(length, str):
            if not callable(getattr(length, "lengths", None)):
                raise ValueError(
                    "speculative_config 'speculation_length' must have a lengths(candidates, "
                    f"num_running) method; got {length!r}"
                )
            length_instance, length = length, type(length).__name__
        per_batch = d.get("num_speculative_tokens_per_batch_size")
        options = {key: d[key] for key in _METHOD_OPTIONS.get(method, {}) if key in d}
        config = cls(method, k, options, proposer_config,
                     None if instance is None else type(instance).__name__, length, per_batch)
        if length_instance is None:
            config.length_policy()  # checks the table now
        return config, instance, length_instance

    def proposer_kwargs(self) -> dict[str, Any]:
        """The proposer constructor's keyword arguments: ``options`` under the names the
        proposer takes, then ``proposer_config``."""
        names = _METHOD_OPTIONS.get(self.method, {})
        kwargs = {names[key]: value for key, value in self.options.items()}
        twice = sorted(set(kwargs) & set(self.proposer_config))
        if twice:
            raise ValueError(
                f"speculative_config sets {twice} both as an option and in proposer_config; "
                "set each once"
            )
        kwargs.update(self.proposer_config)
        if self.method == "synthetic":
            kwargs.setdefault("rates", ())
            kwargs["num_speculative_tokens"] = self.num_speculative_tokens
        return kwargs

    def check_proposer(self) -> None:
        """Resolve the proposer and check its keyword arguments, building nothing (a draft
        model would load): ``ValueError`` / ``TypeError`` naming what is wrong."""
        if self.proposer is None:
            registry.factory("proposer", self.method, self.proposer_kwargs())

    def build_proposer(self) -> Any:
        """A fresh proposer (:func:`llmlab.registry.build`)."""
        if self.proposer is not None:
            raise ValueError(
                f"speculative_config's proposer is a {self.proposer} instance, which the engine "
                "builder holds, not the config: pass it as LLM(proposer=...) or "
                "EngineBuilder(..., proposer=...)"
            )
        return registry.build("proposer", self.method, self.proposer_kwargs())

    def length_policy(self) -> Any:
        """The speculation-length component this config asks for."""
        k = self.num_speculative_tokens
        if self.speculation_length not in _LENGTHS:
            raise ValueError(
                f"speculative_config's speculation_length is a {self.speculation_length} "
                "instance, which the engine builder holds: pass it as "
                "EngineBuilder(..., speculation_length=...)"
            )
        if self.per_batch_size is not None:
            return BatchSizeLength(k, self.per_batch_size)
        if self.speculation_length == "fixed":
            return FixedLength(k)
        return AdaptiveLength(k)

    def bound(self, proposer: Any = None, length: Any = None) -> SpeculativeConfig:
        """This config with the engine builder's instances bound in, for the ranks that
        build from it (:class:`BoundSpeculation`); itself when there are none."""
        if proposer is None and length is None:
            return self
        if proposer is not None and self.proposer is None:
            raise ValueError(
                f"the proposer {type(proposer).__name__} and speculative_config's method "
                f"{self.method!r} both name the drafter: name it once"
            )
        return BoundSpeculation(
            self.method, self.num_speculative_tokens, self.options, self.proposer_config,
            self.proposer, self.speculation_length, self.per_batch_size,
            bound_proposer=proposer, bound_length=length,
        )

    def to_dict(self) -> dict[str, Any]:
        """vLLM's spelling (for recordings and logs); a proposer instance by class name."""
        out: dict[str, Any] = {
            "method": self.method, "num_speculative_tokens": self.num_speculative_tokens
        }
        out.update(self.options)
        if self.proposer_config:
            out["proposer_config"] = dict(self.proposer_config)
        if self.proposer is not None:
            out["proposer"] = self.proposer
        if self.speculation_length != "adaptive":
            out["speculation_length"] = self.speculation_length
        if self.per_batch_size is not None:
            out["num_speculative_tokens_per_batch_size"] = self.per_batch_size
        return out


@attrs.frozen
class BoundSpeculation(SpeculativeConfig):
    """A :class:`SpeculativeConfig` with the engine builder's proposer and speculation
    length instances bound in: what an engine's ranks build from
    (``llmlab.engine.assembly``), never an engine's own config, which holds names only."""

    bound_proposer: Any = None
    bound_length: Any = None

    def build_proposer(self) -> Any:
        if self.bound_proposer is None:
            return super().build_proposer()
        registry.check("proposer", self.bound_proposer)
        return self.bound_proposer

    def length_policy(self) -> Any:
        if self.bound_length is None:
            return super().length_policy()
        return self.bound_length


# attrs.asdict's keys of a SpeculativeConfig: a config saved as plain data reads back whole.
_FIELDS = frozenset(f.name for f in attrs.fields(SpeculativeConfig))

"""Poolers: one request's prompt hidden states ``[num_tokens, hidden]`` -> one vector.

A pooler is a small component (the registry's ``pooler`` kind) with one method,
``pool(hidden_states)``, and one fact the engine plans around, ``uses_all_positions``:

* False (``last``): only the prompt's last position is read. The runner keeps nothing
  across prefill chunks, and a prefix-cache hit is harmless (the last position is never
  served from the cache: a lookup stops short of it, so it is always computed).
* True (``mean``, ``cls``): positions from the first on are read. The runner collects the
  hidden states of every chunk of the prompt, and the scheduler gives the request no
  prefix-cache hit (the KV of cached positions is there, their hidden states are not).

:class:`PoolerConfig` (vLLM's) picks the pooler and the task defaults; a checkpoint's
sentence-transformers files (``modules.json``, ``1_Pooling/config.json``) say what its
authors pooled with (:func:`pooler_config_from_checkpoint`).
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Mapping
from typing import Any, Protocol

import attrs
import torch

from llmlab import registry
from llmlab.validation import as_bool

POOLING_TYPES = ("last", "mean", "cls")
"""The built-in poolers' names (``PoolerConfig.pooling_type``, any case)."""


class Pooler(Protocol):
    """Reduces one request's prompt hidden states to one vector.

    ``hidden_states`` is ``[n, hidden]``: every prompt position when ``uses_all_positions``
    is True, else the last one only (``n == 1``). Returns ``[hidden]``.
    """

    uses_all_positions: bool

    def pool(self, hidden_states: torch.Tensor) -> torch.Tensor: ...


@registry.register("pooler", "last")
@attrs.frozen
class LastPool:
    """The last prompt token's hidden state: decoder-only embedders (E5-Mistral, GTE-Qwen)
    and Hugging Face ``*ForSequenceClassification`` heads pool this way."""

    uses_all_positions = False

    def pool(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states[-1]


@registry.register("pooler", "mean")
@attrs.frozen
class MeanPool:
    """The mean over every prompt position (sentence-transformers' ``pooling_mode_mean_tokens``;
    Reimers & Gurevych, 2019)."""

    uses_all_positions = True

    def pool(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # float32 accumulation: a bfloat16 sum over a long prompt loses digits.
        return hidden_states.float().mean(dim=0)


@registry.register("pooler", "cls")
@attrs.frozen
class CLSPool:
    """The first position's hidden state (BERT's ``[CLS]``; Devlin et al., 2019)."""

    uses_all_positions = True

    def pool(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states[0]


def _pooling_type(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(
            f"pooler_config.pooling_type must be a str such as 'last', 'mean' or 'cls', got "
            f"{type(value).__name__} {value!r}"
        )
    # vLLM spells the built-ins LAST, MEAN, CLS; an import path keeps its case.
    name = value.lower() if value.lower() in registry.available("pooler") else value
    try:
        registry.resolve("pooler", name)
    except ValueError as err:
        raise ValueError(f"pooler_config.pooling_type: {err}") from None
    return name


def _optional_bool(field: str):
    return functools.partial(as_bool, f"pooler_config.{field}", allow_none=True)


@attrs.frozen(kw_only=True)
class PoolerConfig:
    """How a pooling model pools (vLLM's ``PoolerConfig``; ``LLM(pooler_config=...)``,
    ``llmlab serve --pooler-config '{"pooling_type": "MEAN"}'``).

    Attributes:
        pooling_type: a registered pooler (``"last"``, ``"mean"``, ``"cls"``, any case);
            None: the checkpoint's sentence-transformers setting, else ``"last"``.
        normalize: embeddings' default for requests that leave ``normalize`` None; None:
            the checkpoint's sentence-transformers setting, else True.
        use_activation: classification's and scoring's default activation (softmax, or
            sigmoid for one label); None: True. ``softmax`` / ``activation``: vLLM's older
            names for it.
    """

    pooling_type: str | None = attrs.field(default=None, converter=_pooling_type)
    normalize: bool | None = attrs.field(default=None, converter=_optional_bool("normalize"))
    use_activation: bool | None = attrs.field(
        default=None, converter=_optional_bool("use_activation")
    )

    @classmethod
    def of(cls, value: Any, field: str = "pooler_config") -> PoolerConfig | None:
        """A config from None, a config, a dict or its JSON (``ValueError`` naming the field
        and the keys allowed)."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"{field} is not valid JSON: {err}") from None
        allowed = ("pooling_type", "normalize", "use_activation", "softmax", "activation")
        if not isinstance(value, Mapping):
            raise ValueError(
                f"{field} must be a PoolerConfig, a dict or its JSON (keys: "
                f"{', '.join(allowed)}), got {value!r}"
            )
        unknown = sorted(set(value) - set(allowed), key=str)
        if unknown:
            raise ValueError(f"{field} has unknown key(s) {unknown}; allowed: {', '.join(allowed)}")
        d = dict(value)
        aliases = {k: d.pop(k) for k in ("softmax", "activation") if k in d}
        if aliases:
            d.setdefault("use_activation", next(iter(aliases.values())))
        return cls(**d)

    def merged(self, other: PoolerConfig | None) -> PoolerConfig:
        """This config with ``other``'s unset fields filled in from ``self`` (``other``
        wins where it says something)."""
        if other is None:
            return self
        return attrs.evolve(
            self, **{k: v for k, v in attrs.asdict(other).items() if v is not None}
        )


_ST_POOLING_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


def pooler_config_from_checkpoint(model_path: str | pathlib.Path) -> PoolerConfig:
    """What a sentence-transformers checkpoint says about pooling: its ``Pooling`` module's
    mode and whether a ``Normalize`` module follows (fields it does not say stay None)."""
    root = pathlib.Path(model_path)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig()
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, json.JSONDecodeError):
        return PoolerConfig()
    pooling_type = None
    normalize = None
    for module in modules if isinstance(modules, list) else ():
        kind = str(module.get("type", ""))
        if kind.endswith("Pooling"):
            config_file = root / str(module.get("path", "")) / "config.json"
            try:
                settings = json.loads(config_file.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            for key, name in _ST_POOLING_MODES.items():
                if settings.get(key):
                    pooling_type = name
                    break
            normalize = False if normalize is None else normalize
        elif kind.endswith("Normalize"):
            normalize = True
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize)

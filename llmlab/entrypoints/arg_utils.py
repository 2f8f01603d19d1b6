"""vLLM's ``EngineArgs`` and ``AsyncEngineArgs`` (``vllm.engine.arg_utils``).

Both are dataclasses whose fields are :class:`~llmlab.config.EngineConfig`'s, generated from
it (a new config field is a new argument, and a new ``llmlab serve`` flag, by itself):
``EngineArgs(model=..., max_num_seqs=8)``, then ``Engine.from_engine_args(args)``,
``AsyncEngine.from_engine_args(args)``, ``args.create_engine_config()``, or
``LLM(**vars(args))``. :meth:`EngineArgs.add_cli_args` adds one ``--flag`` per field to an
``argparse`` parser (``--model`` included) and :meth:`EngineArgs.from_cli_args` reads them
back, as vLLM's do; with :class:`llmlab.utils.FlexibleArgumentParser`, vLLM's script pattern
runs unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import attrs

from llmlab.config import COMPONENT_FIELDS, EngineConfig

# Short aliases vLLM's command line has.
_ALIASES = {"tensor_parallel_size": ("-tp",), "data_parallel_size": ("-dp",)}
# ``--model``'s default when a script leaves it out: vLLM's (its ModelConfig.model). The
# EngineArgs field itself stays required, as EngineConfig's is.
DEFAULT_CLI_MODEL = "Qwen/Qwen3-0.6B"


def _field_spec(field: attrs.Attribute) -> tuple[str, Any, dataclasses.Field]:
    if field.default is attrs.NOTHING:
        return field.name, field.type, dataclasses.field()
    if isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
        return field.name, field.type, dataclasses.field(default_factory=field.default.factory)
    return field.name, field.type, dataclasses.field(default=field.default)


def _json_or_str(value: str) -> Any:
    """A flag value that may be JSON (``--speculative-config '{"method": "ngram"}'``)."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def _arg_type(type_text: str) -> Any:
    """The argparse ``type`` of a field annotated ``type_text`` (None: a flag pair)."""
    parts = {p.strip() for p in str(type_text).split("|")} - {"None"}
    if parts == {"bool"}:
        return None
    if parts == {"int"}:
        return int
    if parts == {"float"}:
        return float
    if parts <= {"str", "torch.dtype"}:
        return str
    return _json_or_str


def _add_flag(parser: argparse.ArgumentParser, names: list[str], dest: str, type_text: Any,
              default: Any, help_text: str) -> None:
    arg_type = _arg_type(type_text)
    if arg_type is None:
        parser.add_argument(*names, dest=dest, default=default,
                            action=argparse.BooleanOptionalAction)
    else:
        parser.add_argument(*names, dest=dest, default=default, type=arg_type, help=help_text)


class _EngineArgsMethods:
    """What EngineArgs adds to the generated fields."""

    def config_kwargs(self) -> dict[str, Any]:
        """The ``EngineConfig`` keywords these arguments hold. A component left unset (None,
        or no plugins) is left out, so that one given alongside as an instance
        (``AsyncEngine.from_engine_args(args, scheduling_policy=MyPolicy())``) takes its
        place instead of colliding with it."""
        components = (*COMPONENT_FIELDS, "plugins")
        return {f.name: getattr(self, f.name) for f in attrs.fields(EngineConfig)
                if not (f.name in components and not getattr(self, f.name))}

    def create_engine_config(self) -> EngineConfig:
        """The checked :class:`EngineConfig` (raises ``ValueError`` naming a bad field)."""
        return EngineConfig(**self.config_kwargs())

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()
    ) -> argparse.ArgumentParser:
        """Add ``--field-name`` for every field (``--x`` / ``--no-x`` for booleans), with
        the field's default, and return ``parser`` (vLLM's). ``--model`` defaults to
        vLLM's default model; ``skip`` names fields left out (``llmlab serve`` skips
        ``model``: it takes the model positionally and adds its own ``--model``), and flags
        the parser already has are kept. ``AsyncEngineArgs`` adds its own extra fields."""
        existing = set(parser._option_string_actions)  # noqa: SLF001 (argparse has no API)
        for field in attrs.fields(EngineConfig):
            if field.name in skip:
                continue
            flag = "--" + field.name.replace("_", "-")
            if flag in existing:
                continue
            names = [flag, *(a for a in _ALIASES.get(field.name, ()) if a not in existing)]
            if field.name == "model":
                parser.add_argument(*names, dest="model", default=DEFAULT_CLI_MODEL,
                                    help="local directory or Hugging Face hub id "
                                    f"(default {DEFAULT_CLI_MODEL!r})")
                continue
            default = None if field.default is attrs.NOTHING else field.default
            _add_flag(parser, names, field.name, field.type, default,
                      f"EngineConfig.{field.name} (default {default!r})")
        config_fields = {f.name for f in attrs.fields(EngineConfig)}
        for extra in dataclasses.fields(cls):  # AsyncEngineArgs' disable_log_requests
            flag = "--" + extra.name.replace("_", "-")
            if extra.name in config_fields or extra.name in skip or flag in existing:
                continue
            _add_flag(parser, [flag], extra.name, extra.type, extra.default,
                      f"{cls.__name__}.{extra.name} (default {extra.default!r})")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> Any:
        """The arguments from a parsed command line (fields it lacks keep their defaults)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})


EngineArgs = dataclasses.make_dataclass(
    "EngineArgs",
    [_field_spec(f) for f in attrs.fields(EngineConfig)],
    bases=(_EngineArgsMethods,),
    namespace={"__module__": __name__},
)
EngineArgs.__doc__ = (
    "vLLM's ``EngineArgs``: every :class:`~llmlab.config.EngineConfig` field as a dataclass "
    "field (same names and defaults), unchecked until :meth:`create_engine_config` or an "
    "engine is built from them."
)


@dataclasses.dataclass
class AsyncEngineArgs(EngineArgs):  # type: ignore[valid-type,misc]
    """vLLM's ``AsyncEngineArgs``: :class:`EngineArgs` plus ``disable_log_requests``
    (accepted; llmlab logs no per-request lines either way)."""

    disable_log_requests: bool = False


__all__ = ["AsyncEngineArgs", "EngineArgs"]

"""Names for components, so a class can be picked by name from ``LLM``, the CLI or a server.

    from llmlab import register
    from llmlab.scheduler import Policy

    @register("scheduling_policy", "longest_first")
    class LongestFirst(Policy):
        \"\"\"Admit the longest prompt first.\"\"\"
        def key(self, request):
            return -request.num_prompt_tokens

    LLM(model, scheduling_policy="longest_first")
    # llmlab generate "Hi" --scheduling-policy longest_first   (once the module is imported)

A name may also be an import path, ``"package.module:Class"``: the command line imports the
module (which may register more names). ``llmlab components`` lists every registered name
with the first line of its docstring.

Kinds: ``scheduling_policy``, ``eviction_policy``, ``attention_backend``, ``sampler``,
``proposer``, ``router`` (which replica gets a request: :mod:`llmlab.routing`),
``pooler`` (one request's hidden states -> one vector: :mod:`llmlab.pooling`),
``tool_parser`` (tool calls in a model's text, for the server's ``tool_choice="auto"``:
:mod:`llmlab.entrypoints.server.tool_parsers`), ``kv_press`` (which cached tokens a request keeps:
:mod:`llmlab.kvpress`), ``plugin`` (a feature's scheduler and runner sides:
:mod:`llmlab.plugin`) and ``model``. The registry maps names to *factories* (usually
classes); :func:`build` makes an instance from a name, an import path or a class, with a
``<kind>_config`` dict as the constructor's keyword arguments (or takes an instance as it
is), so each engine gets fresh instances and no state is shared between engines. Models
are the exception: a ``model`` name is a Hugging Face architecture (``config.json``'s
``architectures``) and its class is built by the loader from that config
(:func:`llmlab.models.register_model` adds one). docs/components.md is the guide.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

KINDS: dict[str, str] = {
    "scheduling_policy": "llmlab.scheduler.policies",
    "eviction_policy": "llmlab.cache.eviction",
    "attention_backend": "llmlab.attention",
    "sampler": "llmlab.sampling.sampler",
    "model": "llmlab.models.registry",
    "proposer": "llmlab.speculative",
    "router": "llmlab.routing",
    "pooler": "llmlab.pooling.pooler",
    "tool_parser": "llmlab.entrypoints.server.tool_parsers",
    "kv_press": "llmlab.kvpress",
    "plugin": "llmlab.plugin",
}
"""Each kind, and the module whose import registers its built-ins."""

_TABLES: dict[str, dict[str, Callable[[], Any]]] = {kind: {} for kind in KINDS}


class Method:
    """One required method of a component kind: its name and how the engine calls it
    (positional parameters after ``self``, then keyword arguments)."""

    __slots__ = ("name", "params", "keywords", "returns")

    def __init__(self, name: str, params: tuple[str, ...], keywords: tuple[str, ...] = (),
                 returns: str = "None"):
        self.name, self.params, self.keywords, self.returns = name, params, keywords, returns

    def __repr__(self) -> str:
        args = ["self", *self.params] + (["*", *self.keywords] if self.keywords else [])
        return f"{self.name}({', '.join(args)}) -> {self.returns}"


CONTRACTS: dict[str, tuple[Method, ...]] = {
    "scheduling_policy": (
        Method("push", ("request", "now")),
        Method("pop", ("now",), returns="RequestView | None"),
        Method("remove", ("request",)),
        Method("victim", ("candidates",), returns="RequestView"),
    ),
    "eviction_policy": (
        Method("on_free", ("block_ids",)),
        Method("on_hit", ("block_ids",)),
        Method("evict", ("n",), returns="list[int]"),
    ),
    "attention_backend": (
        Method("kv_cache_shape", ("num_blocks", "block_size", "num_kv_heads", "head_dim"),
               returns="tuple[int, ...]"),
        Method("build_metadata", ("inputs",), returns="metadata"),
        Method("forward", ("layer_idx", "q", "k", "v", "kv_cache", "metadata"),
               keywords=("scale", "sliding_window"), returns="Tensor"),
    ),
    "sampler": (
        Method("__call__", ("logits", "metadata"), returns="SamplerOutput"),
    ),
    "proposer": (
        Method("propose", ("requests", "k"), returns="list[list[int]] | Proposal"),
    ),
    "router": (
        Method("route", ("request", "replicas"), returns="int"),
    ),
    "pooler": (
        Method("pool", ("hidden_states",), returns="Tensor"),
    ),
    "tool_parser": (
        Method("extract", ("text", "tools"), returns="tuple[str | None, list[ParsedCall]]"),
    ),
    "kv_press": (
        Method("score", ("layer",), returns="Tensor"),
    ),
    # A feature plugin subclasses llmlab.plugin.SchedulerPlugin or RunnerPlugin, whose
    # hooks all have defaults: the builder checks the base class instead.
    "plugin": (),
    "model": (
        Method("forward", ("input_ids", "positions", "attn"), returns="Tensor"),
        Method("compute_logits", ("hidden",), returns="Tensor"),
        Method("load_weights", ("weights",)),
    ),
}
"""Each kind's required methods and the call shapes the engine uses, in one place. The
protocols in ``scheduler/policy.py``, ``cache/eviction.py``, ``attention/backend.py``,
``sampling/sampler.py``, ``speculative/proposer.py``, ``routing/policy.py``,
``pooling/pooler.py``, ``server/tool_parsers.py`` and ``models/base.py`` document them;
:func:`check` holds a component (or a model class) to them before an engine loads
weights."""

# The scheduling policy's older form (scheduler.policy.OrderPolicy adapts it).
LEGACY_SCHEDULING: tuple[Method, ...] = (
    Method("order", ("waiting", "now"), returns="list[RequestView]"),
    Method("victim", ("candidates",), returns="RequestView"),
)


def check(kind: str, component: Any, methods: tuple[Method, ...] | None = None) -> None:
    """Raise ``TypeError`` unless ``component`` has every method of ``kind``'s contract (or
    ``methods``) and each accepts the call the engine makes, naming the method and the
    expected signature. Called on instances (a bound method's ``self`` is not counted) or,
    for models, on the class."""
    _check_kind(kind)
    is_class = isinstance(component, type)
    label = f"{kind} {(component if is_class else type(component)).__name__}"
    for method in CONTRACTS[kind] if methods is None else methods:
        attr = getattr(component, method.name, None)
        if not callable(attr):
            raise TypeError(f"{label} is missing method {method.name!r}; expected {method!r}")
        try:
            signature = inspect.signature(attr)
        except (TypeError, ValueError):  # a builtin or C callable: nothing to inspect
            continue
        try:
            params = ("self", *method.params) if is_class else method.params
            signature.bind(*params, **dict.fromkeys(method.keywords))
        except TypeError as err:
            raise TypeError(
                f"{label}.{method.name}{signature} cannot take the engine's call ({err}); "
                f"expected {method!r}"
            ) from None

T = TypeVar("T")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown component kind {kind!r}; kinds: {', '.join(KINDS)}")


def table(kind: str) -> dict[str, Callable[[], Any]]:
    """The live name -> factory mapping of ``kind`` (built-ins are registered on import)."""
    _check_kind(kind)
    return _TABLES[kind]


def register(kind: str, name: str | None = None) -> Callable[[T], T]:
    """Class decorator: make ``cls`` available as ``name`` (default: its ``name`` attribute).

    Registering the same name again with a class of the same module and qualified name
    replaces it (re-running a notebook cell); another class under a taken name is an error.
    """
    _check_kind(kind)

    def decorate(factory: T) -> T:
        key = name if name is not None else getattr(factory, "name", None)
        if not isinstance(key, str) or not key:
            raise ValueError(
                f"register({kind!r}) needs a name: pass one, or give {factory!r} a str "
                "`name` attribute"
            )
        if ":" in key:
            raise ValueError(f"component name {key!r} must not contain ':' (import paths do)")
        entries = _TABLES[kind]
        old = entries.get(key)
        if old is not None and _qualname(old) != _qualname(factory):
            raise ValueError(
                f"{kind} name {key!r} is taken by {_qualname(old)}; pick another name"
            )
        entries[key] = factory
        return factory

    return decorate


def available(kind: str) -> list[str]:
    """Registered names of ``kind``, built-ins included, in registration order."""
    _load_builtins(kind)
    return list(_TABLES[kind])


def resolve(kind: str, name: str) -> Callable[[], Any]:
    """The factory registered as ``name``, or imported from ``"module:attr"``.

    Raises ``ValueError`` naming the available names when there is no such component.
    """
    _load_builtins(kind)
    if not isinstance(name, str):
        raise TypeError(f"{kind} name must be a str, got {type(name).__name__}")
    entries = _TABLES[kind]
    if name in entries:
        return entries[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = _import_from_here(module_name)
        except ImportError as err:
            raise ValueError(f"{kind} {name!r}: cannot import {module_name!r} ({err})") from err
        try:
            return getattr(module, attr)
        except AttributeError:
            raise ValueError(f"{kind} {name!r}: module {module_name!r} has no {attr!r}") from None
    raise ValueError(
        f"unknown {kind} {name!r}; available: {', '.join(entries)} "
        "(or 'package.module:Class')"
    )


def _import_from_here(module_name: str):
    """Import ``module_name``, also from the current directory as ``python -m`` would: the
    ``llmlab`` console script's ``sys.path`` starts at its own folder, not the user's. The
    directory goes last on the path (installed packages keep priority) and stays, so the
    module's own later imports of its siblings work."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        here = os.getcwd()
        if err.name != module_name.partition(".")[0] or here in sys.path or "" in sys.path:
            raise
    sys.path.append(here)
    return importlib.import_module(module_name)


def create(kind: str, name: str) -> Any:
    """A fresh instance of the component named ``name`` (see :func:`resolve`)."""
    return resolve(kind, name)()


# Kinds whose contract their owner checks: a scheduling policy has two forms
# (llmlab.scheduler.policy.as_policy), a plugin a base class (llmlab.plugin), a model is a
# class built by the loader.
_OWN_CHECKS = ("scheduling_policy", "plugin", "model")


def build(kind: str, value: Any, config: Mapping[str, Any] | str | None = None) -> Any:
    """The one way a component is made, for every kind: an instance from ``value``, a
    registered name or ``"package.module:Class"`` (resolved) or a class, called with
    ``config`` (``<kind>_config``: a dict, or a JSON object's text) as its keyword
    arguments; or an instance, returned as it is. None (with no config) is None.

    Raises, naming the kind and the value: ``ValueError`` for an unknown name (listing the
    available ones), a config given with an instance (build it with its settings instead)
    or without a ``value``; ``TypeError`` for a config key the constructor does not take
    (naming it and those it takes) and for an instance that breaks the kind's contract
    (naming the method: :func:`check`; scheduling policies and plugins are checked by their
    owners). A constructor's own ``TypeError`` / ``ValueError`` (a validator naming its
    field) comes with the kind and the value in front.
    """
    config = config_dict(kind, config)
    if value is None:
        if config:
            raise ValueError(
                f"{kind}_config {config!r} is set but {kind} is None: name the {kind} it "
                "configures (a registered name or 'package.module:Class')"
            )
        return None
    if isinstance(value, (str, type)):
        make = factory(kind, value, config)
        try:
            instance = make()
        except (TypeError, ValueError) as err:
            error = TypeError if isinstance(err, TypeError) else ValueError
            raise error(f"{_label(kind, value)}: {err}") from err
    else:
        if config:
            raise ValueError(
                f"{kind}_config {config!r} was given with the {kind} instance {value!r}: a "
                f"config is for a {kind} given by name or class; build the instance with "
                "those settings instead"
            )
        instance = value
    if kind not in _OWN_CHECKS:
        check(kind, instance)
    return instance


def factory(kind: str, value: Any, config: Mapping[str, Any] | str | None = None
            ) -> Callable[[], Any]:
    """What makes fresh instances of ``kind`` (each call, one): the factory of a registered
    name, an import path or a class, with ``config`` bound as its keyword arguments. The
    keywords are checked against the constructor's signature here (``TypeError`` naming a
    key it does not take, or a required one missing), before anything is built. For kinds
    that need an instance per use (the server's tool parsers: one per stream)."""
    config = config_dict(kind, config) or {}
    if value is None:
        raise ValueError(
            f"{kind} is None{f' but {kind}_config {config!r} is set' if config else ''}: "
            f"name the {kind} (a registered name or 'package.module:Class')"
        )
    if isinstance(value, str):
        made = resolve(kind, value)
    elif isinstance(value, type):
        made = value
    else:
        raise TypeError(
            f"{kind} must be a registered name, 'package.module:Class' or a class here, got "
            f"{type(value).__name__} {value!r}"
        )
    _check_keywords(kind, value, made, config)
    return functools.partial(made, **config) if config else made


def _check_keywords(kind: str, value: Any, made: Callable[..., Any], config: dict) -> None:
    try:
        signature = inspect.signature(made)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to inspect
        return
    try:
        signature.bind(**config)
        return
    except TypeError:
        pass
    params = list(signature.parameters.values())
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes = [p.name for p in params if p.kind in named]
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        unknown = [key for key in config if key not in takes]
        if unknown:
            raise TypeError(
                f"{kind}_config key {unknown[0]!r} is not a keyword argument of "
                f"{_label(kind, value)}; it takes: {', '.join(takes) or 'none'}"
            )
    missing = [p.name for p in params
               if p.default is p.empty and p.kind in named and p.name not in config]
    raise TypeError(
        f"{_label(kind, value)} needs {kind}_config key(s) {missing} (its constructor has no "
        "default for them)"
    )


def _label(kind: str, value: Any) -> str:
    shown = value.__name__ if isinstance(value, type) else repr(value)
    return f"{kind} {shown}"


def config_dict(kind: str, value: object) -> dict[str, Any] | None:
    """``<kind>_config`` as plain data: None, or a dict keyed by keyword names (a JSON
    object's text, as a command line gives it, is parsed); ``ValueError`` naming the
    setting for anything else."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{kind}_config is not a JSON object: {err}") from None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(
            f"{kind}_config must be a dict of the {kind}'s keyword arguments, got {value!r}"
        )
    return dict(value)


def name_of(kind: str, value: object) -> str | None:
    """A component as a config holds it: None, or a registered name or
    ``"package.module:Class"`` (a non-empty str). Anything else is a ``ValueError`` saying
    where an instance goes instead: configs hold names and plain settings only (picklable,
    printable, savable as YAML)."""
    if value is None or (isinstance(value, str) and value):
        return value
    raise ValueError(
        f"{kind} in EngineConfig must be a registered name or 'package.module:Class', got "
        f"{type(value).__name__} {value!r}: a config holds names only; give an instance to "
        f"LLM({kind}=...) or EngineBuilder(..., {kind}=...)"
    )


def bind_hook(*components: Any) -> Callable[..., Any] | None:
    """The ``bind`` method of the first of ``components`` that has one: the one hook name
    through which every kind binds to its engine, once, when the engine is built. A
    component with only the older ``attach`` (scheduling policies' name for it before v4)
    still binds through it, with a ``DeprecationWarning`` naming it; None when none has
    either."""
    for name in ("bind", "attach"):
        for component in components:
            hook = getattr(component, name, None)
            if callable(hook):
                if name == "attach":
                    warnings.warn(
                        f"{type(component).__name__}.attach(view) is deprecated: name it "
                        "bind(view), the one hook every component binds to its engine with",
                        DeprecationWarning, stacklevel=3,
                    )
                return hook
    return None


# Component instances engines were built with, by id (held weakly: an entry goes when its
# instance does). Each engine needs its own: a component keeps its engine's state (an
# eviction policy the block ids of that engine's pool, a press its per-request scores).
_CLAIMED: dict[int, weakref.ref] = {}


def check_unclaimed(components: Iterable[tuple[str, Any]]) -> None:
    """Raise ``ValueError`` for the first ``(kind, instance)`` an engine was already built
    with (names, classes and None pass: each build makes its own instance of those)."""
    for kind, component in components:
        ref = _CLAIMED.get(id(component))  # only ever an instance's (see claim)
        if ref is not None and ref() is component:
            raise ValueError(
                f"{kind}={_label(kind, component)} is already part of another engine, and a "
                "component keeps its engine's state (an eviction policy that engine's block "
                "ids): give each engine its own instance (a new one, copy.deepcopy(it), or "
                "its registered name or class)"
            )


def claim(components: Iterable[tuple[str, Any]]) -> None:
    """Record the instances an engine was just built with (see :func:`check_unclaimed`);
    names, classes and None among ``components`` are skipped."""
    for _kind, component in components:
        if component is None or isinstance(component, (str, type)):
            continue
        key = id(component)

        def gone(ref: weakref.ref, key: int = key) -> None:
            if _CLAIMED.get(key) is ref:
                del _CLAIMED[key]

        try:
            _CLAIMED[key] = weakref.ref(component, gone)
        except TypeError:  # not weakly referenceable (a builtin): not tracked
            continue


def describe(kind: str | None = None) -> list[tuple[str, str, str]]:
    """``(kind, name, one-line doc)`` for every registered component (of ``kind``)."""
    rows = []
    for k in [kind] if kind is not None else list(KINDS):
        for name in available(k):
            rows.append((k, name, _summary(inspect.getdoc(_TABLES[k][name]) or "")))
    return rows


def _summary(doc: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]


def _load_builtins(kind: str) -> None:
    _check_kind(kind)
    importlib.import_module(KINDS[kind])


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"

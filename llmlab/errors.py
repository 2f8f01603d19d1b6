"""Errors the engine raises on behalf of user components.

A scheduling policy, eviction policy, attention backend, sampler or observer is user code:
it may raise. The engine first brings its own state back to a consistent point (blocks
accounted for, queues intact), then reports the failure as a :class:`ComponentError` that
names the component and the method, chained to the original exception.
"""

from __future__ import annotations

import logging

_logger = logging.getLogger("llmlab.engine.engine")  # where step errors were always logged


def component_name(component: object) -> str:
    """``'name' (ClassName)`` for a component with a ``name``, else the class name."""
    cls = type(component).__name__
    name = getattr(component, "name", None)
    return f"{name!r} ({cls})" if isinstance(name, str) and name != cls else cls


class ComponentError(RuntimeError):
    """A user-swappable component raised or broke its contract.

    Attributes:
        component: the component object.
        method: the method that failed (``"on_free"``, ``"evict"``, ``"order"``, ...).
    """

    def __init__(self, kind: str, component: object, method: str, detail: str) -> None:
        self.component = component
        self.method = method
        super().__init__(f"{kind} {component_name(component)} failed in {method}(): {detail}")

    @classmethod
    def wrap(cls, kind: str, component: object, method: str, err: BaseException) -> ComponentError:
        """A ComponentError describing ``err``, raised by ``component.method``."""
        new = cls(kind, component, method, f"{type(err).__name__}: {err}")
        new.__cause__ = err
        return new


class RequestFailedError(RuntimeError):
    """The engine had to end a request itself (e.g. it can never fit the KV cache).

    The request is finished with ``finish_reason="abort"``; the engine raises this after
    the step so the failure is loud, and the other requests carry on.
    """

    def __init__(self, request_id: str, reason: str) -> None:
        self.request_id = request_id
        super().__init__(reason)


class ExecutorDeadError(RuntimeError):
    """The executor can never run another step (a tensor-parallel worker died, or a step
    failed part-way on some ranks): every request in flight fails and the engine must be
    rebuilt. The message names the rank and why."""


def raise_first(errors: list[Exception]) -> None:
    """Raise the first error of a step; log the others so none goes unseen."""
    if not errors:
        return
    for extra in errors[1:]:
        _logger.error("also in this step: %s: %s", type(extra).__name__, extra)
    first = errors[0]
    if len(errors) > 1 and hasattr(first, "add_note"):
        first.add_note(f"({len(errors) - 1} more error(s) in the same step were logged)")
    raise first

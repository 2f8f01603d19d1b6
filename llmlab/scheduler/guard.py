"""The failure rule for plugins' scheduler sides (docs/components.md): a hook that raises
is recorded as a :class:`~llmlab.errors.ComponentError` naming the plugin and the hook
(the engine raises it after the step) and answers its neutral default, so the step goes
on and the engine's state stays consistent, as with any other component. Only ``check``
may raise ``ValueError`` through: that is how it refuses an executor's answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmlab.errors import ComponentError
from llmlab.plugin import SchedulerPlugin

# Every hook the scheduler calls after binding, and what it answers when it raised.
NEUTRAL: dict[str, Any] = {
    "added": None, "admissible": True, "lookahead": None, "prefix_limit": None,
    "plan": None, "check": None, "settle": None, "commit": None, "forked": None,
    "recompute_only": False, "preempted": None, "finished": None, "begin_step": None,
    "report": None, "plans_ahead": False,
}


class Guarded:
    """A plugin's scheduler side behind the failure rule (see the module docstring)."""

    def __init__(self, plugin: SchedulerPlugin, record: Callable[[Exception], None]) -> None:
        self.plugin = plugin
        self.name = plugin.name
        for hook, default in NEUTRAL.items():
            setattr(self, hook, _guard(plugin, hook, default, record))

    def overrides(self, hook: str) -> bool:
        """Whether the plugin defines ``hook`` itself (not the do-nothing default)."""
        return getattr(type(self.plugin), hook) is not getattr(SchedulerPlugin, hook)


def _guard(plugin: Any, hook: str, default: Any, record: Callable[[Exception], None]):
    method = getattr(plugin, hook)
    through = ValueError if hook == "check" else ()

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except through:
            raise
        except ComponentError as err:
            record(err)
        except Exception as err:  # noqa: BLE001 - plugin code; raised after the step
            record(ComponentError.wrap("plugin", plugin, hook, err))
        return default

    call.__name__ = hook
    return call

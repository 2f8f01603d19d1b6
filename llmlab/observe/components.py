"""The names of the components an engine runs: a result table's first columns
(``compare``, ``simulate``), and what a data-parallel replica reports of itself when it is
ready (:class:`~llmlab.distributed.replica_process.ReplicaInfo`), so the front end can name
components that live in another process."""

from __future__ import annotations

COMPONENT_COLUMNS = ("scheduling_policy", "eviction_policy", "kv_press", "proposer", "router")
"""The keys of :func:`component_names`, in table order."""


def name_of(component: object) -> str:
    """A component's ``name``, else its class name; ``""`` for None (none there)."""
    if component is None:
        return ""
    return getattr(component, "name", None) or type(component).__name__


def component_names(engine: object) -> dict[str, str]:
    """Each component a run's result depends on, by name (``""`` where there is none): read
    from an :class:`~llmlab.engine.engine.Engine`'s parts (a router only where the engine
    has one: a data-parallel front end)."""
    # The scheduler holds its plugins guarded (scheduler/guard.py): the plugin inside.
    scheduler = engine.scheduler
    plugins = {p.name: getattr(p, "plugin", p) for p in getattr(scheduler, "plugins", ())}
    press = plugins.get("kv_press")
    speculator = getattr(getattr(engine, "executor", None), "speculator", None)
    return {
        "scheduling_policy": name_of(scheduler.policy),
        "eviction_policy": name_of(engine.kv_cache.eviction),
        "kv_press": name_of(getattr(press, "press", None)),
        "proposer": name_of(getattr(speculator, "proposer", None)),
        "router": name_of(getattr(engine, "router", None)),
    }

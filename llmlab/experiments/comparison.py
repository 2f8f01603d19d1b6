"""Run one workload through several engine configurations and compare them.

    comparison = compare(workload, {
        "fcfs+lru": {"scheduling_policy": "fcfs", "eviction_policy": "lru"},
        "fcfs+fifo": {"scheduling_policy": "fcfs", "eviction_policy": "fifo"},
    }, model=path, engine_kwargs={"dtype": "float32", "num_gpu_blocks_override": 64})
    comparison.table        # one row of metrics per configuration
    comparison.figure()     # one bar chart per key metric

Each configuration gets a fresh engine (the same seed unless a configuration sets its
own), runs the workload with every request injected at its arrival time (open loop: the
engine steps while it has work and waits for the next arrival when it has none), and is
released before the next one is built. Metrics come from the requests' outputs and the
engine's ``StepEvent``s; :mod:`llmlab.experiments.metrics` defines each of them.

A configuration with ``data_parallel_size > 1`` runs on that many replicas behind its
``router``, real or simulated, so one call compares routers on both:

    configs = {name: {"data_parallel_size": 2, "router": name}
               for name in ("round_robin", "prefix_aware")}
    compare(workload, configs, model=path)                    # replica processes
    compare(workload, configs, model=path, executor="sim")    # simulate(replicas=2, ...)
"""

from __future__ import annotations

import copy
import gc
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from llmlab import registry
from llmlab.config import EngineConfig
from llmlab.distributed.data_parallel import DataParallelEngine, resolve_router
from llmlab.engine.engine import Engine
from llmlab.observe.components import COMPONENT_COLUMNS, component_names, name_of
from llmlab.observe.events import StepEvent
from llmlab.experiments.driver import run_replicated, run_workload
from llmlab.experiments.metrics import (
    RecordColumns,
    RequestRecord,
    StepTrace,
    merge_traces,
    summarize,
)
from llmlab.experiments.workloads import Workload


COMPONENT_KEYS = ("scheduling_policy", "eviction_policy", "attention_backend", "sampler")
"""Keys of a configuration that take a component (an instance, or a registered name)."""
# Every key that may hold a component instance (the EngineConfig fields among them take
# one too, through LLM): copied per run.
_INSTANCE_KEYS = (*COMPONENT_KEYS, "kv_press", "plugins", "proposer", "router")

CONFIG_KEYS = tuple(f.name for f in attrs.fields(EngineConfig)) + COMPONENT_KEYS
"""Every key a configuration or ``engine_kwargs`` may hold: the ``LLM`` keywords."""

SIM_KEYS = ("cost_model", "hardware")
"""Keys a configuration may add with ``executor="sim"``."""

KEY_METRICS = (
    ("output_tokens_per_s", "throughput (output tok/s)"),
    ("ttft_mean_s", "TTFT mean (s)"),
    ("ttft_p99_s", "TTFT p99 (s)"),
    ("tpot_mean_s", "TPOT mean (s)"),
    ("prefix_hit_rate", "prefix-hit rate"),
    ("num_preemptions", "preemptions"),
    ("fairness_gap_tokens", "fairness gap (tokens)"),
)
"""The table columns :meth:`Comparison.figure` draws, with their axis titles."""

ModelOrFactory = str | os.PathLike | Callable[..., Any]


@attrs.frozen(eq=False, repr=False)
class Comparison:
    """The result of :func:`compare`.

    Attributes:
        workload: what was run.
        table: one row per configuration (index: label): the components' names, then the
            metrics of :mod:`llmlab.experiments.metrics`, then ``served[user]`` columns
            (with ``repeats > 1``: their means, spreads and overlaps, see :func:`compare`).
        requests: one row per request, configuration and run (columns ``label``,
            ``repeat``): the fields of
            :class:`~llmlab.experiments.metrics.RequestRecord` (times in seconds since the
            run's start) plus ``replica`` (the replica that served it; 0 on one engine),
            ``ttft_s`` and ``e2e_s``. ``output_token_ids`` is None where the simulator's
            cluster loop (a simulated ``data_parallel_size > 1``) kept no tokens.
        events: each configuration's ``StepEvent``s, in step order (its first run's); on
            several replicas, every replica's in order of ``end_time_s``, each with its
            replica's own ``step_index`` and block ids.
        runs: one row per run (columns ``label``, ``repeat``, then the table's): with
            ``repeats > 1`` the table summarizes these.
    """

    workload: Workload
    table: Any  # pandas.DataFrame
    requests: Any  # pandas.DataFrame
    events: Mapping[str, tuple[StepEvent, ...]]
    runs: Any = None  # pandas.DataFrame

    def figure(self, metrics: Sequence[str] | None = None, *, ncols: int = 4, fig=None):
        """A matplotlib ``Figure``: one bar chart per metric (default: those of
        :data:`KEY_METRICS` with a value in some run) across configurations (with
        ``repeats > 1``: the means, each with its 95% interval as an error bar), plus tokens
        served per user (stacked) when there are several users. Built with the object API,
        so it needs no display. ``fig``: draw into this figure or subfigure instead of a new
        one (it is returned)."""
        from matplotlib.figure import Figure

        titles = dict(KEY_METRICS)
        if metrics is None:
            # A metric with no value in any run (a fairness gap with one user) is left out.
            names = [m for m, _ in KEY_METRICS if self.table[m].astype(float).notna().any()]
        else:
            names = list(metrics)
        missing = [m for m in names if m not in self.table.columns]
        if missing:
            raise ValueError(
                f"unknown metric(s) {missing}; the table has {list(self.table.columns)}"
            )
        served = [c for c in self.table.columns if c.startswith("served[")]
        panels = len(names) + (len(served) > 1)
        ncols = max(1, min(ncols, panels))
        nrows = -(-panels // ncols)
        if fig is None:
            fig = Figure(figsize=(3.2 * ncols, 2.8 * nrows), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
        labels = [str(label) for label in self.table.index]
        colors = [f"C{i % 10}" for i in range(len(labels))]
        for ax, name in zip(axes, names, strict=False):
            values = self.table[name].astype(float).to_numpy()
            ci = f"{name}_ci95"  # with repeats: each bar's 95% interval
            yerr = self.table[ci].astype(float).to_numpy() if ci in self.table else None
            bars = ax.bar(labels, values, color=colors, yerr=yerr, capsize=3)
            ax.bar_label(bars, fmt="%.3g", fontsize="x-small")
            ax.set_title(titles.get(name, name), fontsize="medium")
            if not np.nanmax(values, initial=0.0) > 0:  # all zero or NaN: show an empty 0..1
                ax.set_ylim(0, 1)
        if len(served) > 1:
            ax = axes[len(names)]
            bottom = None
            for column in served:
                values = self.table[column].astype(float).to_numpy()
                ax.bar(labels, values, bottom=bottom, label=column[len("served["):-1])
                bottom = values if bottom is None else bottom + values
            ax.set_title("tokens served per user", fontsize="medium")
            ax.legend(fontsize="small")
        for ax in axes[:panels]:
            ax.tick_params(axis="x", labelrotation=30, labelsize="small")
        for ax in axes[panels:]:
            ax.set_visible(False)
        fig.suptitle(f"{self.workload.name}: {self.workload.num_requests} requests")
        return fig

    def _repr_html_(self) -> str:
        return self.table.to_html(float_format=lambda x: f"{x:.4g}")

    def __repr__(self) -> str:
        return (
            f"Comparison(workload={self.workload.name!r}, "
            f"{len(self.table)} configuration(s))\n{self.table.to_string()}"
        )


def compare(
    workload: Workload,
    configs: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Any]],
    *,
    model: ModelOrFactory,
    engine_kwargs: Mapping[str, Any] | None = None,
    progress: bool = True,
    executor: str = "engine",
    repeats: int = 1,
) -> Comparison:
    """Run ``workload`` on a fresh engine per configuration; return the metrics.

    Args:
        workload: the requests and their arrival times.
        configs: ``{label: {keyword: value}}``, or a sequence of dicts each with a
            ``"label"``; the keywords are ``LLM``'s (:data:`CONFIG_KEYS`): engine settings
            and components, given as instances or registered names. With
            ``data_parallel_size > 1`` the run is data-parallel behind ``router`` (a
            registered name, ``round_robin`` when unset, or an instance): on real engines
            ``LLM(model, data_parallel_size=N, router=...)``'s replica processes
            (:func:`~llmlab.experiments.driver.run_replicated`: requests join as the clock
            passes their arrival, up to one replica step late), in simulation
            :func:`~llmlab.sim.simulate` with ``replicas=N``. The row is the whole run's:
            every replica's requests, their traces merged
            (:func:`~llmlab.experiments.metrics.merge_traces`: a step is one replica's
            step, what each step-based column then means is said there), ``router``
            naming the router.
        model: a model directory or hub id, built with ``LLM(model, **kwargs)`` (a
            configuration may set its own ``model``); or a factory ``model(**kwargs)``
            returning an ``Engine``, a ``DataParallelEngine`` or an ``LLM`` around either,
            e.g. one with a simulated executor and a ``VirtualClock``, whose keywords are
            its own (not checked here).
        engine_kwargs: keywords shared by every configuration (a configuration's own value
            wins). Every component instance (here or in a configuration) is deep-copied for
            its run, so engines never share component state and the instances given are
            never used: the same configurations can run again.
        progress: show a tqdm bar (requests finished) per configuration.
        repeats: runs per configuration, interleaved (every configuration once, then
            again): the table then holds each metric's mean over the runs, its standard
            deviation (``<metric>_std``), the half-width of its 95% interval
            (``<metric>_ci95``, Student's t) and, for the :data:`KEY_METRICS`, the labels
            whose interval overlaps this one (``<metric>_overlaps``: a difference between
            those two is not shown by this many runs). ``runs`` keeps every run's row.
        executor: ``"engine"`` runs the real model; ``"sim"`` runs each configuration on
            :func:`~llmlab.sim.sim_engine` (the same scheduler and KV cache on a cost model,
            in virtual time), where the keywords may also hold ``cost_model`` and
            ``hardware``. The table's columns are the same either way.

    Raises ``ValueError`` before anything runs for an empty workload or ``configs``, a
    duplicate or empty label, an unknown keyword (naming it and the allowed ones), an
    unknown component or router name (the registry's message, which lists the available
    names), or a ``router`` without ``data_parallel_size > 1``; ``TypeError`` when a
    factory returns something else than what it may.
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a Workload, got {type(workload).__name__}")
    if workload.num_requests == 0:
        raise ValueError(f"workload {workload.name!r} has no requests; give at least one")
    if executor not in ("engine", "sim"):
        raise ValueError(f"executor must be 'engine' or 'sim', got {executor!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    simulated = executor == "sim"
    if simulated and callable(model):
        raise ValueError("executor='sim' builds its own engines: give model as a path or None")
    is_llm = not callable(model)
    shared = _check_settings("engine_kwargs", engine_kwargs or {}, is_llm=is_llm,
                             simulated=simulated)
    runs = _labelled(configs)
    for label, settings in runs.items():
        _check_settings(f"configs[{label!r}]", settings, is_llm=is_llm, simulated=simulated)
        if is_llm:
            _check_router(label, {**shared, **settings})
            _check_engine_config(model, label, {**shared, **settings})

    import pandas as pd

    per_run, request_frames, events = [], [], {}
    # Interleaved (A B A B, not A A B B): a drift of the machine over the session then
    # spreads over every configuration instead of biasing the ones run last.
    for repeat in range(repeats):
        for label, settings in runs.items():
            # Every component instance is deep-copied for its run: an engine claims the
            # instances it is built with (they keep its state), so the ones given stay
            # fresh, and a comparison can run again on the same configurations.
            merged = {k: copy.deepcopy(v) if k in _INSTANCE_KEYS and not isinstance(v, str)
                      else v for k, v in {**shared, **settings}.items()}
            names, records, traces = _run(model, merged, simulated, workload, label, progress)
            trace = traces[0] if len(traces) == 1 else merge_traces(traces)
            per_run.append({"label": label, "repeat": repeat, **names,
                            **summarize(_everyone(records), trace, workload.users)})
            request_frames.append(_requests_frame(label, records, repeat))
            events.setdefault(label, tuple(trace.events))
    runs_frame = pd.DataFrame(per_run)
    table = _spread_table(runs_frame) if repeats > 1 else (
        runs_frame.drop(columns="repeat").set_index("label"))
    requests = pd.concat(request_frames, ignore_index=True)
    return Comparison(workload=workload, table=table, requests=requests, events=events,
                      runs=runs_frame)


# -- helpers -----------------------------------------------------------------------------


def _labelled(configs: object) -> dict[str, dict[str, Any]]:
    """``{label: settings}`` from a mapping, or from a sequence of dicts with ``"label"``."""
    if isinstance(configs, Mapping):
        items = list(configs.items())
    elif isinstance(configs, Sequence) and not isinstance(configs, (str, bytes)):
        items = []
        for i, config in enumerate(configs):
            if not isinstance(config, Mapping) or "label" not in config:
                raise ValueError(
                    f"configs[{i}] must be a dict with a 'label' key when configs is a "
                    f"list, got {config!r}"
                )
            items.append((config["label"], {k: v for k, v in config.items() if k != "label"}))
    else:
        raise TypeError(
            f"configs must be a dict {{label: settings}} or a list of dicts with a 'label', "
            f"got {type(configs).__name__}"
        )
    if not items:
        raise ValueError("configs is empty; give at least one configuration")
    runs: dict[str, dict[str, Any]] = {}
    for label, settings in items:
        if not isinstance(label, str) or not label:
            raise ValueError(f"configuration labels must be non-empty strs, got {label!r}")
        if label in runs:
            raise ValueError(f"configuration label {label!r} is used twice; labels must differ")
        if not isinstance(settings, Mapping):
            raise TypeError(
                f"configs[{label!r}] must be a dict of LLM keywords, got "
                f"{type(settings).__name__}"
            )
        runs[label] = dict(settings)
    return runs


def _check_settings(
    where: str, settings: object, *, is_llm: bool, simulated: bool = False
) -> dict[str, Any]:
    """Keys and component names of ``LLM`` keywords (a factory's keywords are its own)."""
    if not isinstance(settings, Mapping):
        raise TypeError(f"{where} must be a dict of keywords, got {type(settings).__name__}")
    if not is_llm:
        return dict(settings)
    allowed = CONFIG_KEYS + SIM_KEYS if simulated else CONFIG_KEYS
    unknown = sorted(set(settings) - set(allowed), key=str)
    if unknown:
        raise ValueError(
            f"{where} has unknown key(s) {unknown}; allowed: {', '.join(allowed)}"
        )
    if simulated:
        for kind in COMPONENT_KEYS[2:]:
            if settings.get(kind) is not None:
                raise ValueError(
                    f"{where} sets {kind}, which the simulator has none of (it runs no model)"
                )
    for kind in COMPONENT_KEYS[:3]:
        if isinstance(settings.get(kind), str):
            registry.resolve(kind, settings[kind])  # an unknown name lists the known ones
    return dict(settings)


def _check_router(label: str, settings: dict[str, Any]) -> None:
    """A configuration's router (with ``engine_kwargs``'): only with ``data_parallel_size
    > 1`` (a router picks among replicas), and one the registry can build."""
    router, config = settings.get("router"), settings.get("router_config")
    if router is None and not config:
        return
    replicas = settings.get("data_parallel_size", 1)
    if not (isinstance(replicas, int) and replicas > 1):
        raise ValueError(
            f"configs[{label!r}] sets router={router!r} with data_parallel_size="
            f"{replicas!r}: a router picks each request's replica, so it needs "
            "data_parallel_size > 1 (an int, here or in engine_kwargs); set one, or leave "
            "router and router_config unset"
        )
    resolve_router(router, config)  # an unknown name: the registry lists the known ones


def _check_engine_config(model: str | os.PathLike, label: str, settings: dict) -> None:
    """Build the ``EngineConfig`` now, so a bad value fails before any configuration runs."""
    values = {k: v for k, v in settings.items() if k not in COMPONENT_KEYS + SIM_KEYS}
    if not isinstance(values.get("router"), (str, type(None))):
        del values["router"]  # an instance (checked already): the config holds names only
    values.setdefault("model", model if model is not None else "built-in")
    try:
        EngineConfig(**values)
    except (TypeError, ValueError) as err:
        if hasattr(err, "add_note"):  # Python >= 3.11
            err.add_note(f"(in configuration {label!r})")
        raise


def _run(
    model: ModelOrFactory, settings: dict[str, Any], simulated: bool, workload: Workload,
    label: str, progress: bool,
) -> tuple[dict[str, str], list, list[StepTrace]]:
    """One run of one configuration on a fresh engine, released after it: its components'
    names, then per replica (one for a single engine) the records of the requests it
    served and its step trace."""
    replicas = settings.get("data_parallel_size", 1)
    if simulated and replicas > 1:
        return _simulate_replicas(model, settings, workload, label, progress)
    engine = _build(model, settings, simulated)
    try:
        if isinstance(engine, DataParallelEngine):
            collectors = run_replicated(engine, workload, label=label, progress=progress)
            # The replicas' components live in their processes: each reported its names.
            names = {**engine.replicas[0].info.components, "router": name_of(engine.router)}
            return (names, [list(c.records.values()) for c in collectors],
                    [c.trace for c in collectors])
        records, trace = run_workload(engine, workload, label=label, progress=progress)
        return component_names(engine), [records], [trace]
    finally:
        if isinstance(engine, DataParallelEngine):
            engine.shutdown()
        del engine
        _release_memory()


def _simulate_replicas(
    model: ModelOrFactory, settings: dict[str, Any], workload: Workload, label: str,
    progress: bool,
) -> tuple[dict[str, str], list, list[StepTrace]]:
    """:func:`_run` in simulation with ``data_parallel_size`` replicas: the simulator's
    cluster loop, behind the same router."""
    from llmlab.sim.run import simulate

    settings = dict(settings)
    replicas = settings.pop("data_parallel_size")
    router = resolve_router(settings.pop("router", None), settings.pop("router_config", None))
    result = simulate(workload, model=settings.pop("model", model), replicas=replicas,
                      router=router, progress=progress, keep_events=True, name=label,
                      **settings)
    names = {column: result.overall[column] for column in COMPONENT_COLUMNS}
    return names, list(result.records), list(result.traces)


def _everyone(records: list) -> list[RequestRecord] | RecordColumns:
    """Every replica's records as one set (the simulator's cluster loop keeps columns)."""
    if len(records) == 1:
        return records[0]
    if isinstance(records[0], RecordColumns):
        merged = RecordColumns()
        for columns in records:
            merged.extend(columns)
        return merged
    return [record for part in records for record in part]


def _build(model: ModelOrFactory, settings: dict[str, Any],
           simulated: bool = False) -> Engine | DataParallelEngine:
    if simulated:
        from llmlab.sim.engine import sim_engine

        settings = dict(settings)
        return sim_engine(settings.pop("model", model), **settings)
    if callable(model):
        built = model(**settings)
    else:
        from llmlab.entrypoints.llm import LLM

        settings = dict(settings)
        built = LLM(settings.pop("model", model), **settings)
    engine = getattr(built, "llm_engine", built)
    if not isinstance(engine, (Engine, DataParallelEngine)):
        inner = f" around a {type(engine).__name__}" if engine is not built else ""
        raise TypeError(
            "the model factory must return an Engine, a DataParallelEngine, or an LLM "
            f"around either; got {type(built).__name__}{inner}"
        )
    return engine


def _requests_frame(label: str, records: list, repeat: int = 0):
    """One row per request in arrival order, from each replica's records (a list of
    :class:`RequestRecord`, or the simulator's cluster loop's columns, which keep no
    token ids)."""
    import pandas as pd

    frames = []
    for replica, part in enumerate(records):
        if isinstance(part, RecordColumns):
            frame = part.to_pandas()
            frame["request_id"] = frame["request_id"].astype(str)
            frame["output_token_ids"] = None
            frame = frame[[f.name for f in attrs.fields(RequestRecord)]]  # records' order
        elif part:
            frame = pd.DataFrame([attrs.asdict(r, recurse=False) for r in part])
        else:
            continue  # a replica that served nothing
        frame.insert(1, "replica", replica)
        frames.append(frame)
    frame = pd.concat(frames, ignore_index=True).sort_values(
        "request_id", key=lambda ids: ids.astype(int), ignore_index=True)
    for column in ("first_token_s", "finish_s", "ttft_steps", "e2e_steps"):
        frame[column] = frame[column].astype(float)  # None (never reached): NaN
    frame["ttft_s"] = frame["first_token_s"] - frame["arrival_s"]
    frame["e2e_s"] = frame["finish_s"] - frame["arrival_s"]
    frame.insert(0, "repeat", repeat)
    frame.insert(0, "label", label)
    return frame


# Student's t at 97.5% for 1..30 degrees of freedom (then the normal's 1.96): a 95% interval
# of the mean of n runs is mean +- t[n - 1] * std / sqrt(n).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def _spread_table(runs):
    """One row per label from every run's row: the names, each metric's mean, ``_std``
    (sample standard deviation) and ``_ci95`` (the 95% interval's half-width), and for
    the key metrics the labels whose interval overlaps (``_overlaps``)."""
    import pandas as pd

    groups = runs.groupby("label", sort=False)
    names = [c for c in runs.columns if c not in ("label", "repeat")
             and not pd.api.types.is_numeric_dtype(runs[c])]
    metrics = [c for c in runs.columns if c not in ("label", "repeat") and c not in names]
    n = groups.size()
    mean = groups[metrics].mean()
    std = groups[metrics].std(ddof=1)
    t = n.map(lambda k: _T975[k - 2] if 2 <= k <= 31 else 1.96)
    half = std.mul(t / np.sqrt(n), axis=0)
    table = groups[names].first().join(mean)
    for m in metrics:
        table[f"{m}_std"] = std[m]
        table[f"{m}_ci95"] = half[m]
    labels = list(table.index)
    for m, _title in KEY_METRICS:
        if m not in mean:
            continue
        lo, hi = mean[m] - half[m], mean[m] + half[m]
        table[f"{m}_overlaps"] = [
            ", ".join(str(o) for o in labels if o != a and lo[a] <= hi[o] and lo[o] <= hi[a])
            for a in labels
        ]
    table["num_runs"] = n
    return table


def _release_memory() -> None:
    """Free a finished engine's tensors before the next one is built (its KV cache may
    take most of the device)."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()

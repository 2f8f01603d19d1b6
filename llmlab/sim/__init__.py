"""The simulator: the real scheduler and KV cache on a cost model, at cluster scale.

The engine takes an executor and a clock; the simulator swaps only those. A
:class:`SimulatedExecutor` prices each scheduled batch with a :class:`CostModel` (the
whole step, host time included), advances a virtual clock, and hands back placeholder
tokens until each request reaches its ``max_tokens``. The scheduler, the KV cache manager,
prefix caching, preemption, speculative lookahead (at the ``synthetic`` proposer's
acceptance rates) and every policy component run unchanged: a policy studied here is the
code that runs for real.

    from llmlab.sim import ProfiledCostModel, read_trace, simulate
    from llmlab.observe.recording import load

    cost = ProfiledCostModel.fit(load("real_run.jsonl"))    # or RooflineCostModel / "roofline"
    result = simulate(read_trace("mooncake.jsonl", vocab_size=32000), model=path,
                      cost_model=cost, replicas=4, router="prefix_aware")
    result.table                                          # per replica and overall

Pieces: :mod:`~llmlab.sim.shape` (what a step costs by), :mod:`~llmlab.sim.cost_model`
(the contract, checked; replaying a real run; overlapped steps), :mod:`~llmlab.sim.host`
(the engine's host time, hidden and not by overlap), :mod:`~llmlab.sim.roofline` (hardware
presets), :mod:`~llmlab.sim.experts` (how a mixture of experts' tokens spread), :mod:`~llmlab.sim.profiled` (fitted), :mod:`~llmlab.sim.executor`,
:mod:`~llmlab.sim.engine` (:func:`sim_engine`), :mod:`~llmlab.sim.run`
(:func:`simulate`), :mod:`~llmlab.sim.traces` (Azure, Mooncake, BurstGPT, recordings),
:mod:`~llmlab.sim.report` (real vs simulated figures). ``compare(...,
executor="sim")`` runs :func:`llmlab.experiments.compare`'s configurations here.
"""

from llmlab.sim.cost_model import (
    CostModel,
    ReplayCostModel,
    measured_step_times,
    step_time,
)
from llmlab.sim.engine import sim_engine
from llmlab.sim.experts import ExpertRouting
from llmlab.sim.executor import SimulatedExecutor
from llmlab.sim.host import HostCost
from llmlab.sim.profiled import ProfiledCostModel
from llmlab.sim.roofline import (
    Hardware,
    ModelShape,
    RooflineCostModel,
    hardware,
    hardware_names,
)
from llmlab.sim.run import SimulationResult, simulate
from llmlab.sim.shape import FEATURES, BatchShape
from llmlab.sim.traces import Trace, read_trace

__all__ = [
    "FEATURES",
    "BatchShape",
    "CostModel",
    "ExpertRouting",
    "Hardware",
    "HostCost",
    "ModelShape",
    "ProfiledCostModel",
    "ReplayCostModel",
    "RooflineCostModel",
    "SimulatedExecutor",
    "SimulationResult",
    "Trace",
    "hardware",
    "hardware_names",
    "measured_step_times",
    "read_trace",
    "sim_engine",
    "simulate",
    "step_time",
]

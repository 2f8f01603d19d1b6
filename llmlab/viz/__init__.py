"""See the engine: live KV-cache, scheduler and metrics views, recordings and replay.

    from llmlab import LLM, SamplingParams
    from llmlab.viz import KVCacheView, SchedulerTimeline, load

    llm = LLM(model, num_gpu_blocks_override=64)
    view = KVCacheView(llm)            # follows the engine's step events from now on
    view.display()                     # a grid of blocks, colored by owning request
    with llm.llm_engine.record("run.jsonl"):
        llm.generate(prompts, SamplingParams(max_tokens=64))   # the grid updates live
    view.to_png("kv.png")

    replay = KVCacheView(load("run.jsonl"))   # the same frames, with a slider and play
    SchedulerTimeline("run.jsonl").display()

Views consume :class:`~llmlab.observe.events.StepEvent`\\ s only (plus the snapshot taken when
they attach), never engine internals; :mod:`llmlab.viz.state` holds the event-folding
models they draw, usable without any widget.
"""

from llmlab.observe.recording import Recorder, Recording, load
from llmlab.viz.state import Frame, KVCacheState, MetricSeries, SchedulerSeries
from llmlab.viz.views import (
    ExpertLoadView,
    KVCacheView,
    MetricsPanel,
    PolicyComparison,
    SchedulerTimeline,
    SpeculationView,
)

__all__ = [
    "ExpertLoadView",
    "Frame",
    "KVCacheState",
    "KVCacheView",
    "MetricSeries",
    "MetricsPanel",
    "PolicyComparison",
    "Recorder",
    "Recording",
    "SchedulerSeries",
    "SchedulerTimeline",
    "SpeculationView",
    "load",
]

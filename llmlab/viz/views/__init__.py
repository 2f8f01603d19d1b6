"""Notebook views of a running engine or a recording (ipywidgets + matplotlib).

Every view is fed by step events only: attached to a live engine it starts from
``Engine.observe`` (a snapshot, then each event as it happens); given a
:class:`~llmlab.observe.recording.Recording` it replays the same events with a slider and a
play button. Redraws are throttled (at most every ``interval`` seconds, and at most a
``draw_budget`` share of the time) so watching costs the engine little; once events stop
(the engine went idle or paused) a timer draws the newest state, so the last frame is
always shown. Each
view has ``display()``, ``figure()`` (a matplotlib ``Figure``) and ``to_png(path)``.

ipywidgets is imported only when a widget is shown; ``figure``/``to_png`` need only
matplotlib, so views work in scripts and tests too.

One view per module: ``base`` (the shared plumbing, colors), ``kv_cache``, ``timeline``,
``metrics``, ``comparison``, ``speculation`` and ``experts``; every name is importable from
here as before.
"""

from llmlab.viz.views.base import CACHED_COLOR as CACHED_COLOR
from llmlab.viz.views.base import COMPACTED_MARK as COMPACTED_MARK
from llmlab.viz.views.base import EMPTY_COLOR as EMPTY_COLOR
from llmlab.viz.views.base import PALETTE as PALETTE
from llmlab.viz.views.base import PARTIAL_WASH as PARTIAL_WASH
from llmlab.viz.views.base import SHARED_MARK as SHARED_MARK
from llmlab.viz.views.base import request_color as request_color
from llmlab.viz.views.comparison import PolicyComparison
from llmlab.viz.views.experts import ExpertLoadView
from llmlab.viz.views.kv_cache import KVCacheView
from llmlab.viz.views.metrics import MetricsPanel
from llmlab.viz.views.speculation import SpeculationView
from llmlab.viz.views.timeline import SchedulerTimeline

__all__ = [
    "ExpertLoadView",
    "KVCacheView",
    "MetricsPanel",
    "PolicyComparison",
    "SchedulerTimeline",
    "SpeculationView",
]

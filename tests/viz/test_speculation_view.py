"""``SpeculationView`` draws exactly ``SpecDecodeStats``' numbers, from step events alone.

Synthetic events (only what the stats read) are replayed as a recording; one test follows a
real engine speculating with ``ngram``.
"""

from __future__ import annotations

import math
import pathlib

import attrs
import numpy as np
import pytest

from llmlab.cache.kv_cache_manager import CacheSnapshot
from llmlab.observe.events import EngineSnapshot, StepEvent
from llmlab.observe.recording import Recording
from llmlab.speculative.stats import SpecDecodeStats
from llmlab.viz import SpeculationView
from llmlab.viz.views.speculation import CONDITIONAL_TITLE, UNCONDITIONAL_TITLE


def event(step_index: int, speculated=()) -> StepEvent:
    return StepEvent(
        step_index=step_index, scheduled=(), scheduled_users=(), scheduled_priorities=(),
        num_batched_tokens=0, preempted=(), finished=(), aborted=(), blocks_allocated=(),
        blocks_freed=(), blocks_prefix_hit=(), blocks_evicted=(), blocks_forked=(),
        num_free_blocks=0, num_total_blocks=0, kv_usage=0.0, num_waiting=0, num_running=1,
        wall_time_s=0.0, model_time_s=0.0, end_time_s=float(step_index),
        speculated=tuple(speculated),
    )


def recording(events) -> Recording:
    kv = CacheSnapshot(np.zeros(4, np.int32), np.zeros(4, bool), {}, 4)
    snapshot = EngineSnapshot(0, 4, 4, kv, {}, 0, 0, 0.0)
    return Recording(pathlib.Path("synthetic.jsonl"), {}, {}, snapshot, tuple(events), True)


# (request, drafted, accepted) per step. Step 2 speculated nothing; b's (0, 0) is no draft;
# a's (3, 0) leaves positions 2 and 3 unverified, so one position's conditional rate is NaN
# in the first half (only steps 0 and 1).
EVENTS = [
    event(0, [("a", 3, 0)]),
    event(1, [("a", 4, 2), ("b", 0, 0)]),
    event(2),
    event(3, [("a", 4, 4), ("b", 2, 1)]),
    event(4, [("a", 1, 1)]),
    event(5, [("b", 4, 3), ("c", 3, 3)]),
]


def stats_of(events) -> SpecDecodeStats:
    stats = SpecDecodeStats()
    for e in events:
        stats(e)
    return stats


def axes_of(fig) -> dict[str, object]:
    unconditional, conditional, rate, length = fig.axes
    assert unconditional.get_title() == UNCONDITIONAL_TITLE
    assert conditional.get_title() == CONDITIONAL_TITLE
    return {"unconditional": unconditional, "conditional": conditional, "rate": rate,
            "length": length}


def same(got, want) -> bool:
    """Equal lists of floats, NaN equal to NaN."""
    return len(got) == len(want) and all(
        (math.isnan(g) and math.isnan(w)) or math.isclose(g, w) for g, w in zip(got, want)
    )


def same_counts(a, b) -> bool:
    """Every count and step of two ``SpecDecodeStats`` (which compare by identity)."""
    return attrs.asdict(a) == attrs.asdict(b)


def bar_heights(ax) -> list[list[float]]:
    return [[float(p.get_height()) for p in container] for container in ax.containers]


def test_bars_are_the_stats_per_position_rates_at_every_replayed_step():
    view = SpeculationView(recording(EVENTS))
    for position in range(len(EVENTS) + 1):
        view.seek(position)
        want = stats_of(EVENTS[:position])
        assert same_counts(view.stats, want)
        axes = axes_of(view.figure())
        [unconditional] = bar_heights(axes["unconditional"])
        [conditional] = bar_heights(axes["conditional"])
        assert same(unconditional, want.per_position_acceptance_rate), position
        assert same(conditional, want.per_position_conditional_rate), position
        bars = axes["unconditional"].containers[0]
        assert [p.get_x() + p.get_width() / 2 for p in bars] == pytest.approx(
            range(1, len(want.drafted_per_pos) + 1)
        )
    # The hand-worked numbers: drafts a 3/0, a 4/2, a 4/4, b 2/1, a 1/1, b 4/3, c 3/3.
    assert view.stats.drafted_per_pos == [7, 6, 5, 3]
    assert view.stats.accepted_per_pos == [6, 4, 3, 1]
    assert view.stats.reached_per_pos == [7, 5, 4, 2]
    view.seek(2)  # a 3/0 and a 4/2 only: position 4 was drafted once, never verified
    axes = axes_of(view.figure())
    assert same(bar_heights(axes["conditional"])[0], [1 / 2, 1 / 1, 0 / 1, math.nan])


def test_time_series_are_per_step_and_rolling_acceptance():
    view = SpeculationView(recording(EVENTS), window_steps=2)
    axes = axes_of(view.figure())
    per_step, rolling_rate = axes["rate"].get_lines()
    [length] = axes["length"].get_lines()
    steps = [0, 1, 3, 4, 5]  # step 2 drafted nothing: no point
    for line in (per_step, rolling_rate, length):
        assert list(line.get_xdata()) == steps
    # Per step: (drafts, drafted tokens, accepted) = (1, 3, 0), (1, 4, 2), (2, 6, 5),
    # (1, 1, 1), (2, 7, 6).
    assert list(per_step.get_ydata()) == pytest.approx([0 / 3, 2 / 4, 5 / 6, 1 / 1, 6 / 7])
    assert per_step.get_ydata() == pytest.approx(
        [step.totals.acceptance_rate for step in view.stats.series]
    )
    # Two drafting steps at a time.
    assert list(rolling_rate.get_ydata()) == pytest.approx(
        [0 / 3, 2 / 7, 7 / 10, 6 / 7, 7 / 8]
    )
    assert list(length.get_ydata()) == pytest.approx(
        [1 + 0 / 1, 1 + 2 / 2, 1 + 7 / 3, 1 + 6 / 3, 1 + 7 / 3]
    )
    # A window longer than the run ends at the run's totals.
    whole = SpeculationView(recording(EVENTS), window_steps=100)
    _, rolling_rate = axes_of(whole.figure())["rate"].get_lines()
    [length] = axes_of(whole.figure())["length"].get_lines()
    assert rolling_rate.get_ydata()[-1] == pytest.approx(view.stats.acceptance_rate)
    assert length.get_ydata()[-1] == pytest.approx(view.stats.mean_acceptance_length)


def test_without_speculation_the_plots_are_empty_and_say_so(tmp_path):
    for events in ([], [event(0), event(1, [("a", 0, 0)])]):
        view = SpeculationView(recording(events))
        fig = view.figure()
        axes = axes_of(fig)
        assert all(not ax.containers or not bar_heights(ax)[0]
                   for ax in (axes["unconditional"], axes["conditional"]))
        assert all(len(line.get_xdata()) == 0
                   for ax in (axes["rate"], axes["length"]) for line in ax.get_lines())
        assert all("no drafts" in [t.get_text() for t in ax.texts] for ax in fig.axes)
        assert view.to_png(tmp_path / "empty.png").read_bytes()[:4] == b"\x89PNG"
    assert math.isnan(view.stats.acceptance_rate)


def test_several_runs_are_drawn_side_by_side():
    first, second = EVENTS[:2], EVENTS[3:]
    view = SpeculationView({"early": recording(first), "late": list(second)})
    assert not view.live
    assert set(view.runs) == {"early", "late"}
    fig = view.figure()
    axes = axes_of(fig)
    for name, rates in (("unconditional", "per_position_acceptance_rate"),
                        ("conditional", "per_position_conditional_rate")):
        ax = axes[name]
        assert [c.get_label() for c in ax.containers] == ["early", "late"]
        heights = bar_heights(ax)
        assert same(heights[0], getattr(stats_of(first), rates))
        assert same(heights[1], getattr(stats_of(second), rates))
        # One bar per run at each position, side by side, not on top of each other.
        assert ax.containers[0][0].get_x() < ax.containers[1][0].get_x()
    for ax, lines_per_run in ((axes["rate"], 2), (axes["length"], 1)):
        steps = [list(line.get_xdata()) for line in ax.get_lines()]
        # Each run's steps count from its start: "late" began at step 3.
        assert steps == [[0, 1]] * lines_per_run + [[0, 1, 2]] * lines_per_run
    [legend] = fig.legends
    late = stats_of(second)
    assert [t.get_text() for t in legend.get_texts()][1] == (
        f"late: acceptance rate {late.acceptance_rate:.2f}, mean acceptance length "
        f"{late.mean_acceptance_length:.2f}"
    )
    with pytest.raises(ValueError, match="several runs"):
        view.seek(0)
    with pytest.raises(AttributeError, match="runs\\[label\\]"):
        view.stats  # noqa: B018


def test_it_follows_a_speculating_engine_live_like_the_llms_own_stats(tmp_path):
    from llmlab import LLM, SamplingParams
    from llmlab.builtin import builtin_model_path

    llm = LLM(str(builtin_model_path()), num_gpu_blocks_override=64, max_model_len=256,
              disable_log_stats=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "speculation_length": "fixed"})
    story = "Once upon a time there was a cat. The cat liked to sit in the sun. "
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    llm.generate([story], greedy, use_tqdm=False)  # before the views: not theirs
    first_step = llm.llm_engine.snapshot().step_index
    llm.spec_decode_stats.reset()
    one, several = SpeculationView(llm), SpeculationView({"ngram": llm})
    assert one.live and several.live
    llm.generate([story * 3], greedy, use_tqdm=False)
    want = llm.spec_decode_stats
    assert want.num_drafts > 0
    assert same_counts(one.stats, want) and same_counts(several.runs["ngram"], want)
    for view in (one, several):  # steps count from the view's start
        per_step, _ = axes_of(view.figure())["rate"].get_lines()
        assert list(per_step.get_xdata()) == [s.step_index - first_step for s in want.series]
    assert several.to_png(tmp_path / "several.png").stat().st_size > 0
    observers = len(llm.llm_engine.observers)
    one.close()
    several.close()
    assert len(llm.llm_engine.observers) == observers - 2
    # The LLM's own stats compare equal to the view's: still there, not taken out by mistake.
    assert any(o is llm.spec_decode_stats for o in llm.llm_engine.observers)
    assert not several.live


def test_bad_sources_and_settings_are_named():
    with pytest.raises(ValueError, match="window_steps"):
        SpeculationView(recording([]), window_steps=0)
    with pytest.raises(ValueError, match="empty"):
        SpeculationView({})
    with pytest.raises(ValueError, match="labels"):
        SpeculationView({"": []})
    with pytest.raises(TypeError, match="run 'x'.*int"):
        SpeculationView({"x": 42})
    with pytest.raises(ValueError, match="interval"):
        SpeculationView({"x": []}, interval=1.0)
    with pytest.raises(TypeError, match="LLM, Engine or AsyncEngine"):
        SpeculationView(42)

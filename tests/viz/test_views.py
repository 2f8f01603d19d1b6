"""The views follow the engine through step events only, and say what really happened.

Each test drives a real engine (tiny random Llama, small block pools so that prefix hits,
preemption and eviction happen) and asserts on the views' state: the frame against the
KV cache manager's own snapshot after every step, the drawn grid against the frame, and a
replayed recording against the live frames.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from llmlab import LLM, SamplingParams
from llmlab.viz import KVCacheView, MetricsPanel, SchedulerTimeline, load
from llmlab.viz.state import CACHED, EMPTY, SHARED, USED
from llmlab.viz.views import CACHED_COLOR, EMPTY_COLOR, PALETTE

SHARED_PREFIX = [7] * 24  # six full blocks of 4


def _llm(model: str, blocks: int = 48, **kwargs) -> LLM:
    return LLM(
        model,
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=blocks,
        max_model_len=128,
        **kwargs,
    )


def _prompts(k: int) -> list[dict]:
    return [{"prompt_token_ids": SHARED_PREFIX + [10 + i] * (5 + 3 * i)} for i in range(k)]


def _truth_checker(llm: LLM, view: KVCacheView, failures: list):
    """An observer (subscribed after the view) comparing its frame with the engine."""
    engine = llm.llm_engine

    def check(event):
        snapshot = engine.snapshot()
        truth = snapshot.kv
        frame = view.frame
        bs = snapshot.block_size
        for rid, table in truth.block_tables.items():
            computed = snapshot.num_computed[rid]
            for i, block in enumerate(table):
                if frame.owner_ids()[block] == rid:
                    want = bs if truth.cached[block] else min(bs, max(0, computed - i * bs))
                    if frame.tokens[block] != want:
                        failures.append(f"step {event.step_index}: block {block} tokens "
                                        f"{frame.tokens[block]} != {want}")
        if not np.array_equal(frame.refs, truth.ref_counts):
            failures.append(f"step {event.step_index}: ref counts differ")
        if not np.array_equal(frame.indexed, truth.cached):
            failures.append(f"step {event.step_index}: cached flags differ")
        owners = frame.owner_ids()
        for table in truth.block_tables.values():
            for block in table:
                if owners[block] not in truth.block_tables:
                    failures.append(f"step {event.step_index}: block {block} owner {owners[block]}")
        free = truth.ref_counts == 0
        expected = np.where(truth.cached, CACHED, EMPTY)[free]
        if not np.array_equal(frame.state[free], expected):
            failures.append(f"step {event.step_index}: free block states differ")

    engine.subscribe(check)
    return check


def _cell_colors(html: str) -> list[tuple[str, bool]]:
    return [(color, "box-shadow" in rest) for color, rest in _cell_styles(html)]


def _cell_styles(html: str) -> list[tuple[str, str]]:
    return re.findall(r'class="llmlab-kv-cell" style="background:(#[0-9a-f]{6})([^"]*)"', html)


def test_frames_match_the_cache_through_hits_forks_preemption_and_eviction(tiny_llama):
    # Synchronous (a GPU would default to overlap): there a request admitted while a batch
    # runs has its blocks in the live cache one event before its computed tokens are told
    # (the event of the step that commits it), so the per-block fill lags by one frame.
    llm = _llm(tiny_llama, async_scheduling=False)
    view = KVCacheView(llm, keep_frames=True)
    failures: list[str] = []
    _truth_checker(llm, view, failures)
    events = []
    llm.llm_engine.subscribe(events.append)
    llm.generate(_prompts(6), SamplingParams(max_tokens=60, ignore_eos=True), use_tqdm=False)
    llm.generate(
        _prompts(2), SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=1), use_tqdm=False
    )
    assert not failures, failures[:5]
    # The workload did what the test is about.
    assert any(e.preempted for e in events)
    assert any(e.blocks_prefix_hit for e in events)
    assert any(e.blocks_evicted for e in events)
    assert any(e.blocks_forked for e in events)
    assert len(view.frames) == len(events) + 1  # the snapshot, then one per event


def test_the_grid_colors_exactly_the_blocks_in_use_and_marks_shared_ones(tiny_llama):
    llm = _llm(tiny_llama, blocks=64)
    view = KVCacheView(llm)
    seen = []

    def look(event):
        frame = view.frame
        seen.append((frame, _cell_styles(view.html(frame))))

    llm.llm_engine.subscribe(look)
    llm.generate(_prompts(1), SamplingParams(max_tokens=2), use_tqdm=False)  # caches the prefix
    llm.generate(_prompts(3), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    shared_seen = partial_seen = False
    for frame, cells in seen:
        assert len(cells) == frame.num_blocks
        partial_seen |= any("gradient" in style for _, style in cells)
        colored = [c for c, _ in cells if c in PALETTE]
        assert len(colored) == frame.num_in_use == int(np.count_nonzero(frame.refs))
        for block, (color, style) in enumerate(cells):
            state = frame.state[block]
            assert ("box-shadow" in style) == (state == SHARED)
            # A partly written block is washed out past its tokens.
            partial = state in (USED, SHARED) and frame.tokens[block] < 4
            assert ("gradient" in style) == partial
            if partial:
                assert f"transparent {round(100 * frame.tokens[block] / 4)}%" in style
            if state == CACHED:
                assert color == CACHED_COLOR
            elif state == EMPTY:
                assert color == EMPTY_COLOR
            else:
                assert color == PALETTE[frame.owner[block] % len(PALETTE)]
        if any(frame.state == SHARED):
            shared_seen = True
            # The shared blocks are the prompt's common prefix: held by every running
            # request that hit it, and full.
            shared = np.flatnonzero(frame.state == SHARED)
            assert (frame.refs[shared] >= 2).all()
            assert (frame.tokens[shared] == 4).all()
    assert shared_seen and partial_seen


def test_a_preempted_requests_blocks_disappear_in_the_next_frame(tiny_llama):
    llm = _llm(tiny_llama, blocks=40, enable_prefix_caching=False)
    view = KVCacheView(llm, keep_frames=True)
    events = []
    llm.llm_engine.subscribe(events.append)
    prompts = [{"prompt_token_ids": [5 + i] * 20} for i in range(3)]
    llm.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True), use_tqdm=False)
    checked = 0
    for i, event in enumerate(events):
        for rid in event.preempted:
            before, after = view.frames[i], view.frames[i + 1]
            assert before.blocks_of(rid), "it held blocks before"
            assert after.blocks_of(rid) == []
            index = after.requests.index(rid)
            assert not (after.owner == index).any()
            checked += 1
    assert checked


def test_an_evicted_cached_block_changes_state(tiny_llama):
    llm = _llm(tiny_llama, blocks=32)
    view = KVCacheView(llm, keep_frames=True)
    events = []
    llm.llm_engine.subscribe(events.append)
    llm.generate(_prompts(1), SamplingParams(max_tokens=2), use_tqdm=False)
    cached = np.flatnonzero(view.frame.state == CACHED)
    assert cached.size >= 6  # the prefix stays cached after the request finished
    # Different prompts need the whole pool: cached blocks get reclaimed.
    other = [{"prompt_token_ids": [90 + i] * 30} for i in range(3)]
    llm.generate(other, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    evictions = 0
    for i, event in enumerate(events):
        for block in event.blocks_evicted:
            before, after = view.frames[i], view.frames[i + 1]
            assert before.state[block] == CACHED and before.indexed[block]
            assert not after.indexed[block]
            assert after.state[block] in (USED, EMPTY)
            evictions += 1
    assert evictions


def test_replaying_a_recording_reproduces_the_live_frames(tiny_llama, tmp_path):
    llm = _llm(tiny_llama)
    # Generate something first, so the recording starts from a non-empty snapshot.
    llm.generate(_prompts(1), SamplingParams(max_tokens=2), use_tqdm=False)
    live = KVCacheView(llm, keep_frames=True)
    timeline, metrics = SchedulerTimeline(llm), MetricsPanel(llm)
    path = tmp_path / "run.jsonl"
    with llm.llm_engine.record(path) as recorder:
        llm.generate(_prompts(6), SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
        llm.generate(
            _prompts(2), SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=3), use_tqdm=False
        )
    assert recorder.num_steps == len(live.frames) - 1
    recording = load(path)
    assert recording.complete and len(recording) == recorder.num_steps
    replay = KVCacheView(recording)
    # Forwards, then backwards and skipping (the checkpoints), frame by frame.
    positions = list(range(len(recording) + 1))
    for position in positions + positions[::-7]:
        assert replay.frame_at(position) == live.frames[position], position
    # The other views agree too (a path works as well as a Recording).
    assert SchedulerTimeline(path).series == timeline.series
    assert MetricsPanel(recording).metrics == metrics.metrics
    assert recording.config["block_size"] == 4
    assert recording.components["eviction_policy"] == "lru"


def test_a_view_attached_mid_run_starts_from_the_snapshot(tiny_llama):
    llm = _llm(tiny_llama)
    engine = llm.llm_engine
    for i, prompt in enumerate(_prompts(4)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(5):
        engine.step()
    view = KVCacheView(llm)
    assert view.frame.num_in_use == int(np.count_nonzero(engine.snapshot().kv.ref_counts)) > 0
    failures: list[str] = []
    _truth_checker(llm, view, failures)
    while engine.has_unfinished_requests():
        engine.step()
    assert not failures, failures[:5]


def test_large_pools_are_drawn_aggregated(tiny_llama):
    llm = _llm(tiny_llama, blocks=300)
    view = KVCacheView(llm, max_cells=64)
    llm.generate(_prompts(4), SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    html = view.html()
    cells = _cell_colors(html)
    assert len(cells) == 60  # ceil(300 / 5) cells of 5 blocks
    assert "5 blocks per cell" in html
    assert any(color == CACHED_COLOR for color, _ in cells)


def test_redraws_are_throttled_but_the_last_frame_is_drawn(tiny_llama, monkeypatch):
    pytest.importorskip("ipywidgets")
    llm = _llm(tiny_llama)
    view = KVCacheView(llm, interval=3600)
    view.widget  # noqa: B018 - builds the widget (first draw)
    draws = []
    monkeypatch.setattr(view, "_show", lambda frame: draws.append(frame.step_index))
    steps = []
    llm.llm_engine.subscribe(lambda e: steps.append(e.step_index))
    llm.generate(_prompts(3), SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert len(steps) >= 15
    deadline = time.monotonic() + 10
    while not draws and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    assert draws == [steps[-1]]  # only once the engine went idle, and only the last frame
    monkeypatch.undo()
    view.refresh()
    assert 'class="llmlab-kv-grid"' in view.widget.children[0].value


def test_views_draw_pictures_and_close(tiny_llama, tmp_path):
    llm = _llm(tiny_llama)
    views = [KVCacheView(llm), SchedulerTimeline(llm), MetricsPanel(llm)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm.generate(_prompts(1), params, use_tqdm=False)
    llm.generate(_prompts(3)[1:], params, use_tqdm=False)
    for i, view in enumerate(views):
        path = view.to_png(tmp_path / f"{i}.png")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        view.close()
    assert len(views[1].series) > 0
    assert len(views[2].metrics.ttft_s) == 3
    assert views[2].metrics.hit_rate[-1] > 0  # the shared prefix was hit
    observers = list(llm.llm_engine.observers)
    assert all(getattr(o, "__self__", None) not in views for o in observers)


def test_bad_sources_and_settings_are_named():
    with pytest.raises(TypeError, match="LLM, Engine or AsyncEngine"):
        KVCacheView(42)
    with pytest.raises(ValueError, match="max_cells"):
        KVCacheView(42, max_cells=0)
    with pytest.raises(ValueError, match="interval"):
        SchedulerTimeline(42, interval=-1)


def test_a_paused_engine_still_gets_its_latest_frame_drawn(tiny_llama):
    pytest.importorskip("ipywidgets")
    llm = _llm(tiny_llama)
    view = KVCacheView(llm, interval=0.2)
    html = view.widget.children[0]
    engine = llm.llm_engine
    for i, prompt in enumerate(_prompts(3)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(6):  # quicker than the interval: throttled, and the engine stays busy
        engine.step()
    deadline = time.monotonic() + 10
    while f"step {view.frame.step_index} " not in html.value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"step {view.frame.step_index} " in html.value
    view.close()


def test_policy_comparison_shows_the_table_and_each_configurations_run(tiny_llama, tmp_path):
    from llmlab.experiments import shared_prefix_chat
    from llmlab.viz import PolicyComparison

    workload = shared_prefix_chat(3, 2, vocab_size=256, system_prompt_len=24, output_len=4,
                                  low=10, seed=0)
    comparison = PolicyComparison.run(
        workload,
        {"lru": {"eviction_policy": "lru"}, "fifo": {"eviction_policy": "fifo"}},
        model=tiny_llama,
        engine_kwargs={"dtype": "float32", "block_size": 4, "num_gpu_blocks_override": 40,
                       "max_model_len": 128},
        progress=False,
    )
    assert list(comparison.table.index) == ["lru", "fifo"]
    series = comparison.series()
    assert set(series) == {"lru", "fifo"} and all(len(s) > 0 for s in series.values())
    fig = comparison.figure()
    assert len(fig.subfigs) == 2
    assert comparison.to_png(tmp_path / "c.png").stat().st_size > 0
    pytest.importorskip("ipywidgets")
    table, image = comparison.widget.children
    assert "<table" in table.value and image.value[:4] == b"\x89PNG"
    with pytest.raises(TypeError, match="llmlab.experiments.Comparison"):
        PolicyComparison({"lru": {}})


def test_a_view_follows_an_async_engine_from_its_loop_thread(tiny_llama):
    import asyncio

    from llmlab.entrypoints.async_engine import AsyncEngine

    # Synchronous steps (also on a GPU, where overlap is the default): the decode-token
    # count below is exact only then; an overlapped engine also schedules one slot, wasted,
    # for each request after the step that ends it.
    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32", block_size=4,
                                       num_gpu_blocks_override=48, max_model_len=128,
                                       async_scheduling=False)
    try:
        view = KVCacheView(engine, keep_frames=True)
        timeline = SchedulerTimeline(engine)
        params = SamplingParams(max_tokens=12, ignore_eos=True)

        async def main():
            async def one(i, prompt):
                return [o async for o in engine.generate(prompt, params, f"r{i}")]

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(_prompts(3))))

        asyncio.run(asyncio.wait_for(main(), 60))
        deadline = time.monotonic() + 10
        while view.frame.num_in_use and time.monotonic() < deadline:
            time.sleep(0.01)  # the loop thread may still be applying the last step's event
        assert view.frame.num_in_use == 0
        owners = {r for f in view.frames for r in f.owner_ids() if r is not None}
        assert owners == {"r0", "r1", "r2"}
        assert sum(timeline.series.decode_tokens) == 3 * 11  # the first token of each: prefill
    finally:
        engine.shutdown()

"""The KV view under a KV press: compacted blocks are marked, tokens count what is cached.

A tiny engine compacts its requests' KV after the prompt (``knorm``); after every step an
observer subscribed after the view compares the frame with the engine itself: which
requests are compressed (``Request.kv_compressed``), their block tables, and what their
cache holds (``Request.num_cached_kv``). A replay of the recording must give the same frames.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from llmlab import LLM, SamplingParams
from llmlab.kvpress import kept_count
from llmlab.viz import KVCacheView, load
from llmlab.viz.state import SHARED

BS = 8


def _llm(model: str, ratio: float = 0.5, **settings) -> LLM:
    settings.setdefault("num_gpu_blocks_override", 64)
    settings.setdefault("max_model_len", 256)
    return LLM(
        model, dtype="float32", seed=0, block_size=BS, enforce_eager=True, kv_press="knorm",
        kv_press_config={"compression_ratio": ratio}, **settings,
    )


def _prompt(n: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, 200) for _ in range(n)]}


def _params(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, **kwargs)


def _truth_checker(llm: LLM, view: KVCacheView, failures: list[str]):
    """After every step: the frame's compacted marks, tokens and kept ratios against the
    engine's requests and cache manager."""
    engine = llm.llm_engine
    kv = engine.kv_cache

    def check(event):
        frame = view.frame
        where = f"step {event.step_index}"
        running = {r.request_id: r for r in engine.scheduler.running}
        tables = {rid: kv.block_table(rid) for rid in running if kv.block_table(rid)}
        want = np.zeros(frame.num_blocks, bool)
        for rid, table in tables.items():
            if running[rid].kv_compressed:
                want[list(table)] = True
        if not np.array_equal(frame.compacted, want):
            failures.append(f"{where}: compacted {np.flatnonzero(frame.compacted)} != "
                            f"{np.flatnonzero(want)}")
        owners = frame.owner_ids()
        for rid, table in tables.items():
            request = running[rid]
            cached = request.num_cached_kv
            owned = [(i, b) for i, b in enumerate(table) if owners[b] == rid]
            for i, block in owned:
                expected = min(BS, max(0, cached - i * BS))
                if frame.tokens[block] != expected:
                    failures.append(f"{where}: {rid} block {block} holds "
                                    f"{frame.tokens[block]} != {expected}")
            if len(owned) == len(table) and int(frame.tokens[list(table)].sum()) != cached:
                failures.append(f"{where}: {rid} blocks sum to {frame.tokens[list(table)].sum()}"
                                f" != {cached} cached")
            ratio = frame.kept_ratio.get(rid)
            if request.kv_compressed and rid in frame.context_tokens:
                if frame.context_tokens[rid] != request.num_computed_tokens:
                    failures.append(f"{where}: {rid} context {frame.context_tokens[rid]}")
                if ratio != cached / request.num_computed_tokens:
                    failures.append(f"{where}: {rid} kept ratio {ratio}")
            elif not request.kv_compressed and ratio is not None:
                failures.append(f"{where}: uncompressed {rid} has a kept ratio {ratio}")
        stale = set(frame.kept_ratio) - {r for r in tables if running[r].kv_compressed}
        if stale:
            failures.append(f"{where}: kept ratios of requests gone or uncompressed: {stale}")

    engine.subscribe(check)


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


@pytest.fixture(scope="module")
def pressed_run(tiny_llama, tmp_path_factory):
    """A run watched from mid-way (two requests already compacted), recorded: requests
    with the press, one that opts out, and one with two parallel samples."""
    llm = _llm(tiny_llama)
    engine = llm.llm_engine
    for i, n in enumerate((23, 40)):
        engine.add_request(f"early{i}", _prompt(n, i), _params(14))
    engine.step()
    engine.step()
    view = KVCacheView(llm, keep_frames=True)
    failures: list[str] = []
    _truth_checker(llm, view, failures)
    events: list = []
    engine.subscribe(events.append)
    path = tmp_path_factory.mktemp("kvpress") / "run.jsonl"
    with engine.record(path):
        engine.add_request("late", _prompt(57, 2), _params(10))
        engine.add_request("plain", _prompt(30, 3), _params(10, extra_args={"kv_press": False}))
        engine.step()
        engine.add_request("fork", _prompt(35, 4), SamplingParams(
            max_tokens=10, ignore_eos=True, n=2, temperature=1.0, seed=0))
        _drain(engine)
    return view, events, failures, path


def test_compacted_blocks_are_exactly_those_of_compressed_requests(pressed_run):
    view, events, failures, _ = pressed_run
    assert not failures, failures[:5]
    frames = view.frames
    # The workload did what the test is about: compressed and plain requests side by side,
    # and parallel samples sharing compacted blocks.
    compacted_ids = {c.request_id for e in events for c in e.kv_compacted}
    # (the samples of "fork" are "0_fork" and "1_fork"; the first compacts)
    assert "late" in compacted_ids and "plain" not in compacted_ids
    assert any(rid.endswith("_fork") for rid in compacted_ids)
    assert frames[0].compacted.any()  # the two early requests, from the snapshot
    both = [f for f in frames if f.compacted.any() and (f.refs > 0).sum() > f.compacted.sum()]
    assert both, "never a frame with compacted and uncompacted blocks in use"
    assert any((f.compacted & (f.state == SHARED)).any() for f in frames)
    assert any(f.blocks_of("plain") for f in frames)
    for frame in frames:
        assert not frame.compacted[frame.blocks_of("plain")].any()
    assert not frames[-1].compacted.any() and not frames[-1].kept_ratio


def test_kept_ratio_after_the_prompt_is_the_press_budget(pressed_run):
    view, events, _, _ = pressed_run
    seen = 0
    # frames[i + 1] follows events[i] (frames[0] is the snapshot).
    for event, frame in zip(events, view.frames[1:], strict=True):
        for c in event.kv_compacted:
            context = c.context_len
            assert c.error is None and frame.context_tokens[c.request_id] == context
            ratio = frame.kept_ratio[c.request_id]
            assert ratio == kept_count(context, 0.5) / context
            assert abs(ratio - 0.5) <= 1 / context
            blocks = frame.blocks_of(c.request_id)
            assert len(blocks) == -(-kept_count(context, 0.5) // BS)
            assert int(frame.tokens[blocks].sum()) == kept_count(context, 0.5)
            block = blocks[0]
            assert f"compacted (kept {ratio:.0%} of {context} tokens)" in frame.describe(block)
            seen += 1
    assert seen == sum(len(e.kv_compacted) for e in events) >= 2


def test_a_replay_gives_the_live_frames(pressed_run):
    view, events, _, path = pressed_run
    recording = load(path)
    assert recording.events == tuple(events)
    # The recording starts mid-run: the early requests' drops travel in its snapshot.
    assert recording.snapshot.kv_dropped == {
        f"early{i}": n - kept_count(n, 0.5) for i, n in enumerate((23, 40))
    }
    replay = KVCacheView(recording)
    positions = list(range(len(recording) + 1))
    for position in positions + positions[::-5]:
        assert replay.frame_at(position) == view.frames[position], position
    assert view.frames[0].compacted.any() and view.frames[0].kept_ratio


def test_frame_equality_includes_the_compaction_fields(pressed_run):
    import attrs

    view, _, _, _ = pressed_run
    frame = next(f for f in view.frames if f.compacted.any())
    flipped = frame.compacted.copy()
    flipped[np.flatnonzero(flipped)[0]] = False
    assert attrs.evolve(frame, compacted=flipped) != frame
    rid = next(iter(frame.kept_ratio))
    assert attrs.evolve(frame, kept_ratio={**frame.kept_ratio, rid: 1.0}) != frame
    assert attrs.evolve(frame) == frame


def test_ratio_zero_compacts_without_dropping_and_samples_inherit(tiny_llama):
    """At ratio 0 the press keeps everything (kv_dropped stays 0) but the KV still moved to
    fresh blocks chosen by it: marked, kept ratio 1; so are the parallel samples' blocks."""
    llm = _llm(tiny_llama, ratio=0.0)
    view = KVCacheView(llm, keep_frames=True)
    failures: list[str] = []
    _truth_checker(llm, view, failures)
    events: list = []
    llm.llm_engine.subscribe(events.append)
    llm.generate([_prompt(30, 5)], SamplingParams(max_tokens=12, ignore_eos=True, n=3,
                                                  temperature=1.0, seed=2), use_tqdm=False)
    assert not failures, failures[:5]
    assert any(e.kv_compacted for e in events) and not any(any(e.kv_dropped) for e in events)
    marked = [f for f in view.frames if f.compacted.any()]
    assert marked and all(set(f.kept_ratio.values()) == {1.0} for f in marked)
    # Some frame marks blocks owned by a sample other than the one that compacted.
    compacted = {c.request_id for e in events for c in e.kv_compacted}
    owners = {r for f in marked for r, c in zip(f.owner_ids(), f.compacted, strict=True) if c}
    assert owners - compacted


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_lose_their_marks_until_compacted_again(tiny_llama, mode):
    """A compressed request is recomputed in full after a preemption (swap mode too)."""
    swap = {"swap_space": 0.01} if mode == "swap" else {}
    llm = _llm(tiny_llama, num_gpu_blocks_override=14, max_num_batched_tokens=32,
               max_model_len=96, preemption_mode=mode, **swap)
    view = KVCacheView(llm, keep_frames=True)
    failures: list[str] = []
    _truth_checker(llm, view, failures)
    events: list = []
    llm.llm_engine.subscribe(events.append)
    llm.generate([_prompt(n, n) for n in (30, 35, 40, 45)], _params(30), use_tqdm=False)
    assert not failures, failures[:5]
    preempted = [(i, rid) for i, e in enumerate(events) for rid in e.preempted]
    assert preempted
    for i, rid in preempted:
        after = view.frames[i + 1]
        assert rid not in after.kept_ratio and not after.blocks_of(rid)
    # Recomputed, then compacted again.
    again = {c.request_id for e in events[preempted[0][0] + 1:] for c in e.kv_compacted}
    assert preempted[0][1] in again


def _cell_styles(html: str) -> list[str]:
    return re.findall(r'class="llmlab-kv-cell" style="([^"]*)"', html)


def test_the_view_draws_compacted_blocks(pressed_run, tmp_path):
    view, _, _, path = pressed_run
    frame = next(f for f in view.frames if f.compacted.any() and f.kept_ratio)
    html = view.html(frame)
    styles = _cell_styles(html)
    assert len(styles) == frame.num_blocks
    assert [("outline" in s) for s in styles] == frame.compacted.tolist()
    # The existing marks are untouched: shared is the box-shadow, partial the gradient.
    assert [("box-shadow" in s) for s in styles] == (frame.state == SHARED).tolist()
    assert "compacted by a KV press" in html
    for rid, ratio in frame.kept_ratio.items():
        if frame.blocks_of(rid):
            assert f"{rid}: {len(frame.blocks_of(rid))} <i>(kept {ratio:.0%})</i>" in html
    fig = view.figure(frame)
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert "compacted by a KV press" in labels
    assert any("(kept " in label for label in labels)
    assert f"{int(frame.compacted.sum())} compacted" in fig.axes[0].get_title(loc="left")
    png = KVCacheView(load(path)).to_png(tmp_path / "kv.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Aggregated: a cell is marked when any of its blocks is compacted.
    small = KVCacheView(load(path), max_cells=16)
    cells = _cell_styles(small.html(frame))
    per_cell = 4  # 64 blocks in 16 cells
    want = [bool(frame.compacted[i:i + per_cell].any()) for i in range(0, 64, per_cell)]
    assert [("outline" in s) for s in cells] == want
    assert small.figure(frame) is not None
    # Without a press nothing changes: no mark, no legend entry.
    plain = next(f for f in view.frames if not f.compacted.any())
    assert "outline" not in view.html(plain) and "compacted" not in view.html(plain)

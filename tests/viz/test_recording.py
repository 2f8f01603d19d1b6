"""Recordings: every event comes back equal, files stay small, bad files are named."""

from __future__ import annotations

import json
import random

import pytest

from llmlab import LLM, SamplingParams
from llmlab.observe.recording import event_from_json, event_to_json
from llmlab.viz import load


@pytest.fixture
def recorded(tiny_llama, tmp_path):
    llm = LLM(tiny_llama, dtype="float32", block_size=4, num_gpu_blocks_override=48,
              max_model_len=128)
    events = []
    llm.llm_engine.subscribe(events.append)
    path = tmp_path / "run.jsonl"
    with llm.llm_engine.record(path):
        prompts = [{"prompt_token_ids": [7] * 24 + [10 + i] * (5 + 3 * i)} for i in range(6)]
        llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False,
                     priority=[0, 1, 2, 0, 1, 2], user=["a", "b", None, "a", "b", None])
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=0),
                     use_tqdm=False)
    return path, events


def test_events_round_trip_exactly(recorded):
    path, events = recorded
    recording = load(path)
    assert recording.complete
    assert recording.events == tuple(events)
    arrivals = [a for e in recording.events for a in e.arrived]
    assert [a.prompt_len for a in arrivals][:6] == [24 + 5 + 3 * i for i in range(6)]
    assert [a.priority for a in arrivals][:6] == [0, 1, 2, 0, 1, 2]
    assert [a.user for a in arrivals][:6] == ["a", "b", None, "a", "b", None]
    assert [a.max_tokens for a in arrivals] == [40] * 6 + [4] * 2
    assert [a.n for a in arrivals][6:] == [2, 2]
    assert recording.config["num_gpu_blocks_override"] == 48
    for event in events:
        assert event_from_json(json.loads(json.dumps(event_to_json(event)))) == event


def test_a_speculating_run_round_trips(tiny_llama, tmp_path):
    class RepeatLast:
        def propose(self, requests, k):
            return [[int(r.token_ids[-1])] * k for r in requests]

    llm = LLM(tiny_llama, max_model_len=64, speculative_config={
        "proposer": RepeatLast(), "num_speculative_tokens": 3, "speculation_length": "fixed"})
    events = []
    llm.llm_engine.subscribe(events.append)
    path = tmp_path / "spec.jsonl"
    with llm.llm_engine.record(path):
        llm.generate(["a b a b a b a b"], SamplingParams(max_tokens=24, ignore_eos=True),
                     use_tqdm=False)
    assert any(e.speculated for e in events)
    recording = load(path)
    assert recording.events == tuple(events)
    assert recording.config["speculative_config"] == {
        "method": "custom", "num_speculative_tokens": 3, "proposer": "RepeatLast",
        "speculation_length": "fixed",
    }


def test_a_few_thousand_steps_stay_a_few_megabytes(recorded):
    path, events = recorded
    per_step = path.stat().st_size / len(events)
    # 6 requests a step here; a 3000-step run of a busier batch stays in the low MB.
    assert per_step < 1000, per_step


def test_an_interrupted_recording_loads_as_incomplete(recorded, tmp_path):
    path, events = recorded
    lines = path.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:-1]))  # no footer
    recording = load(cut)
    assert not recording.complete and len(recording) == len(events)


def test_every_truncation_of_a_recording_loads_its_complete_events(recorded, tmp_path):
    """A killed run leaves a file cut anywhere: it loads every complete line (issue 22)."""
    path, events = recorded
    data = path.read_bytes()
    header_end = data.index(b"\n") + 1
    rng = random.Random(0)
    cut = tmp_path / "cut.jsonl"
    for size in sorted(rng.sample(range(header_end, len(data)), 100)):
        cut.write_bytes(data[:size])
        recording = load(cut)
        complete_steps = data[:size].count(b"\n") - 1  # lines minus the header
        want = min(complete_steps, len(events))
        assert recording.events == tuple(events[:want]), size
        assert not recording.complete and recording.truncated == (data[size - 1:size] != b"\n")
    cut.write_bytes(data[: header_end - 5])
    with pytest.raises(ValueError, match="cut inside its header"):
        load(cut)


def test_a_killed_compressed_recording_loads_what_was_flushed(tiny_llama, tmp_path,
                                                               monkeypatch):
    """Each flush is a gzip sync point: whatever was flushed decompresses without the end
    of the stream, so a compressed recording cut anywhere loads every flushed event."""
    from llmlab.observe import recording as module

    monkeypatch.setattr(module, "_FLUSH_EVERY_S", 0.0)  # flush after every event
    llm = LLM(tiny_llama, dtype="float32")
    path = tmp_path / "run.jsonl.gz"
    events, sizes = [], []
    recorder = llm.llm_engine.record(path)

    def after_each_event(event):  # subscribed after the recorder: sees its flushed size
        events.append(event)
        sizes.append(path.stat().st_size)

    llm.llm_engine.subscribe(after_each_event)
    llm.generate(["hello", "there", "general"], SamplingParams(max_tokens=6), use_tqdm=False)
    data = path.read_bytes()  # as a SIGKILL leaves it: no footer, no gzip trailer
    assert load(path).events == tuple(events)
    rng = random.Random(1)
    cut = tmp_path / "cut.jsonl.gz"
    for size in sorted(rng.sample(range(sizes[0], len(data) + 1), 100)):
        cut.write_bytes(data[:size])
        recording = load(cut)
        want = sum(1 for s in sizes if s <= size)
        assert recording.events[:want] == tuple(events[:want]), size
        assert recording.events == tuple(events[: len(recording.events)])
        assert not recording.complete
    recorder.close()
    assert load(path).complete


def test_a_foreign_jsonl_file_names_line_one(tmp_path):
    foreign = tmp_path / "chat.jsonl"
    foreign.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match=r"chat.jsonl: line 1: not an llmlab recording"):
        load(foreign)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="line 1: empty file"):
        load(empty)


def test_a_malformed_step_names_the_line_and_field(recorded, tmp_path):
    path, _ = recorded
    lines = path.read_text().splitlines(keepends=True)
    step = json.loads(lines[3])
    step["step"]["num_waiting"] = "many"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:3] + [json.dumps(step) + "\n"] + lines[4:]))
    with pytest.raises(ValueError, match=r"line 4: bad step event: field 'num_waiting'"):
        load(bad)
    lines[5] = '{"stepp": {}}\n'
    bad.write_text("".join(lines))
    with pytest.raises(ValueError, match=r"line 6: expected \{'step': ...\}"):
        load(bad)
    bad.write_text("".join(lines[:1]) + '{"step": {"step_index": 0, "bogus": 1}}\n')
    with pytest.raises(ValueError, match=r"line 2: bad step event: unknown field\(s\) \['bogus'\]"):
        load(bad)
    bad.write_text("".join(lines[:1]) + '{"step": {"step_index": 0}}\n')
    with pytest.raises(ValueError, match=r"line 2: bad step event: missing"):
        load(bad)


def test_the_recorder_stops_when_closed(tiny_llama, tmp_path):
    llm = LLM(tiny_llama, dtype="float32")
    recorder = llm.llm_engine.record(tmp_path / "r.jsonl")
    llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)
    recorder.close()
    recorder.close()  # idempotent
    steps = recorder.num_steps
    llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)
    assert recorder not in llm.llm_engine.observers
    assert len(load(tmp_path / "r.jsonl")) == steps > 0


def test_gzip_recordings_round_trip_and_unreadable_bytes_name_the_line(tiny_llama, tmp_path):
    llm = LLM(tiny_llama, dtype="float32")
    events = []
    llm.llm_engine.subscribe(events.append)
    with llm.llm_engine.record(tmp_path / "run.jsonl.gz"):
        llm.generate(["hello", "there"], SamplingParams(max_tokens=5), use_tqdm=False)
    recording = load(tmp_path / "run.jsonl.gz")
    assert recording.complete and recording.events == tuple(events)
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match=r"binary.jsonl: line 1: cannot be read"):
        load(tmp_path / "binary.jsonl")


def test_kv_press_fields_round_trip(tiny_llama, tmp_path):
    """``kv_compacted`` comes back as ``Compaction``s (tuples, errors included),
    ``kv_dropped`` as ints, and a snapshot taken mid-run keeps its ``kv_dropped``."""
    import attrs

    from llmlab.observe.recording import snapshot_from_json, snapshot_to_json
    from llmlab.kvpress import kept_count
    from llmlab.kvpress.schedule import Compaction

    llm = LLM(tiny_llama, dtype="float32", kv_press="knorm",
              kv_press_config={"compression_ratio": 0.5}, block_size=8,
              num_gpu_blocks_override=64, enforce_eager=True)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": list(range(3, 40))}, params)
    engine.step()  # "a" compacted: the recording starts from a snapshot that says so
    snapshot = engine.snapshot()
    assert snapshot.kv_dropped == {"a": 37 - kept_count(37, 0.5)}
    assert snapshot_from_json(json.loads(json.dumps(snapshot_to_json(snapshot)))).kv_dropped \
        == snapshot.kv_dropped
    events = []
    engine.subscribe(events.append)
    path = tmp_path / "press.jsonl"
    with engine.record(path):
        engine.add_request("b", {"prompt_token_ids": list(range(50, 75))}, params)
        while engine.has_unfinished_requests():
            engine.step()
    recording = load(path)
    assert recording.events == tuple(events)
    compactions = [c for e in recording.events for c in e.kv_compacted]
    assert [c.request_id for c in compactions] == ["b"]
    assert isinstance(compactions[0], Compaction) and isinstance(compactions[0].kept, tuple)
    assert any(any(e.kv_dropped) for e in recording.events)
    assert recording.snapshot.kv_dropped == snapshot.kv_dropped
    # A failed press's message survives too; a malformed compaction names the field.
    failed = attrs.evolve(events[0], kv_compacted=(Compaction("b", 25, (25, 25), (25, 25),
                                                              "kv_press boom"),))
    assert event_from_json(json.loads(json.dumps(event_to_json(failed)))) == failed
    bad = event_to_json(events[0])
    bad["kv_compacted"] = [{"request_id": "b", "kept": [1]}]
    with pytest.raises(ValueError, match="field 'kv_compacted'"):
        event_from_json(bad)

"""Trace readers: each format parses to the arrivals it describes, lazily, deterministically,
and a bad file is named with its line and field."""

from __future__ import annotations

import gzip
import itertools
import json
import pathlib
import tracemalloc

import numpy as np
import pytest

from llmlab.cache.kv_cache_manager import CacheSnapshot
from llmlab.observe.events import Arrival, EngineSnapshot, StepEvent
from llmlab.observe.recording import FORMAT, VERSION, event_to_json, snapshot_to_json
from llmlab.experiments.workloads import Workload, WorkloadRequest
from llmlab.sim.traces import (
    FORMATS,
    SAMPLES,
    Trace,
    azure_trace,
    burstgpt_trace,
    mooncake_trace,
    read_trace,
    recording_trace,
)

VOCAB = 50_000
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def write(path: pathlib.Path, text: str) -> pathlib.Path:
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as file:
            file.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def mooncake_lines(*rows: dict) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def moon(timestamp: int, hash_ids: list[int], input_length: int | None = None,
         output_length: int = 4) -> dict:
    length = len(hash_ids) * 4 if input_length is None else input_length
    return {"timestamp": timestamp, "input_length": length, "output_length": output_length,
            "hash_ids": hash_ids}


def azure_text(*rows: tuple[str, int, int]) -> str:
    return AZURE_HEADER + "".join(f"{t},{p},{o}\n" for t, p, o in rows)


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# -- each format -------------------------------------------------------------------------


def test_azure_rows_arrive_at_seconds_since_the_first_timestamp(tmp_path):
    path = write(tmp_path / "code.csv", azure_text(
        ("2023-11-16 18:15:46.6805900", 12, 3),
        ("2023-11-16 18:15:47.1805901", 7, 1),
        ("2023-11-16 18:16:00", 30, 9),
    ))
    trace = azure_trace(path, vocab_size=VOCAB)
    requests = list(trace)
    assert (trace.format, trace.name) == ("azure", "code")
    assert [r.arrival_time for r in requests] == pytest.approx(
        [0.0, 0.5000001, 13.31941], abs=1e-9)
    assert [r.num_prompt_tokens for r in requests] == [12, 7, 30]
    assert [r.max_tokens for r in requests] == [3, 1, 9]
    assert all(isinstance(r, WorkloadRequest) for r in requests)


def test_mooncake_timestamps_are_milliseconds_and_prompts_are_cut_or_padded(tmp_path):
    path = write(tmp_path / "moon.jsonl", mooncake_lines(
        moon(1000, [1, 2], input_length=6),  # cut: 4 + 2 tokens of block 2
        moon(1250, [1, 2], input_length=11),  # padded: 8 + 3 tokens of its own
        moon(4000, [], input_length=5, output_length=9),
    ))
    requests = list(mooncake_trace(path, vocab_size=VOCAB, block_tokens=4))
    assert [r.arrival_time for r in requests] == [0.0, 0.25, 3.0]
    assert [r.num_prompt_tokens for r in requests] == [6, 11, 5]
    assert [r.max_tokens for r in requests] == [4, 4, 9]
    cut, padded, _ = (r.prompt_token_ids for r in requests)
    assert padded[:6] == cut


def test_mooncake_requests_share_exactly_their_common_leading_blocks(tmp_path):
    path = write(tmp_path / "moon.jsonl", mooncake_lines(
        moon(0, [1, 2, 3]), moon(1, [1, 2, 4]), moon(2, [1, 5, 3]), moon(3, [9, 2, 3]),
        moon(4, [1, 2, 3]),
    ))
    first, second, third, fourth, again = (
        r.prompt_token_ids for r in mooncake_trace(path, vocab_size=VOCAB, block_tokens=4)
    )
    assert common_prefix(first, second) == 8
    assert common_prefix(first, third) == 4
    assert common_prefix(first, fourth) == 0
    assert first == again
    assert first[8:] == third[8:] and first[4:] == fourth[4:]  # a block is its id's alone


def test_mooncake_block_cache_stays_bounded_and_gives_the_same_tokens(tmp_path, monkeypatch):
    import llmlab.sim.traces as traces

    rows = [moon(i, [i % 7, 100 + i]) for i in range(30)]
    path = write(tmp_path / "moon.jsonl", mooncake_lines(*rows))
    unbounded = [r.prompt_token_ids for r in mooncake_trace(path, vocab_size=VOCAB,
                                                             block_tokens=4)]
    monkeypatch.setattr(traces, "_BLOCK_CACHE_TOKENS", 8)  # two blocks
    assert [r.prompt_token_ids for r in mooncake_trace(path, vocab_size=VOCAB,
                                                        block_tokens=4)] == unbounded


def test_burstgpt_skips_failed_requests_counts_them_and_filters_by_model(tmp_path):
    path = write(tmp_path / "burst.csv", BURSTGPT_HEADER + (
        "5,ChatGPT,100,20,120,Conversation log\n"
        "5.5,GPT-4,50,0,50,API log\n"
        "7.25,GPT-4,60,10,70,API log\n"
        "9,ChatGPT,0,10,10,API log\n"
    ))
    trace = burstgpt_trace(path, vocab_size=VOCAB)
    requests = list(trace)
    assert [r.arrival_time for r in requests] == [0.0, 2.25]
    assert [(r.num_prompt_tokens, r.max_tokens) for r in requests] == [(100, 20), (60, 10)]
    assert trace.num_skipped == 2
    assert trace.skipped == {"zero output tokens": 1, "zero prompt tokens": 1}
    gpt4 = list(burstgpt_trace(path, vocab_size=VOCAB, model="GPT-4"))
    assert [(r.arrival_time, r.num_prompt_tokens) for r in gpt4] == [(0.0, 60)]


def _event(step: int, arrived: tuple[Arrival, ...]) -> StepEvent:
    return StepEvent(
        step_index=step, scheduled=(), scheduled_users=(), scheduled_priorities=(),
        num_batched_tokens=0, preempted=(), finished=(), aborted=(), blocks_allocated=(),
        blocks_freed=(), blocks_prefix_hit=(), blocks_evicted=(), blocks_forked=(),
        num_free_blocks=8, num_total_blocks=8, kv_usage=0.0, num_waiting=0, num_running=0,
        wall_time_s=0.0, model_time_s=0.0, arrived=arrived,
    )


def write_recording(path: pathlib.Path, arrivals: list[list[Arrival]]) -> pathlib.Path:
    cache = CacheSnapshot(np.zeros(8, np.int32), np.zeros(8, bool), {}, 8)
    snapshot = EngineSnapshot(0, 4, 8, cache, {}, 0, 0, 0.0)
    lines = [{"format": FORMAT, "version": VERSION, "config": {}, "components": {},
              "snapshot": snapshot_to_json(snapshot)}]
    lines += [{"step": event_to_json(_event(i, tuple(a)))} for i, a in enumerate(arrivals)]
    lines.append({"end": {"steps": len(arrivals)}})
    return write(path, "".join(json.dumps(line) + "\n" for line in lines))


def test_recording_arrivals_become_requests_with_user_priority_and_default_max_tokens(
    tmp_path,
):
    path = write_recording(tmp_path / "run.jsonl.gz", [
        [Arrival("a", 100.0, 5, 3, user="ann", priority=1), Arrival("b", 100.5, 8, None)],
        [],
        [Arrival("c", 102.0, 2, 0), Arrival("d", 103.0, 4, 7, n=2, priority=-1)],
    ])
    trace = recording_trace(path, vocab_size=VOCAB, default_max_tokens=11)
    requests = list(trace)
    assert (trace.format, trace.name) == ("recording", "run")
    assert [r.arrival_time for r in requests] == [0.0, 0.5, 3.0]
    assert [(r.num_prompt_tokens, r.max_tokens) for r in requests] == [(5, 3), (8, 11), (4, 7)]
    assert [(r.user, r.priority) for r in requests] == [("ann", 1), (None, 0), (None, -1)]
    assert trace.skipped == {"zero output tokens": 1}


# -- options -----------------------------------------------------------------------------


@pytest.fixture
def azure_file(tmp_path):
    rows = [(f"2023-11-16 18:15:{10 + i:02d}.5000000", 10 + i, 1 + i) for i in range(10)]
    return write(tmp_path / "conv.csv", azure_text(*rows))


def test_same_seed_gives_the_same_tokens_and_another_seed_others(azure_file):
    def tokens(seed):
        return [r.prompt_token_ids for r in azure_trace(azure_file, vocab_size=VOCAB, seed=seed)]

    assert tokens(0) == tokens(0)
    assert all(a != b for a, b in zip(tokens(0), tokens(1)))
    prompts = tokens(0)
    assert len(set(prompts)) == len(prompts)  # each line its own prompt


def test_tokens_lie_in_low_to_vocab_size(azure_file):
    tokens = [t for r in azure_trace(azure_file, vocab_size=40, low=30) for t in
              r.prompt_token_ids]
    assert min(tokens) >= 30 and max(tokens) < 40


def test_time_scale_limit_and_length_clamps(azure_file):
    trace = azure_trace(azure_file, vocab_size=VOCAB, time_scale=0.5, limit=4,
                        max_prompt_len=12, max_output_len=2)
    requests = list(trace)
    assert [r.arrival_time for r in requests] == [0.0, 0.5, 1.0, 1.5]
    assert [r.num_prompt_tokens for r in requests] == [10, 11, 12, 12]
    assert [r.max_tokens for r in requests] == [1, 2, 2, 2]
    full = list(azure_trace(azure_file, vocab_size=VOCAB))
    assert requests[3].prompt_token_ids == full[3].prompt_token_ids[:12]  # clamp cuts
    assert list(azure_trace(azure_file, vocab_size=VOCAB, limit=0)) == []


def test_a_trace_iterates_again_from_the_top_and_head_is_a_workload(azure_file):
    trace = azure_trace(azure_file, vocab_size=VOCAB)
    assert list(trace) == list(trace)
    head = trace.head(3)
    assert isinstance(head, Workload)
    assert head.name == "conv" and head.requests == tuple(itertools.islice(trace, 3))
    assert len(trace.head(1000)) == 10


def test_num_skipped_counts_the_latest_iteration_so_far(tmp_path):
    path = write(tmp_path / "t.csv", azure_text(
        ("2023-11-16 18:15:46", 5, 0), ("2023-11-16 18:15:47", 5, 2),
        ("2023-11-16 18:15:48", 5, 0), ("2023-11-16 18:15:49", 5, 2),
    ))
    trace = azure_trace(path, vocab_size=VOCAB)
    assert len(list(trace)) == 2 and trace.num_skipped == 2
    next(iter(trace))
    assert trace.num_skipped == 1
    # The first request is at 0 even when the rows before it were skipped.
    assert next(iter(trace)).arrival_time == 0.0


@pytest.mark.parametrize("name", ["trace.csv.gz", "trace.jsonl.gz"])
def test_gzip_files_read_the_same_as_plain_ones(tmp_path, name):
    text = (azure_text(("2023-11-16 18:15:46.1", 3, 2), ("2023-11-16 18:15:48.6", 4, 5))
            if ".csv" in name else mooncake_lines(moon(0, [1]), moon(30, [1, 2])))
    plain = write(tmp_path / name.removesuffix(".gz"), text)
    packed = write(tmp_path / name, text)
    assert list(read_trace(packed, vocab_size=VOCAB)) == list(read_trace(plain, vocab_size=VOCAB))
    assert read_trace(packed, vocab_size=VOCAB).name == "trace"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"vocab_size": 0}, "vocab_size must be >= 1, got 0"),
        ({"vocab_size": VOCAB, "limit": -1}, "limit must be >= 0, got -1"),
        ({"vocab_size": VOCAB, "time_scale": 0}, "time_scale must be > 0"),
        ({"vocab_size": VOCAB, "time_scale": -2.0}, "got -2.0"),
        ({"vocab_size": 10, "low": 10}, "low must be an int in [0, vocab_size)"),
        ({"vocab_size": VOCAB, "max_prompt_len": 0}, "max_prompt_len must be >= 1, got 0"),
        ({"vocab_size": VOCAB, "seed": -1}, "seed must be >= 0, got -1"),
        ({"vocab_size": VOCAB, "format": "parquet"},
         "format must be one of 'azure', 'mooncake', 'burstgpt', 'recording', got 'parquet'"),
    ],
)
def test_bad_arguments_are_named_with_their_value(azure_file, kwargs, fragment):
    with pytest.raises(ValueError) as info:
        read_trace(azure_file, **kwargs)
    assert fragment in str(info.value)


def test_format_specific_arguments_are_checked(tmp_path, azure_file):
    path = write(tmp_path / "m.jsonl", mooncake_lines(moon(0, [1])))
    with pytest.raises(ValueError, match="block_tokens must be >= 1, got 0"):
        mooncake_trace(path, vocab_size=VOCAB, block_tokens=0)
    with pytest.raises(ValueError, match="block_tokens: not an option of the 'azure' format"):
        read_trace(azure_file, vocab_size=VOCAB, block_tokens=4)
    with pytest.raises(ValueError, match="model must be a non-empty str or None, got ''"):
        burstgpt_trace(SAMPLES["burstgpt"], vocab_size=VOCAB, model="")
    with pytest.raises(ValueError, match="default_max_tokens must be >= 1, got 0"):
        recording_trace(azure_file, vocab_size=VOCAB, default_max_tokens=0)


# -- laziness ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["big.csv", "big.csv.gz"])
def test_the_first_requests_of_a_large_file_are_read_without_reading_it_all(tmp_path, name):
    num_rows = 200_000
    # The last row is broken: a reader that parsed the whole file would fail.
    text = (AZURE_HEADER + "2023-11-16 18:15:46.6805900,100,20\n" * num_rows
            + "2023-11-16 18:15:47,abc,20\n")
    path = write(tmp_path / name, text)

    def first_three():
        return list(itertools.islice(read_trace(path, vocab_size=VOCAB), 3))

    first_three()  # once untraced: the modules the first read imports are not counted
    tracemalloc.start()
    try:
        first = first_three()
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(first) == 3
    # Reading the file whole would hold about its size (7 MB) at once; this reads a buffer.
    assert peak_bytes < len(text) // 20


def test_a_bad_row_deep_in_the_file_surfaces_when_iteration_reaches_it(tmp_path):
    rows = [(f"2023-11-16 18:15:{i:02d}", 5, 2) for i in range(20)]
    path = write(tmp_path / "t.csv", azure_text(*rows) + "2023-11-16 18:15:30,5,-1\n")
    trace = read_trace(path, vocab_size=VOCAB)  # the header and first row are fine
    requests = iter(trace)
    assert len(list(itertools.islice(requests, 20))) == 20
    with pytest.raises(ValueError, match="line 22: GeneratedTokens must be >= 0"):
        next(requests)


# -- bad files ---------------------------------------------------------------------------

AZ_OK = "2023-11-16 18:15:46.6805900,10,2\n"
MOON_OK = json.dumps(moon(0, [1])) + "\n"

BAD_FILES = {
    "azure missing column": ("a.csv", "TIMESTAMP,GeneratedTokens\n" + "2023-11-16 18:15:46,2\n",
                             1, ["'ContextTokens'", "TIMESTAMP, ContextTokens, GeneratedTokens"]),
    "azure non-numeric": ("a.csv", AZURE_HEADER + AZ_OK + "2023-11-16 18:15:47,abc,2\n",
                          3, ["ContextTokens", "'abc'"]),
    "azure fractional length": ("a.csv", AZURE_HEADER + "2023-11-16 18:15:47,2.5,2\n",
                                2, ["ContextTokens", "whole number", "'2.5'"]),
    "azure negative": ("a.csv", AZURE_HEADER + "2023-11-16 18:15:47,4,-3\n",
                       2, ["GeneratedTokens", ">= 0", "'-3'"]),
    "azure bad timestamp": ("a.csv", AZURE_HEADER + AZ_OK + "16/11/2023 18:15,4,3\n",
                            3, ["TIMESTAMP", "'16/11/2023 18:15'"]),
    "azure impossible date": ("a.csv", AZURE_HEADER + "2023-13-45 18:15:46.1,4,3\n",
                              2, ["TIMESTAMP", "'2023-13-45 18:15:46.1'"]),
    "azure short row": ("a.csv", AZURE_HEADER + AZ_OK + "2023-11-16 18:15:47,4\n",
                        3, ["'GeneratedTokens'"]),
    "azure backwards": ("a.csv", AZURE_HEADER + AZ_OK + "2023-11-16 18:15:40.25,4,3\n",
                        3, ["TIMESTAMP", "2023-11-16 18:15:40.25", "2023-11-16 18:15:46.6805900",
                            "line 2"]),
    "azure empty": ("a.csv", "", 1, ["empty file"]),
    "mooncake missing field": ("m.jsonl", MOON_OK + '{"timestamp": 5, "input_length": 3, '
                               '"output_length": 2}\n',
                               2, ["'hash_ids'", "timestamp, input_length, output_length"]),
    "mooncake invalid json": ("m.jsonl", MOON_OK + '{"timestamp": 5,\n', 2, ["not valid JSON"]),
    "mooncake not an object": ("m.jsonl", MOON_OK + "[1, 2]\n", 2, ["JSON object", "list"]),
    "mooncake bad hash_ids": ("m.jsonl", MOON_OK + json.dumps(moon(5, [1, "x"])) + "\n",
                              2, ["hash_ids", "'x'"]),
    "mooncake negative": ("m.jsonl", json.dumps(moon(0, [1], input_length=-4)) + "\n",
                          1, ["input_length", ">= 0", "-4"]),
    "mooncake string length": ("m.jsonl", json.dumps(moon(0, [1], output_length="7")) + "\n",
                               1, ["output_length", "'7'"]),
    "mooncake bad timestamp": ("m.jsonl", MOON_OK + '{"timestamp": "soon", "input_length": 3, '
                               '"output_length": 2, "hash_ids": []}\n', 2, ["timestamp", "soon"]),
    "mooncake backwards": ("m.jsonl", mooncake_lines(moon(100, [1]), moon(50, [1])),
                           2, ["timestamp", "50 ms", "100 ms", "line 1"]),
    "mooncake empty": ("m.jsonl", "\n\n", 1, ["empty file"]),
    "burstgpt missing columns": ("b.csv", "Timestamp,Model,Total tokens\n5,ChatGPT,3\n",
                                 1, ["'Request tokens', 'Response tokens'", "Timestamp, Model"]),
    "burstgpt bad timestamp": ("b.csv", BURSTGPT_HEADER + "noon,ChatGPT,1,2,3,API log\n",
                               2, ["Timestamp", "'noon'"]),
    "burstgpt bad tokens": ("b.csv", BURSTGPT_HEADER + "5,ChatGPT,1,many,3,API log\n",
                            2, ["Response tokens", "'many'"]),
    "burstgpt backwards": ("b.csv", BURSTGPT_HEADER + "5,ChatGPT,1,2,3,API log\n"
                           "4.5,ChatGPT,1,2,3,API log\n", 3, ["Timestamp 4.5", "5", "line 2"]),
    "not gzip": ("a.csv.gz", "not compressed", 1, ["cannot be read"]),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_file_is_named_with_its_line_and_field(tmp_path, case):
    name, text, line, fragments = BAD_FILES[case]
    path = tmp_path / name
    if case == "not gzip":
        path.write_text(text)
    else:
        write(path, text)
    format = {"a": "azure", "m": "mooncake", "b": "burstgpt"}[name[0]]
    with pytest.raises(ValueError) as info:
        list(read_trace(path, format, vocab_size=VOCAB))
    message = str(info.value)
    assert message.startswith(f"{path}: line {line}: "), message
    for fragment in fragments:
        assert fragment in message, message


def test_a_wrong_header_fails_at_once_before_iteration(tmp_path):
    path = write(tmp_path / "a.csv", "time,prompt,output\n1,2,3\n")
    with pytest.raises(ValueError, match="line 1: the header lacks column"):
        azure_trace(path, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="line 1: cannot tell the trace format"):
        read_trace(path, vocab_size=VOCAB)
    # Sniffed as the format it is closest to, so its missing column is named.
    path = write(tmp_path / "b.csv", "TIMESTAMP,GeneratedTokens\n")
    with pytest.raises(ValueError, match="line 1: the header lacks column.s. 'ContextTokens'"):
        read_trace(path, vocab_size=VOCAB)


def test_a_file_that_is_not_a_recording_is_refused(tmp_path):
    path = write(tmp_path / "r.jsonl", MOON_OK)
    with pytest.raises(ValueError, match=r"r\.jsonl: line 1: not an llmlab recording"):
        recording_trace(path, vocab_size=VOCAB)


def test_equal_times_are_in_order(tmp_path):
    path = write(tmp_path / "m.jsonl", mooncake_lines(moon(7, [1]), moon(7, [2])))
    assert [r.arrival_time for r in read_trace(path, vocab_size=VOCAB)] == [0.0, 0.0]


# -- sniffing and samples ----------------------------------------------------------------


def test_read_trace_tells_each_format_from_the_name_and_first_line(tmp_path, azure_file):
    files = {
        "azure": azure_file,
        "burstgpt": write(tmp_path / "b.csv.gz", BURSTGPT_HEADER + "1,GPT-4,3,4,7,API log\n"),
        "mooncake": write(tmp_path / "m.jsonl", MOON_OK),
        "recording": write_recording(tmp_path / "r.jsonl", [[Arrival("a", 1.0, 3, 2)]]),
        "mooncake ": write(tmp_path / "m.txt", MOON_OK),  # no known suffix: by content
    }
    for format, path in files.items():
        trace = read_trace(path, vocab_size=VOCAB)
        assert isinstance(trace, Trace) and trace.format == format.strip()
        assert len(list(trace)) >= 1


@pytest.mark.parametrize("format", ["azure", "mooncake", "burstgpt"])
def test_the_shipped_samples_load_sorted_from_zero(format):
    trace = read_trace(SAMPLES[format], vocab_size=32_000)
    assert trace.format == format
    requests = trace.head(10_000).requests
    times = [r.arrival_time for r in requests]
    assert 150 <= len(requests) <= 250
    assert times[0] == 0.0 and times == sorted(times) and 30 < times[-1] < 120
    assert all(r.max_tokens >= 1 and r.num_prompt_tokens >= 1 for r in requests)


def test_the_mooncake_sample_shares_prefixes():
    prompts = [r.prompt_token_ids
               for r in mooncake_trace(SAMPLES["mooncake"], vocab_size=32_000, limit=40)]
    shared = [common_prefix(a, b) for a, b in itertools.combinations(prompts, 2)]
    assert {512, 1024, 1536} <= set(shared)


def test_formats_are_the_four_known():
    assert FORMATS == ("azure", "mooncake", "burstgpt", "recording")
    assert set(SAMPLES) == {"azure", "mooncake", "burstgpt"}

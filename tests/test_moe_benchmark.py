"""``benchmarks/moe.py`` runs end to end on a tiny layer and prints every column it promises
(no timing is asserted: the numbers depend on the machine)."""

from __future__ import annotations

import pytest

from benchmarks import moe


def test_the_moe_benchmark_reports_both_ratios_for_each_token_count(capsys):
    assert moe.main(["--device", "cpu", "--shapes", "tiny", "--tokens", "1,5,70",
                     "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "llmlab = grouped, oneDNN" in out
    header = next(line for line in out.splitlines() if line.startswith("tokens"))
    assert "llmlab/loop" in header and "llmlab/dense" in header
    rows = [line.split() for line in out.splitlines() if line[:6].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [1, 5, 70]
    assert not any("FAIL" in r for r in rows)


def test_the_defaults_are_the_documented_workload():
    args = moe.parse_args(["--device", "cpu"])
    assert (args.dtype, args.threads, args.repeats) == ("float32", 2, 5)
    assert args.shapes == ["mixtral", "qwen3"] and args.tokens == [1, 16, 256, 2048]
    assert moe.parse_args(["--device", "cuda"]).dtype == "bfloat16"


def test_unknown_shapes_are_named():
    with pytest.raises(SystemExit):
        moe.parse_args(["--shapes", "mixtral,gpt5"])

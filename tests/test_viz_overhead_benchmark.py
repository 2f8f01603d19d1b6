"""``benchmarks/viz_overhead.py`` runs end to end on a tiny workload and reports each mode."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets", reason="the overhead benchmark drives the widget views")

from benchmarks import viz_overhead


@pytest.mark.slow  # builds the benchmark's 8-layer model: about 20 s
def test_the_overhead_benchmark_reports_every_mode(capsys):
    viz_overhead.main(["--rounds", "1", "--num-requests", "2"])
    out = capsys.readouterr().out
    for mode in viz_overhead.MODES:
        assert f"\n{mode} " in out
    assert "target (< 5% of step time) with kv-view:" in out


def test_unknown_modes_are_named():
    with pytest.raises(SystemExit):
        viz_overhead.main(["--modes", "none,sparkles"])

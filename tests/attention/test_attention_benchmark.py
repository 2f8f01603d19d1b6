"""``benchmarks/attention.py`` runs end to end.

* ``--smoke`` (tiny float32 shapes; on CPU in Triton's interpreter, which
  ``tests/conftest.py`` selects): every section prints, llmlab agrees with SDPA on each
  config, and the JSON holds the rows.
* The CPU mode (``--device cpu``: the C++ CPU kernels against the torch backend) on its
  ``--quick`` path, shrunk to tiny shapes: both tables print with GB/s, GFLOP/s and
  speedups, and every measured rate is positive.
"""

from __future__ import annotations

import json

import pytest
import torch

from llmlab.attention.triton_backend import triton_unavailable_reason
from llmlab.kernels import cpu_kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(
    triton_unavailable_reason(DEVICE) is not None,
    reason=str(triton_unavailable_reason(DEVICE)),
)
def test_smoke_run_prints_tables_and_writes_json(tmp_path, capsys):
    from benchmarks.attention import main

    path = tmp_path / "attention.json"
    main(["--smoke", "--json", str(path)])
    out = capsys.readouterr().out
    assert "copy bandwidth:" in out
    assert "== paged decode" in out and "== prefill" in out
    assert "FAIL" not in out
    result = json.loads(path.read_text())
    assert result["meta"]["copy_gbps"] > 0
    rows = result["decode"] + result["prefill"]
    assert len(result["decode"]) == 1 and len(result["prefill"]) == 2
    for row in rows:
        # float32 on CPU (tolerance 1e-4), bfloat16 on CUDA (2e-2): "ok" is within it
        assert row["ok"] and row["sdpa_us"] is not None and row["rel_err"] is not None


@pytest.mark.skipif(
    cpu_kernels.unavailable_reason() is not None, reason=str(cpu_kernels.unavailable_reason())
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_quick_run_reports_bandwidth_flops_and_speedups(tmp_path, capsys, dtype):
    from benchmarks.attention import main

    path = tmp_path / "attention.json"
    # --quick's path, tiny shapes: 2 x 40 tokens of decode (a partial last block), a fresh
    # 24-token prompt and 8 tokens after 40 cached; a 1 MiB stream makes several copies.
    main(
        ["--device", "cpu", "--quick", "--dtype", dtype, "--batches", "2", "--contexts", "40",
         "--heads", "4/2", "--head-dim", "64", "--prefill", "1:0:24", "2:40:8",
         "--reps", "3", "--warmup", "1", "--copy-gib", str(1 / 64), "--stream-mib", "1",
         "--json", str(path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "CPU read bandwidth:" in out and "load average" in out
    assert "== paged decode" in out and "== prefill" in out
    assert "speedup" in out and "GB/s" in out and "GFLOP/s" in out and "%read" in out
    assert "FAIL" not in out and "skipped" not in out
    result = json.loads(path.read_text())
    meta = result["meta"]
    assert meta["kernels"] == "cpu" and meta["dtype"] == dtype and meta["read_gbps"] > 0
    (decode,) = result["decode"]
    assert (decode["batch"], decode["ctx"], decode["heads"], decode["head_dim"]) == (2, 40, 4, 64)
    assert decode["copies"] > 1  # the 1 MiB stream needs several of these tiny caches
    for key in ("llmlab_gbps", "torch_gbps", "llmlab_pct_read", "torch_pct_read", "speedup"):
        assert decode[key] > 0, key
    assert len(result["prefill"]) == 2
    for row in result["prefill"]:
        for key in ("llmlab_gflops", "torch_gflops", "speedup"):
            assert row[key] > 0, key
    for row in result["decode"] + result["prefill"]:
        assert row["ok"] and row["rel_err"] < (1e-4 if dtype == "float32" else 2e-2)
        assert row["speedup"] == pytest.approx(row["torch_us"] / row["llmlab_us"])
    # The decode row as printed: GB/s and speedup are in the table, not only the JSON.
    line = next(ln for ln in out.splitlines() if ln.split()[:4] == ["4/2", "64", "2", "40"])
    assert f"{decode['llmlab_gbps']:.1f}" in line and f"{decode['speedup']:.2f}" in line

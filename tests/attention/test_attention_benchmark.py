"""``benchmarks/attention.py --smoke`` runs end to end (tiny float32 shapes; on CPU in
Triton's interpreter, which ``tests/conftest.py`` selects): every section prints, llmlab
agrees with SDPA on each config, and the JSON holds the rows."""

from __future__ import annotations

import json

import pytest
import torch

from llmlab.attention.triton_backend import triton_unavailable_reason

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
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

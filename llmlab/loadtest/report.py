"""A load test's results: what happened to each request (:class:`RequestResult`), the
run's statistics (:func:`summarize`) and vLLM's plain-text table of them
(:func:`format_report`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from llmlab.loadtest.config import METRIC_TITLES


@attrs.define
class RequestResult:
    """What happened to one request (seconds; ``send_s`` counts from the run's start).

    ``prompt_tokens`` and ``output_tokens`` are the server's ``usage`` when it sent one, else
    the prompt's length (tokens, or words without a tokenizer) and the number of text
    chunks.
    """

    prompt_tokens: int
    max_tokens: int
    success: bool = False
    error: str = ""
    send_s: float = 0.0
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = attrs.Factory(list)
    output_tokens: int = 0
    generated_text: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2el_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "tpot_s": self.tpot_s}


def _percentile_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _metric_stats(metric: str, samples_s: list[float], percentiles: Sequence[float]) -> dict:
    # No samples (say, no request got past one token for TPOT) reads 0, as in vLLM.
    ms = np.asarray(samples_s or [0.0], dtype=float) * 1000.0
    stats = {
        f"mean_{metric}_ms": float(np.mean(ms)),
        f"median_{metric}_ms": float(np.median(ms)),
        f"std_{metric}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        stats[f"p{_percentile_name(p)}_{metric}_ms"] = float(np.percentile(ms, p))
    return stats


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    percentile_metrics: Sequence[str] = tuple(METRIC_TITLES),
    metric_percentiles: Sequence[float] = (50.0, 99.0),
) -> dict[str, Any]:
    """The run's totals, throughputs and latency statistics (vLLM's keys; see the module
    docstring for the definitions). Pure: it reads only its arguments."""
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    summary: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) * per_s,
        "output_throughput": total_output * per_s,
        "total_token_throughput": (total_input + total_output) * per_s,
    }
    samples_s = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2el": [r.e2el_s for r in done if r.e2el_s is not None],
    }
    for metric in percentile_metrics:
        summary.update(_metric_stats(metric, samples_s[metric], metric_percentiles))
    return summary


def format_report(result: Mapping[str, Any]) -> str:
    """The result as vLLM's plain-text table (ms for latencies)."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]

    def row(label: str, value: object) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40} {text}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    for metric in result.get("percentile_metrics", METRIC_TITLES):
        name = metric.upper()
        lines.append(f"{METRIC_TITLES[metric]:-^50}")
        row(f"Mean {name} (ms):", result[f"mean_{metric}_ms"])
        row(f"Median {name} (ms):", result[f"median_{metric}_ms"])
        for p in result.get("metric_percentiles", (50.0, 99.0)):
            p_name = _percentile_name(p)
            row(f"P{p_name} {name} (ms):", result[f"p{p_name}_{metric}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)

"""Speculative decoding through the server: same answers, and its counters on ``/metrics``."""

from __future__ import annotations

import httpx
import pytest

from llmlab.observe.events import StepEvent
from llmlab.entrypoints.server.metrics import EngineMetrics
from tests.server.conftest import metric, running

# A story the built-in model wrote, then its opening again: n-gram drafts get accepted.
PROMPT = (
    "Once upon a time, there was a shy boy named Lucky who lived in a little house in the "
    "woods. He loved to play with his friends. He was very bright and everyone liked him. "
    "One sunny morning\n\nOnce upon a time"
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def event(step_index: int, speculated) -> StepEvent:
    """A StepEvent with only speculation in it."""
    return StepEvent(
        step_index=step_index, scheduled=(), scheduled_users=(), scheduled_priorities=(),
        num_batched_tokens=0, preempted=(), finished=(), aborted=(), blocks_allocated=(),
        blocks_freed=(), blocks_prefix_hit=(), blocks_evicted=(), blocks_forked=(),
        num_free_blocks=0, num_total_blocks=0, kv_usage=0.0, num_waiting=0, num_running=0,
        wall_time_s=0.0, model_time_s=0.0, speculated=tuple(speculated),
    )


def test_engine_metrics_count_drafts_and_accepted_tokens_by_position():
    metrics = EngineMetrics("m")
    metrics(event(0, [("a", 4, 2), ("b", 2, 2)]))
    metrics(event(1, [("a", 3, 0), ("c", 1, 1)]))
    metrics(event(2, [("a", 4, 4)]))
    text = metrics.render().decode()
    assert metric(text, "llmlab:spec_decode_num_drafts_total") == 5
    assert metric(text, "llmlab:spec_decode_num_draft_tokens_total") == 14
    assert metric(text, "llmlab:spec_decode_num_accepted_tokens_total") == 9
    accepted = [metric(text, "llmlab:spec_decode_num_accepted_tokens_per_pos_total",
                       model_name="m", position=str(p)) for p in range(4)]
    drafted = [metric(text, "llmlab:spec_decode_num_draft_tokens_per_pos_total",
                      model_name="m", position=str(p)) for p in range(4)]
    assert accepted == [4, 3, 1, 1]  # position 0 is the first drafted token, as in vLLM
    assert drafted == [5, 4, 3, 2]


def test_engine_metrics_spec_counters_are_zero_without_speculation():
    metrics = EngineMetrics("m")
    metrics(event(0, []))
    text = metrics.render().decode()
    assert metric(text, "llmlab:spec_decode_num_drafts_total") == 0
    with pytest.raises(KeyError):
        metric(text, "llmlab:spec_decode_num_accepted_tokens_per_pos_total")


def test_a_speculating_server_answers_as_without_and_counts_its_drafts():
    from llmlab import LLM, SamplingParams
    from llmlab.builtin import builtin_model_path
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    model = str(builtin_model_path())
    expected = LLM(model).generate(
        [PROMPT], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False
    )[0].outputs[0].text
    engine = AsyncEngine.from_settings(model, speculative_config=NGRAM)
    with running(build_app(engine, served_model_names=["stories"])) as url:
        answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "stories", "prompt": PROMPT, "max_tokens": 40, "temperature": 0})
        assert answer.status_code == 200, answer.text
        text = httpx.get(f"{url}/metrics", timeout=30).text
    assert answer.json()["choices"][0]["text"] == expected
    drafts = metric(text, "llmlab:spec_decode_num_drafts_total")
    drafted = metric(text, "llmlab:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "llmlab:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and drafted >= drafts and accepted > 0
    assert metric(text, "llmlab:spec_decode_num_accepted_tokens_per_pos_total") == accepted

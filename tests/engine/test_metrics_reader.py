"""``LLM.get_metrics()`` reports exactly what the step events say, in vLLM's records."""

from __future__ import annotations

import pytest

from llmlab import LLM, SamplingParams
from llmlab.builtin import builtin_model_path
from llmlab.observe.metrics_reader import Counter, Gauge, Vector

# A story the built-in model wrote from "Once upon a time", then its opening again: it
# retells the story, so n-gram drafts are mostly (not always) accepted.
PROMPT = (
    "Once upon a time, there was a shy boy named Lucky who lived in a little house in the "
    "woods. He loved to play with his friends. He was very bright and everyone liked him. "
    "One sunny morning\n\nOnce upon a time"
)
GREEDY = SamplingParams(max_tokens=40, temperature=0)
K = 3
STATS = {"disable_log_stats": False}  # vLLM's switch for get_metrics()


def run(llm: LLM):
    events = []
    llm.llm_engine.subscribe(events.append)
    try:
        out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    finally:
        llm.llm_engine.unsubscribe(events.append)
    metrics = {}
    for m in llm.get_metrics():
        metrics[m.name, m.labels.get("finished_reason")] = m
    return out, events, metrics, llm.spec_decode_stats


@pytest.fixture(scope="module")
def speculating():
    llm = LLM(str(builtin_model_path()), **STATS, speculative_config={
        "method": "ngram", "num_speculative_tokens": K, "speculation_length": "fixed"})
    return run(llm)


@pytest.fixture(scope="module")
def plain():
    return run(LLM(str(builtin_model_path()), **STATS))


def value(metrics, name, reason=None):
    return metrics[f"llmlab:{name}", reason].value


def test_spec_decode_counters_are_the_sums_of_the_events(speculating):
    _, events, metrics, stats = speculating
    drafts = [entry for e in events for entry in e.speculated]
    assert value(metrics, "spec_decode_num_drafts") == len(drafts) == stats.num_drafts
    assert value(metrics, "spec_decode_num_draft_tokens") == sum(d for _, d, _ in drafts)
    assert value(metrics, "spec_decode_num_accepted_tokens") == sum(a for _, _, a in drafts)
    assert 0 < value(metrics, "spec_decode_num_accepted_tokens") < sum(d for _, d, _ in drafts)
    for name in ("spec_decode_num_drafts", "spec_decode_num_accepted_tokens"):
        assert isinstance(metrics[f"llmlab:{name}", None], Counter)


def test_accepted_per_position_is_non_increasing_and_sums_to_the_accepted_tokens(speculating):
    _, _, metrics, stats = speculating
    per_pos = metrics["llmlab:spec_decode_num_accepted_tokens_per_pos", None]
    assert isinstance(per_pos, Vector) and len(per_pos.values) == K
    assert all(a >= b for a, b in zip(per_pos.values, per_pos.values[1:]))
    assert sum(per_pos.values) == value(metrics, "spec_decode_num_accepted_tokens")
    drafted = metrics["llmlab:spec_decode_num_draft_tokens_per_pos", None].values
    assert sum(drafted) == value(metrics, "spec_decode_num_draft_tokens")
    assert drafted[0] == value(metrics, "spec_decode_num_drafts")
    assert per_pos.values == stats.accepted_per_pos and drafted == stats.drafted_per_pos


def test_token_request_and_queue_metrics(speculating):
    out, _, metrics, _ = speculating
    assert value(metrics, "prompt_tokens") == len(out.prompt_token_ids)
    assert value(metrics, "generation_tokens") == len(out.outputs[0].token_ids) == 40
    assert value(metrics, "request_success", "length") == 1
    assert value(metrics, "request_success", "stop") == value(metrics, "request_success",
                                                               "abort") == 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert isinstance(metrics[f"llmlab:{name}", None], Gauge)
        assert value(metrics, name) == 0, name  # the last step finished the only request
    assert all(m.labels["model_name"] == str(builtin_model_path()) for m in metrics.values())


def test_speculation_changes_no_greedy_token_and_is_zero_when_off(speculating, plain):
    assert speculating[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    _, events, metrics, _ = plain
    assert not any(e.speculated for e in events)
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens"):
        assert value(metrics, name) == 0, name
    assert metrics["llmlab:spec_decode_num_accepted_tokens_per_pos", None].values == []


def test_without_stats_there_is_no_observer_and_get_metrics_says_how_to_turn_them_on():
    llm = LLM(str(builtin_model_path()))
    assert llm.llm_engine.observers == [] and llm.spec_decode_stats is None
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        llm.get_metrics()


"""StepEvent carries what metrics need: admissions (arrival, prefix lookups), tokens per
request, and the step's clock readings."""

from __future__ import annotations

from llmlab import LLM, SamplingParams


def test_events_report_admissions_samples_and_times(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    events = []
    llm.llm_engine.subscribe(events.append)
    prompt = list(range(3, 23))  # 20 tokens: 5 blocks of 4, 4 of them cacheable
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    outs = llm.generate({"prompt_token_ids": prompt},
                        SamplingParams(max_tokens=3, n=2, ignore_eos=True, temperature=1.0,
                                       seed=0), use_tqdm=False)
    admitted = [a for e in events for a in e.admitted]
    assert [a.num_prompt_tokens for a in admitted] == [20, 20]
    assert [a.num_queried_tokens for a in admitted] == [20, 20]
    assert admitted[0].num_cached_tokens == 0
    assert admitted[1].num_cached_tokens == 16  # the second run hits 4 full blocks
    assert not any(a.resumed for a in admitted)
    sampled: dict[str, int] = {}
    for e in events:
        assert e.start_time_s <= e.end_time_s
        assert e.wall_time_s == e.end_time_s - e.start_time_s
        for request_id, n in e.sampled:
            sampled[request_id] = sampled.get(request_id, 0) + n
    group = outs[0].request_id
    assert sampled == {"0": 3, f"0_{group}": 3, f"1_{group}": 3}
    arrival = admitted[1].arrival_time
    first = next(e for e in events if any(a.request_id == f"0_{group}" for a in e.admitted))
    assert arrival <= first.start_time_s


def test_a_preempted_request_is_admitted_again_as_resumed(tiny_llama):
    # 64 blocks of 4 tokens: three requests growing to 120 tokens each cannot all fit
    llm = LLM(tiny_llama, dtype="float32", block_size=4, num_gpu_blocks_override=64,
              max_model_len=128, enable_prefix_caching=False)
    events = []
    llm.llm_engine.subscribe(events.append)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5] * 20}, {"prompt_token_ids": [6] * 20},
                  {"prompt_token_ids": [7] * 20}], params, use_tqdm=False)
    preempted = {r for e in events for r in e.preempted}
    assert preempted, "the workload was meant to preempt"
    resumed = {a.request_id for e in events for a in e.admitted if a.resumed}
    assert resumed == preempted
    assert all(a.num_queried_tokens == 0 for e in events for a in e.admitted)  # caching off

"""Experiments: generate a workload, run it through several engine configurations on the
real engine, and compare the metrics.

    import json
    from llmlab.experiments import compare, shared_prefix_chat

    vocab_size = json.load(open(f"{model}/config.json"))["vocab_size"]
    workload = shared_prefix_chat(8, 4, vocab_size=vocab_size, rate=20.0, seed=0)
    comparison = compare(
        workload,
        {
            "fcfs+lru": {"scheduling_policy": "fcfs", "eviction_policy": "lru"},
            "fcfs+fifo": {"scheduling_policy": "fcfs", "eviction_policy": "fifo"},
            "no prefix cache": {"enable_prefix_caching": False},
        },
        model=model,
        engine_kwargs={"dtype": "float32", "num_gpu_blocks_override": 64},
    )
    comparison.table      # throughput, TTFT, TPOT, hit rate, preemptions, fairness, ...
    comparison.figure()   # one bar chart per key metric

Metric definitions: :mod:`llmlab.experiments.metrics`. pandas, matplotlib and tqdm are
imported only when a comparison runs or is drawn.
"""

from llmlab.experiments.comparison import CONFIG_KEYS, KEY_METRICS, Comparison, compare
from llmlab.experiments.driver import run_workload
from llmlab.experiments.metrics import RequestRecord, StepTrace, fairness_gap, summarize
from llmlab.experiments.workloads import (
    Workload,
    WorkloadRequest,
    bursts,
    chain,
    few_shot,
    mixed_long_short,
    multi_tenant,
    poisson_arrivals,
    shared_prefix_chat,
)

__all__ = [
    "CONFIG_KEYS",
    "KEY_METRICS",
    "Comparison",
    "RequestRecord",
    "StepTrace",
    "Workload",
    "WorkloadRequest",
    "bursts",
    "chain",
    "compare",
    "fairness_gap",
    "few_shot",
    "mixed_long_short",
    "multi_tenant",
    "poisson_arrivals",
    "run_workload",
    "shared_prefix_chat",
    "summarize",
]

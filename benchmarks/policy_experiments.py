"""Policy experiments on the real engine: prefix hits on shared prefixes, fairness between users.

Two workloads from :mod:`llmlab.experiments`, each run through several configurations with
:func:`~llmlab.experiments.compare` on llmlab's built-in tiny Llama (random weights, built
offline; the policies' effects do not depend on the weights), every request arriving at
t=0 so the queue is as long as it gets and the runs are deterministic:

1. **shared prefix** (``few_shot`` + ``shared_prefix_chat`` requests, interleaved): a KV
   cache too small for every prefix, so admission order and eviction decide what stays
   cached. Baseline ``fcfs+fifo``; the claim: ``cache_aware+lru`` hits more.
2. **multi-tenant** (``multi_tenant``: a heavy user sends 80% of the requests): baseline
   ``fcfs``; the claim: ``fair`` (VTC) shrinks the service gap between the two users.

Run: ``python -m benchmarks.policy_experiments [--device cpu] [--model PATH]``; prints both
tables and the ratios against the baselines, and saves the figures as PNG when asked.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from llmlab.experiments import Workload, compare, few_shot, multi_tenant, shared_prefix_chat

PREFIX_CONFIGS = {
    "fcfs+fifo": {"scheduling_policy": "fcfs", "eviction_policy": "fifo"},
    "fcfs+lru": {"scheduling_policy": "fcfs", "eviction_policy": "lru"},
    "cache_aware+fifo": {"scheduling_policy": "cache_aware", "eviction_policy": "fifo"},
    "cache_aware+lru": {"scheduling_policy": "cache_aware", "eviction_policy": "lru"},
    "cache_aware+s3fifo": {"scheduling_policy": "cache_aware", "eviction_policy": "s3fifo"},
}
FAIR_CONFIGS = {
    "fcfs": {"scheduling_policy": "fcfs"},
    "fair": {"scheduling_policy": "fair"},
}
COLUMNS = [
    "output_tokens_per_s", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "e2e_mean_s",
    "prefix_hit_rate", "num_preemptions", "fairness_gap_tokens",
]


def shared_prefix_workload(vocab_size: int, seed: int = 0) -> Workload:
    shots = few_shot(48, vocab_size=vocab_size, num_templates=6, template_len=192,
                     question_len=(8, 24), output_len=8, seed=seed)
    chats = shared_prefix_chat(6, 4, vocab_size=vocab_size, system_prompt_len=96,
                               user_turn_len=(8, 24), output_len=8, seed=seed + 1)
    # Interleave the two request streams so neither sits in one block of the queue.
    mixed = [r for pair in zip(shots.requests, chats.requests) for r in pair]
    mixed += list(shots.requests[len(chats.requests):])
    return Workload("shared prefix (few-shot + chat)", tuple(mixed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in tiny Llama")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--figures", default=None, help="directory to save PNG figures in")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from llmlab.builtin import ensure_builtin_model

        model = str(ensure_builtin_model())
    vocab_size = json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]

    import pandas as pd

    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 20)
    common = {"dtype": "float32", "device": args.device, "seed": 0, "block_size": 16,
              "max_model_len": 512, "max_num_batched_tokens": 512}

    prefix = compare(
        shared_prefix_workload(vocab_size), PREFIX_CONFIGS, model=model,
        engine_kwargs={**common, "max_num_seqs": 4, "num_gpu_blocks_override": 48},
    )
    print("== shared prefix:", prefix.workload.num_requests, "requests, KV cache of 48 blocks x 16")
    print(prefix.table[COLUMNS].round(4).to_string())
    base = prefix.table.loc["fcfs+fifo", "prefix_hit_rate"]
    for label in PREFIX_CONFIGS:
        rate = prefix.table.loc[label, "prefix_hit_rate"]
        print(f"  hit rate {label}: {rate:.3f} ({rate / base:.2f}x fcfs+fifo)")

    tenants = multi_tenant(64, vocab_size=vocab_size, heavy_share=0.8, prompt_len=(16, 64),
                           output_len=(8, 32), seed=0)
    fair = compare(tenants, FAIR_CONFIGS, model=model,
                   engine_kwargs={**common, "max_num_seqs": 4})
    served = [c for c in fair.table.columns if c.startswith("served[")]
    print("\n== multi-tenant:", tenants.num_requests, "requests (80% from 'heavy'), 4 rows")
    print(fair.table[COLUMNS + served].round(4).to_string())
    base_gap = fair.table.loc["fcfs", "fairness_gap_tokens"]
    gap = fair.table.loc["fair", "fairness_gap_tokens"]
    print(f"  service gap fair / fcfs: {gap:.0f} / {base_gap:.0f} tokens = {gap / base_gap:.2f}x")

    if args.figures:
        out = pathlib.Path(args.figures)
        out.mkdir(parents=True, exist_ok=True)
        prefix.figure().savefig(out / "shared_prefix.png", dpi=100)
        fair.figure().savefig(out / "multi_tenant.png", dpi=100)
        print(f"figures saved in {out}/")


if __name__ == "__main__":
    main()

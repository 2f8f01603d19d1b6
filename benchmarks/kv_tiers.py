"""A second tier for the prefix cache: hit rates and TTFT with and without it.

A multi-turn chat workload (:func:`~llmlab.experiments.shared_prefix_chat`: every turn
repeats its conversation so far) whose working set is several times the device KV pool,
run with :func:`~llmlab.experiments.compare` on llmlab's built-in model:

* ``no tier``: the device pool alone (the baseline): an evicted prefix is recomputed;
* ``lru/lru``: plus an offload tier (``kv_offloading_size``, host memory) smaller than the
  working set, with LRU in both tiers;
* ``lru/arc`` and ``lru/s3fifo``: the same tier ordered by ARC or S3-FIFO.

For each it prints the prefix-hit rate (all tiers; the comparison's ``prefix_hit_rate``),
the device and second-tier hit rates (tokens hit over tokens looked up in that tier, from
the admissions in the step events), blocks spilled and loaded, TTFT and end-to-end time,
and the ratios against ``no tier``. Every request arrives at t=0, so runs are
deterministic in everything but time.

Run: ``python -m benchmarks.kv_tiers [--device cpu] [--model PATH]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from llmlab.experiments import compare, shared_prefix_chat

BLOCK_SIZE = 16
DEVICE_BLOCKS = 48
TIER_BLOCKS = 160


def tier_gib(config: dict, num_blocks: int, dtype_bytes: int = 4) -> float:
    """GiB for ``num_blocks`` KV blocks of a Llama-shaped model (float32)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    per_block = 2 * config["num_hidden_layers"] * kv_heads * head_dim * BLOCK_SIZE * dtype_bytes
    return num_blocks * per_block / (1 << 30)


def configs(size_gib: float) -> dict[str, dict]:
    tier = {"kv_offloading_size": size_gib}
    return {
        "no tier": {},
        "lru/lru": {**tier, "kv_offloading_eviction_policy": "lru"},
        "lru/arc": {**tier, "kv_offloading_eviction_policy": "arc"},
        "lru/s3fifo": {**tier, "kv_offloading_eviction_policy": "s3fifo"},
    }


def tier_rates(events) -> dict[str, float]:
    """Per-tier hit rates and transfer counts from a run's step events (first admissions)."""
    queried = device = offloaded = 0
    for event in events:
        for a in event.admitted:
            if a.resumed:
                continue
            queried += a.num_queried_tokens
            device += a.num_cached_tokens - a.num_offloaded_tokens
            offloaded += a.num_offloaded_tokens
    missed_on_device = queried - device
    return {
        "device_hit_rate": device / queried if queried else 0.0,
        "tier_hit_rate": offloaded / missed_on_device if missed_on_device else 0.0,
        "spilled": sum(len(e.blocks_spilled) for e in events),
        "loaded": sum(len(e.blocks_loaded) for e in events),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in llmlab-stories")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from llmlab.builtin import ensure_builtin_model

        model = str(ensure_builtin_model())
    config = json.loads((pathlib.Path(model) / "config.json").read_text())
    workload = shared_prefix_chat(
        args.conversations, args.turns, vocab_size=config["vocab_size"], low=3,
        system_prompt_len=32, user_turn_len=(16, 32), output_len=16, seed=0,
    )
    size = tier_gib(config, TIER_BLOCKS)
    comparison = compare(
        workload, configs(size), model=model, progress=False,
        engine_kwargs={"dtype": "float32", "device": args.device, "seed": 0,
                       "block_size": BLOCK_SIZE, "max_model_len": 512, "max_num_seqs": 8,
                       "max_num_batched_tokens": 512, "num_gpu_blocks_override": DEVICE_BLOCKS},
    )
    table = comparison.table[["prefix_hit_rate", "ttft_mean_s", "ttft_p99_s", "e2e_mean_s"]]
    import pandas as pd

    extra = pd.DataFrame.from_dict(
        {label: tier_rates(events) for label, events in comparison.events.items()},
        orient="index",
    )
    table = table.join(extra)
    base = table.loc["no tier"]
    table["ttft_vs_no_tier"] = table["ttft_mean_s"] / base["ttft_mean_s"]
    table["hits_vs_no_tier"] = table["prefix_hit_rate"] / base["prefix_hit_rate"]
    pd.set_option("display.width", 200)
    print(f"{workload.num_requests} requests ({args.conversations} chats x {args.turns} turns, "
          f"all at t=0); device pool {DEVICE_BLOCKS} blocks x {BLOCK_SIZE}, offload tier "
          f"{TIER_BLOCKS} blocks ({size * 1024:.1f} MiB)")
    print(table.round(4).to_string())


if __name__ == "__main__":
    main()

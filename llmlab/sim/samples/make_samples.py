"""Writes the synthetic sample traces beside this file (run once: ``python make_samples.py``).

Not real data: about 200 requests each over about a minute of Poisson arrivals, with
modest lengths, in the file formats that :mod:`llmlab.sim.traces` reads. The Mooncake
sample draws each prompt from a few shared prefixes of 1-3 blocks plus an optional block
of its own, so prefix sharing shows; the BurstGPT sample has a few failed requests (0
response tokens), as the real trace does.
"""

from __future__ import annotations

import datetime
import json
import pathlib

import numpy as np

HERE = pathlib.Path(__file__).parent
NUM_REQUESTS = 200
DURATION_S = 60.0


def _arrivals(rng: np.random.Generator) -> np.ndarray:
    times = np.cumsum(rng.exponential(1.0, NUM_REQUESTS - 1))
    return np.concatenate([[0.0], times * (DURATION_S / times[-1])])


def _lengths(rng: np.random.Generator, low: int, high: int, median: float) -> list[int]:
    """Log-normal lengths clipped to ``[low, high]`` (request lengths have a long tail)."""
    return np.clip(rng.lognormal(np.log(median), 0.7, NUM_REQUESTS), low, high).astype(
        int).tolist()


def write_azure(path: pathlib.Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    start = datetime.datetime(2023, 11, 16, 18, 15, 46)
    # Times in units of 100 ns, written with Azure's seven fractional digits.
    ticks = np.round(_arrivals(rng) * 1e7).astype(np.int64) + 6_805_900
    prompts, outputs = _lengths(rng, 20, 400, 120), _lengths(rng, 5, 200, 40)
    with open(path, "w", encoding="utf-8", newline="") as file:
        file.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for tick, prompt, output in zip(ticks.tolist(), prompts, outputs, strict=True):
            whole = start + datetime.timedelta(seconds=tick // 10**7)
            file.write(f"{whole:%Y-%m-%d %H:%M:%S}.{tick % 10**7:07d},{prompt},{output}\n")


def write_mooncake(path: pathlib.Path, seed: int = 0, block_tokens: int = 512) -> None:
    rng = np.random.default_rng(seed)
    prefixes = [[0], [1, 2], [3, 4, 5], [6]]  # shared "system prompts" of 1-3 blocks
    next_id = 7
    times_ms = np.round(_arrivals(rng) * 1000).astype(int).tolist()
    outputs = _lengths(rng, 5, 200, 40)
    with open(path, "w", encoding="utf-8") as file:
        for time_ms, output in zip(times_ms, outputs, strict=True):
            hash_ids = list(prefixes[rng.integers(len(prefixes))])
            if rng.random() < 0.6:  # a block of its own after the shared prefix
                hash_ids.append(next_id)
                next_id += 1
            input_length = (len(hash_ids) - 1) * block_tokens + int(
                rng.integers(1, block_tokens + 1))
            file.write(json.dumps({
                "timestamp": time_ms, "input_length": input_length,
                "output_length": output, "hash_ids": hash_ids,
            }) + "\n")


def write_burstgpt(path: pathlib.Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    times = _arrivals(rng) + 5.0
    prompts, outputs = _lengths(rng, 20, 400, 150), _lengths(rng, 5, 200, 60)
    failed = rng.random(NUM_REQUESTS) < 0.03
    models = rng.choice(["ChatGPT", "GPT-4"], NUM_REQUESTS, p=[0.8, 0.2]).tolist()
    logs = rng.choice(["Conversation log", "API log"], NUM_REQUESTS).tolist()
    with open(path, "w", encoding="utf-8", newline="") as file:
        file.write("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n")
        for row in zip(times.tolist(), models, prompts, outputs, failed.tolist(), logs,
                       strict=True):
            time, model, prompt, output, fail, log = row
            output = 0 if fail else output
            file.write(f"{time:.3f},{model},{prompt},{output},{prompt + output},{log}\n")


if __name__ == "__main__":
    write_azure(HERE / "azure_conv_sample.csv")
    write_mooncake(HERE / "mooncake_sample.jsonl")
    write_burstgpt(HERE / "burstgpt_sample.csv")

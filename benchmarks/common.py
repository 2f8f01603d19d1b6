"""Shared benchmark pieces: the synthetic workload, the benchmark model, and the compute floor.

The compute floor is the time the workload's matrix multiplications alone would take at the
best float32 ``torch.mm`` rate this machine reaches on the workload's own shapes: no engine
that runs these matmuls in float32 through torch can beat it, so an engine's distance from
it is the overhead left to remove.
"""

from __future__ import annotations

import pathlib
import random
import time

import attrs
import torch

# The default benchmark model: Llama-shaped, small enough for a CPU, big enough that matmuls
# (not Python) should dominate a good engine's time.
BENCH_MODEL_CONFIG = {
    "vocab_size": 8000,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1408,
    "max_position_embeddings": 1024,
}

# Token ids 0 and 1 are the tiny tokenizer's BOS and EOS; random prompts avoid them.
FIRST_ORDINARY_TOKEN_ID = 2


@attrs.frozen
class Workload:
    """Requests to run: prompt token ids and the number of output tokens each one asks for."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, num_requests: int, max_output_len: int) -> Workload:
        """The first requests, with outputs capped: a cheap warmup that takes the same paths."""
        return Workload(
            prompts=self.prompts[:num_requests],
            output_lens=[min(n, max_output_len) for n in self.output_lens[:num_requests]],
        )


def make_workload(
    num_requests: int,
    seed: int,
    vocab_size: int,
    prompt_len_range: tuple[int, int] = (16, 256),
    output_len_range: tuple[int, int] = (16, 128),
) -> Workload:
    """Random prompt ids; lengths uniform in the (inclusive) ranges; same seed, same workload."""
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_len_range)
        output_lens.append(rng.randint(*output_len_range))
        prompts.append(
            [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size) for _ in range(prompt_len)]
        )
    return Workload(prompts=prompts, output_lens=output_lens)


def build_benchmark_model(path: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write the random-weight benchmark Llama (HF format, float32) to ``path``."""
    from llmlab.models.tiny import build_tiny_model

    return build_tiny_model(path, "LlamaForCausalLM", seed=seed, **BENCH_MODEL_CONFIG)


@attrs.frozen
class ModelShape:
    """The dimensions that decide a decoder-only transformer's matmul FLOPs."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        return cls(
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
        )

    def layer_linear_flops_per_token(self) -> int:
        """q, k, v, o projections plus the gated MLP (gate, up, down); 2 FLOPs per weight."""
        h, q_dim = self.hidden_size, self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        attention_proj = h * q_dim + 2 * h * kv_dim + q_dim * h
        mlp = 3 * h * self.intermediate_size
        return 2 * (attention_proj + mlp)

    def lm_head_flops_per_token(self) -> int:
        return 2 * self.hidden_size * self.vocab_size

    def attention_flops_per_layer(self, context_len: int) -> int:
        """Scores (q @ k^T) and weighted values (p @ v) for one query token over its context."""
        return 2 * 2 * context_len * self.head_dim * self.num_heads


@attrs.frozen
class WorkloadFlops:
    linear: int
    lm_head: int
    attention: int

    @property
    def total(self) -> int:
        return self.linear + self.lm_head + self.attention


def count_workload_flops(shape: ModelShape, workload: Workload) -> WorkloadFlops:
    """Matmul FLOPs an ideal engine spends on the workload (no padding, no recompute).

    A request with ``p`` prompt and ``n`` output tokens sends ``p + n - 1`` tokens through the
    layers (the prompt, then every output token but the last, which is never fed back), and
    ``n`` rows through the lm_head (the last prompt position, then each decode step). Token at
    position ``i`` (0-based) attends over ``i + 1`` positions (causal, KV cached).
    """
    linear = lm_head = attention = 0
    for prompt, num_outputs in zip(workload.prompts, workload.output_lens, strict=True):
        tokens_through_layers = len(prompt) + num_outputs - 1
        linear += tokens_through_layers * shape.num_layers * shape.layer_linear_flops_per_token()
        lm_head += num_outputs * shape.lm_head_flops_per_token()
        sum_of_context_lens = tokens_through_layers * (tokens_through_layers + 1) // 2
        attention += shape.num_layers * shape.attention_flops_per_layer(sum_of_context_lens)
    return WorkloadFlops(linear=linear, lm_head=lm_head, attention=attention)


def representative_matmul_shapes(shape: ModelShape) -> list[tuple[int, int, int]]:
    """(rows, inner, cols) of the workload's big matmuls: prefill chunks and decode batches."""
    h, ffn, vocab = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    return [
        (512, h, ffn),  # a prefill chunk through gate/up
        (512, ffn, h),  # ... through down
        (2048, h, ffn),  # a large mixed prefill step
        (64, h, ffn),  # a 64-request decode step through gate/up
        (64, h, vocab),  # ... through the lm_head
    ]


def measure_matmul_flops_per_s(
    rows: int, inner: int, cols: int, num_trials: int = 15, trial_time_s: float = 0.05
) -> float:
    """Best float32 ``torch.mm`` rate for one shape over short trials (the best trial, so
    other processes sharing the CPU distort the floor as little as possible)."""
    a = torch.randn(rows, inner)
    b = torch.randn(inner, cols)
    out = torch.empty(rows, cols)
    for _ in range(3):
        torch.mm(a, b, out=out)
    best_s_per_mm = float("inf")
    for _ in range(num_trials):
        iterations, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < trial_time_s or iterations < 2:
            torch.mm(a, b, out=out)
            iterations += 1
        best_s_per_mm = min(best_s_per_mm, elapsed / iterations)
    return 2 * rows * inner * cols / best_s_per_mm

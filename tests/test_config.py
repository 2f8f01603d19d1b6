"""EngineConfig: every field type- and range-checked at construction, vLLM keywords included."""

from __future__ import annotations

import math
import pathlib
import re

import attrs
import numpy as np
import pytest
import torch

from llmlab.config import EngineConfig


def config(**settings) -> EngineConfig:
    return EngineConfig(**{"model": "some/model", **settings})


# (field, bad value, exception, text the message must contain besides the field name)
BAD = [
    ("model", "", ValueError, "''"),
    ("model", None, TypeError, "None"),
    ("model", 3, TypeError, "3"),
    ("model", b"some/model", TypeError, "b'some/model'"),
    ("tokenizer", "", ValueError, "''"),
    ("tokenizer", 1, TypeError, "1"),
    ("revision", 5, TypeError, "5"),
    ("revision", "", ValueError, "''"),
    ("tokenizer_revision", "", ValueError, "''"),
    ("tokenizer_revision", b"main", TypeError, "b'main'"),
    ("dtype", None, TypeError, "None"),
    ("dtype", "float8", ValueError, "'float8'"),
    ("dtype", torch.int8, ValueError, "torch.int8"),
    ("seed", 1.5, TypeError, "1.5"),
    ("seed", True, TypeError, "True"),
    ("seed", "0", TypeError, "'0'"),
    ("seed", 2**64, ValueError, str(2**64)),
    ("device", "gpu", ValueError, "'gpu'"),
    ("device", "cuda:x", ValueError, "'cuda:x'"),
    ("device", None, TypeError, "None"),
    ("device", torch.device("cpu"), TypeError, "device(type='cpu')"),
    ("max_model_len", 0, ValueError, "0"),
    ("max_model_len", 512.0, TypeError, "512.0"),
    ("max_model_len", True, TypeError, "True"),
    ("block_size", 0, ValueError, "0"),
    ("block_size", 16.5, TypeError, "16.5"),
    ("block_size", None, TypeError, "None"),
    ("block_size", "16", TypeError, "'16'"),
    ("enable_prefix_caching", 1, TypeError, "1"),
    ("enable_prefix_caching", None, TypeError, "None"),
    ("enable_prefix_caching", "False", TypeError, "'False'"),
    ("enable_chunked_prefill", 0, TypeError, "0"),
    ("enable_chunked_prefill", "False", TypeError, "'False'"),
    ("max_num_seqs", 0, ValueError, "0"),
    ("max_num_seqs", False, TypeError, "False"),
    ("max_num_seqs", None, TypeError, "None"),
    ("max_num_batched_tokens", -1, ValueError, "-1"),
    ("max_num_batched_tokens", 1e4, TypeError, "10000.0"),
    ("kv_cache_memory_bytes", 0, ValueError, "0"),
    ("kv_cache_memory_bytes", 2.5e9, TypeError, "2500000000.0"),
    ("num_gpu_blocks_override", 0, ValueError, "0"),
    ("num_gpu_blocks_override", np.float64(8), TypeError, "8.0"),
    ("gpu_memory_utilization", 0, ValueError, "0.0"),
    ("gpu_memory_utilization", 1.5, ValueError, "1.5"),
    ("gpu_memory_utilization", math.nan, ValueError, "nan"),
    ("gpu_memory_utilization", True, TypeError, "True"),
    ("gpu_memory_utilization", "0.9", TypeError, "'0.9'"),
    ("gpu_memory_utilization", None, TypeError, "None"),
    ("skip_tokenizer_init", 1, TypeError, "1"),
    ("download_dir", "", ValueError, "''"),
    ("download_dir", 7, TypeError, "7"),
    ("max_logprobs", -2, ValueError, "-2"),
    ("max_logprobs", 5.0, TypeError, "5.0"),
    ("max_logprobs", None, TypeError, "None"),
    ("trust_remote_code", "yes", TypeError, "'yes'"),
    ("trust_remote_code", None, TypeError, "None"),
    ("enforce_eager", 1, TypeError, "1"),
    ("disable_log_stats", 0, TypeError, "0"),
    ("swap_space", -1, ValueError, "-1.0"),
    ("swap_space", math.inf, ValueError, "inf"),
    ("swap_space", None, TypeError, "None"),
    ("swap_space", "4", TypeError, "'4'"),
    ("tensor_parallel_size", 0, ValueError, "0"),
    ("data_parallel_size", 0, ValueError, "0"),
    ("data_parallel_size", 1.5, TypeError, "1.5"),
    ("distributed_executor_backend", "nccl", ValueError, "'nccl'"),
    ("collective_backend", "mpi", ValueError, "'mpi'"),
    ("distributed_timeout_s", 0, ValueError, "0"),
    ("tensor_parallel_size", 1.0, TypeError, "1.0"),
    ("tensor_parallel_size", True, TypeError, "True"),
    ("pipeline_parallel_size", 4, ValueError, "4"),
    ("pipeline_parallel_size", None, TypeError, "None"),
    ("tokenizer_mode", "mistral", ValueError, "'mistral'"),
    ("tokenizer_mode", None, TypeError, "None"),
    ("quantization", "bitsandbytes", ValueError, "'bitsandbytes'"),
    ("quantization", 4, TypeError, "4"),
    ("kv_cache_dtype", "fp8", ValueError, "'fp8'"),
    ("kv_cache_dtype", None, TypeError, "None"),
]


@pytest.mark.parametrize("field, value, error, shown", BAD, ids=lambda v: repr(v)[:30])
def test_bad_value_is_rejected_with_a_message_naming_field_and_value(field, value, error, shown):
    with pytest.raises(error) as info:
        config(**{field: value})
    assert type(info.value) is error  # a TypeError is not a ValueError, nor the reverse
    message = str(info.value)
    assert field in message, message
    assert shown in message, message


@pytest.mark.parametrize(
    "field, value, stored",
    [
        ("model", pathlib.Path("/models/x"), "/models/x"),
        ("tokenizer", None, None),
        ("tokenizer", pathlib.Path("tok"), "tok"),
        ("dtype", "bfloat16", "bfloat16"),
        ("dtype", "torch.float16", "torch.float16"),
        ("dtype", torch.float16, torch.float16),
        ("seed", None, None),
        ("seed", np.int64(3), 3),
        ("seed", -(2**63), -(2**63)),
        ("device", "cpu", "cpu"),
        ("device", "cuda:1", "cuda:1"),
        ("max_model_len", np.int32(512), 512),
        ("block_size", torch.tensor(32), 32),
        ("enable_prefix_caching", np.False_, False),
        ("enable_chunked_prefill", None, None),
        ("enable_chunked_prefill", True, True),
        ("max_num_batched_tokens", np.int64(4096), 4096),
        ("kv_cache_memory_bytes", 2**40, 2**40),
        ("gpu_memory_utilization", 1, 1.0),
        ("gpu_memory_utilization", np.float32(0.5), 0.5),
        ("download_dir", pathlib.Path("/tmp/hf"), "/tmp/hf"),
        ("max_logprobs", -1, -1),
        ("max_logprobs", 0, 0),
        ("trust_remote_code", True, True),
        ("enforce_eager", True, True),
        ("disable_log_stats", False, False),
        ("swap_space", 0, 0.0),
        ("swap_space", 16, 16.0),
        ("tensor_parallel_size", np.int64(1), 1),
        ("pipeline_parallel_size", 1, 1),
        ("tokenizer_mode", "slow", "slow"),
        ("quantization", None, None),
        ("kv_cache_dtype", "auto", "auto"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_good_value_is_stored_as_a_plain_python_value(field, value, stored):
    got = getattr(config(**{field: value}), field)
    assert got == stored
    assert type(got) is type(stored)


def test_vllm_keyword_defaults_match_vllm():
    cfg = config()
    assert (cfg.trust_remote_code, cfg.enforce_eager, cfg.disable_log_stats) == (False, False, True)
    assert (cfg.tensor_parallel_size, cfg.pipeline_parallel_size) == (1, 1)
    assert (cfg.enable_chunked_prefill, cfg.max_logprobs, cfg.swap_space) == (None, 20, 4.0)
    assert (cfg.tokenizer_mode, cfg.kv_cache_dtype) == ("auto", "auto")
    assert cfg.quantization is cfg.download_dir is cfg.tokenizer_revision is None
    assert cfg.seed == 0


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            dict(pipeline_parallel_size=2),
            ("pipeline_parallel_size=2 is not supported: llmlab does not split layers "
             "across devices (only 1 is allowed); use tensor_parallel_size to split a model"),
        ),
        (
            dict(tensor_parallel_size=2, distributed_executor_backend="uni"),
            ("distributed_executor_backend='uni' runs one process, but "
             "tensor_parallel_size=2; use 'mp' or 'ray'"),
        ),
        (dict(quantization="bnb"), "quantization must be one of 'int8', 'fp8', 'gptq', 'awq', "
         "'compressed-tensors', 'gptq_marlin', 'awq_marlin', got 'bnb'"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8' is not supported (only 'auto')"),
        (
            dict(tokenizer_mode="mistral"),
            "tokenizer_mode must be one of 'auto', 'slow', got 'mistral'",
        ),
        (dict(block_size=0), "block_size must be >= 1, got 0"),
        (dict(gpu_memory_utilization=2), "gpu_memory_utilization must be in (0, 1], got 2.0"),
        (dict(max_logprobs=-5), "max_logprobs must be >= 0, or -1 for no limit, got -5"),
        (dict(device="tpu"), "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        (dict(max_model_len=8.0), "max_model_len must be an int or None, got float 8.0"),
    ],
)
def test_messages_say_what_is_allowed(settings, message):
    with pytest.raises((TypeError, ValueError)) as info:
        config(**settings)
    assert str(info.value) == message


def test_chunked_prefill_off_needs_a_budget_that_fits_the_longest_prompt():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "enable_chunked_prefill=False needs max_num_batched_tokens (32) >= max_model_len (64)"
        ),
    ):
        config(enable_chunked_prefill=False, max_model_len=64, max_num_batched_tokens=32)
    # Fits, or one of the two is left for the engine to decide (it checks again).
    config(enable_chunked_prefill=False, max_model_len=64, max_num_batched_tokens=64)
    config(enable_chunked_prefill=False, max_model_len=64)
    config(enable_chunked_prefill=False, max_num_batched_tokens=32)
    config(enable_chunked_prefill=True, max_model_len=64, max_num_batched_tokens=32)
    config(max_model_len=64, max_num_batched_tokens=32)


def test_model_is_required():
    with pytest.raises(TypeError, match="model"):
        EngineConfig()


def test_evolve_revalidates_and_frozen_forbids_assignment():
    cfg = config(block_size=np.int64(8))
    assert attrs.evolve(cfg, max_num_seqs=4).block_size == 8
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        attrs.evolve(cfg, block_size=0)
    with pytest.raises(ValueError, match="enable_chunked_prefill=False"):
        attrs.evolve(
            cfg, enable_chunked_prefill=False, max_model_len=64, max_num_batched_tokens=8
        )
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.block_size = 32
    assert attrs.evolve(config(seed=None), seed=123).seed == 123

"""Shared fixtures: tiny random-weight Hugging Face models built once per test session."""

from __future__ import annotations

import os
import signal

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter, which must be chosen before
# triton is first imported (its own library functions are built in that mode).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llmlab.testing.tiny import build_tiny_model

ARCHITECTURES = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GPT2LMHeadModel",
    "OPTForCausalLM",
    # Mixture of experts (issue 43): the dense models' engine-level checks hold for them.
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
]


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one pytest-xdist worker per core this process may use (CPU affinity and
    the cgroup's quota, as :func:`llmlab.threads.available_cpus` counts them), not psutil's
    count of the machine's physical cores, which a container's quota does not lower."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads the user's choice
    from llmlab.threads import available_cpus

    return available_cpus()


def pytest_configure(config):
    # A shell starts a background job with SIGINT ignored, and Python keeps that setting, so
    # _thread.interrupt_main() does nothing there (tests/engine/test_faults.py interrupts
    # generate() that way). Python's own handler, as in a foreground run; also in each worker.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # A pytest-xdist worker shares the cores with the other workers: an equal share of torch
    # threads each (one on two cores), as llmlab gives the processes it starts itself
    # (llmlab.threads.child_env). A lower count stands, so engines built by the tests keep it.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        from llmlab.threads import available_cpus

        torch.set_num_threads(max(1, min(torch.get_num_threads(), available_cpus() // workers)))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``factory(architecture) -> path`` of a tiny model, built at most once per session."""
    built: dict[str, str] = {}

    def factory(architecture: str = "LlamaForCausalLM") -> str:
        if architecture not in built:
            path = tmp_path_factory.mktemp(architecture)
            built[architecture] = str(build_tiny_model(path, architecture, seed=0))
        return built[architecture]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("LlamaForCausalLM")


# On CUDA an engine takes gpu_memory_utilization (0.9 by default) of the whole device for its
# KV cache, minus what is already in use, as vLLM's does. The suite builds many engines, some
# alive at once (module-scoped fixtures) and in several pytest-xdist workers sharing one GPU:
# at 90% each, every engine after the first would find no room. So in the tests each engine
# sizes its cache as if the device had TEST_DEVICE_BYTES (still scaled by the utilization, so
# tests of that setting keep their meaning), and never more than the real budget.
# Subprocesses (the CLI tests) get an explicit cache size instead: tests.helpers.CLI_KV_FLAGS.
TEST_DEVICE_BYTES = 2 << 30

if torch.cuda.is_available():
    import functools

    from llmlab.cache import kv_tensors

    @functools.wraps(kv_tensors._cuda_budget)
    def _test_cuda_budget(device, gpu_memory_utilization, profile_peak_bytes):
        real = _test_cuda_budget.__wrapped__(device, gpu_memory_utilization, profile_peak_bytes)
        return min(real, int(gpu_memory_utilization * TEST_DEVICE_BYTES))

    kv_tensors._cuda_budget = _test_cuda_budget

    @pytest.fixture(autouse=True)
    def _release_cuda_memory():
        """Free each test's engines before the next one sizes its KV cache."""
        yield
        import gc

        gc.collect()
        torch.cuda.empty_cache()

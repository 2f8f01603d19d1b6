"""Shared fixtures: tiny random-weight Hugging Face models built once per test session."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter, which must be chosen before
# triton is first imported (its own library functions are built in that mode).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llmlab.models.tiny import build_tiny_model

ARCHITECTURES = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GPT2LMHeadModel",
    "OPTForCausalLM",
]


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

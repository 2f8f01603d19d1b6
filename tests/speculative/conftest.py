"""Models for the speculative-decoding tests: tiny targets and drafts that share their
vocabulary (built once per session)."""

from __future__ import annotations

import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmlab.testing.tiny import build_tiny_model


def perturbed_copy(source: str | pathlib.Path, dest: pathlib.Path, scale: float, seed: int) -> str:
    """A copy of a checkpoint whose weights carry relative noise ``scale``: a different
    model that agrees with the source often but not always (an imperfect draft)."""
    import shutil

    shutil.copytree(source, dest)
    path = dest / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    noisy = {}
    for name, t in tensors.items():
        if t.is_floating_point():
            t = t + scale * t.std() * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        noisy[name] = t.contiguous()
    save_file(noisy, path, metadata={"format": "pt"})
    return str(dest)


@pytest.fixture(scope="session")
def spec_models(tmp_path_factory, tiny_model_factory):
    """``models(arch) -> (target, draft)``: the session's tiny target and a perturbed copy."""
    built: dict[str, tuple[str, str]] = {}

    def models(architecture: str = "LlamaForCausalLM") -> tuple[str, str]:
        if architecture not in built:
            target = tiny_model_factory(architecture)
            draft = perturbed_copy(
                target, tmp_path_factory.mktemp(f"draft-{architecture}") / "draft", 0.1, 1
            )
            built[architecture] = (target, draft)
        return built[architecture]

    return models


@pytest.fixture(scope="session")
def other_vocab_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("vocab600"), vocab_size=600, seed=2))

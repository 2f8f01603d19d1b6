"""Finding, building and falling back from llmlab's CPU kernels.

The loader must use an install-time build only if it matches the current source, rebuild
on first use otherwise, and without a compiler leave llmlab running on the torch backend
with a warning that says why.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest
import torch

from llmlab import LLM, SamplingParams
from llmlab.attention import (
    CpuPagedAttention,
    TorchPagedAttention,
    auto_backend,
)
from llmlab.kernels import cpu_kernels
from tests.helpers import subprocess_env

REPO = pathlib.Path(__file__).resolve().parents[2]
needs_compiler = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler")


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """The loader with an empty build cache under ``tmp_path``, and its state restored."""
    monkeypatch.setenv("LLMLAB_CACHE_DIR", str(tmp_path / "cache"))
    cpu_kernels._load.cache_clear()
    yield monkeypatch
    cpu_kernels._load.cache_clear()


def test_without_a_compiler_auto_falls_back_to_torch_with_a_warning(fresh_loader, tiny_llama):
    fresh_loader.setattr(cpu_kernels, "_prebuilt", list)
    fresh_loader.setattr(cpu_kernels, "compiler", lambda: None)
    assert cpu_kernels.load() is None
    assert "no C++ compiler" in cpu_kernels.unavailable_reason()
    with pytest.warns(RuntimeWarning, match="CPU attention kernels are unavailable.*no C\\+\\+"):
        assert type(auto_backend(torch.device("cpu"))) is TorchPagedAttention
    with pytest.warns(RuntimeWarning, match="falling back to the torch attention backend"):
        llm = LLM(tiny_llama, device="cpu", dtype="float32", seed=0)
    assert type(llm.llm_engine.executor.attention) is TorchPagedAttention
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot run: .*compiler"):
        LLM(tiny_llama, device="cpu", attention_backend="cpu")


def test_disabled_by_environment(fresh_loader):
    fresh_loader.setenv("LLMLAB_CPU_KERNELS", "0")
    assert cpu_kernels.load() is None
    assert "LLMLAB_CPU_KERNELS" in cpu_kernels.unavailable_reason()


@pytest.mark.slow  # compiles the kernels twice: 10-30 s on 2 cores
@needs_compiler
def test_a_stale_install_time_build_is_ignored_and_rebuilt(fresh_loader, tmp_path):
    stale = tmp_path / "_cpu_kernels.stale.so"
    subprocess.run(
        [cpu_kernels.compiler(), *cpu_kernels.COMPILE_FLAGS, "-shared",
         '-DLLMLAB_SOURCE_HASH="0123456789abcdef"', str(cpu_kernels.SOURCE), "-o", str(stale)],
        check=True,
    )
    fresh_loader.setattr(cpu_kernels, "_prebuilt", lambda: [stale])
    kernels = cpu_kernels.load()
    assert kernels is not None and kernels.path != stale
    assert kernels.built_from == cpu_kernels.source_hash()
    assert kernels.path.parent == tmp_path / "cache" / "kernels"


@needs_compiler
def test_a_compile_error_is_a_reason_not_a_crash(fresh_loader, tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    fresh_loader.setattr(cpu_kernels, "SOURCE", broken)
    fresh_loader.setattr(cpu_kernels, "_prebuilt", list)
    assert cpu_kernels.load() is None
    assert "building the CPU kernels failed" in cpu_kernels.unavailable_reason()
    assert list((tmp_path / "cache" / "kernels").glob("*.so")) == []  # no half-written file


@pytest.mark.slow
def test_installs_without_a_compiler(tmp_path):
    """Building the package with no working compiler succeeds, without the kernels (the
    extension is optional) but with their source, for a build on first use."""
    env = subprocess_env(CC="false", CXX="false", LDSHARED="false")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(REPO)],
        check=False, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = tmp_path.glob("llmlab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "llmlab/kernels/csrc/cpu_kernels.cpp" in names  # so a later first use can build them
    assert not any(n.startswith("llmlab/_cpu_kernels") for n in names)


def test_the_cpu_backend_is_the_cpu_default_when_the_kernels_load(tiny_llama):
    if cpu_kernels.load() is None:
        pytest.skip(str(cpu_kernels.unavailable_reason()))
    llm = LLM(tiny_llama, device="cpu", dtype="bfloat16")
    assert isinstance(llm.llm_engine.executor.attention, CpuPagedAttention)
    with pytest.raises(ValueError, match="supports dtype float32, bfloat16, not float16"):
        LLM(tiny_llama, device="cpu", dtype="float16", attention_backend="cpu")

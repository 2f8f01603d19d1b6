"""Adapter files are read as untrusted input: only regular files, never blocking (a FIFO
in place of a file), never more than a cap, and one answer for every path that holds no
adapter, which tells nothing about what exists there. Adapter names are bounded."""

from __future__ import annotations

import itertools
import os
import pathlib
import shutil
import threading

import pytest

from llmlab import LLM, LoRARequest
from llmlab.lora.adapter import MAX_CONFIG_BYTES, AdapterNotFoundError, max_weights_bytes

_IDS = itertools.count(1)


@pytest.fixture(scope="module")
def store(tiny_llama):
    return LLM(tiny_llama, dtype="float32", enable_lora=True, max_lora_rank=8).llm_engine.lora


@pytest.fixture
def adapter(tiny_llama, adapter_factory):
    return pathlib.Path(adapter_factory(tiny_llama, "files-base", seed=51))


def load_error(store, path: pathlib.Path, seconds: float = 20.0) -> Exception | None:
    """What loading ``path`` raises (None: it loaded); fails if it takes ``seconds``."""
    got: dict[str, Exception] = {}

    def load():
        try:
            store.get(LoRARequest("probe", next(_IDS), str(path)))
        except Exception as err:  # noqa: BLE001 - returned to the test
            got["error"] = err

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(seconds)
    blocked = thread.is_alive()
    if blocked:  # unblock a reader waiting on a FIFO, so the thread can end
        for fifo in path.glob("*"):
            if fifo.is_fifo():
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not blocked, f"loading {path} blocked for {seconds} s"
    return got.get("error")


def _scenarios(adapter: pathlib.Path):
    """Ways a path can hold no adapter, each set up at the same ``path``."""
    def copy(path):
        shutil.copytree(adapter, path)

    def swap(name, make):
        def setup(path):
            copy(path)
            (path / name).unlink()
            make(path / name)
        return setup

    yield "missing", lambda path: None
    yield "a file", lambda path: path.write_text("{}")
    yield "an empty directory", lambda path: path.mkdir()
    yield "no config", swap("adapter_config.json", lambda p: None)
    yield "config is a FIFO", swap("adapter_config.json", os.mkfifo)
    yield "config is a directory", swap("adapter_config.json", os.mkdir)
    yield "config is a device", swap("adapter_config.json", lambda p: p.symlink_to("/dev/null"))
    yield "no weights", swap("adapter_model.safetensors", lambda p: None)
    yield "weights are a FIFO", swap("adapter_model.safetensors", os.mkfifo)
    if os.geteuid() != 0:  # root reads anything
        def unreadable(p):
            shutil.copy(adapter / "adapter_config.json", p)
            p.chmod(0)
        yield "config unreadable", swap("adapter_config.json", unreadable)


def test_every_path_without_an_adapter_gets_one_answer_at_once(store, adapter, tmp_path):
    messages = {}
    for what, setup in _scenarios(adapter):
        path = tmp_path / "adapter"
        setup(path)
        err = load_error(store, path)
        assert isinstance(err, AdapterNotFoundError), (what, err)
        messages[what] = str(err)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    assert len(set(messages.values())) == 1, messages
    assert "not a readable PEFT adapter directory" in next(iter(messages.values()))


def test_files_past_their_cap_are_refused_without_being_read(store, adapter, tmp_path):
    path = pathlib.Path(shutil.copytree(adapter, tmp_path / "big-config"))
    config = (path / "adapter_config.json").read_text()
    (path / "adapter_config.json").write_text(config + " " * (MAX_CONFIG_BYTES - len(config) + 1))
    err = load_error(store, path)
    assert isinstance(err, ValueError) and "adapter_config.json is more than 1048576" in str(err)
    (path / "adapter_config.json").write_text(config)  # at the cap: fine
    assert load_error(store, path) is None

    path = pathlib.Path(shutil.copytree(adapter, tmp_path / "big-weights"))
    cap = max_weights_bytes(store.targets, store.max_lora_rank)
    with open(path / "adapter_model.safetensors", "r+b") as f:
        f.truncate(cap + 1)  # sparse: nothing is written, and nothing must be read
    err = load_error(store, path)
    assert isinstance(err, ValueError)
    assert f"adapter_model.safetensors is more than {cap} bytes" in str(err)
    assert "max_lora_rank=8" in str(err)


def test_a_config_nested_too_deep_is_not_json(store, adapter, tmp_path):
    path = pathlib.Path(shutil.copytree(adapter, tmp_path / "deep"))
    (path / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    err = load_error(store, path)
    assert isinstance(err, ValueError) and "is not valid JSON" in str(err)


def test_the_largest_adapter_the_model_runs_fits_the_weights_cap(store, adapter, tmp_path):
    """Every module at max_lora_rank, stored in float64: the cap is never why a runnable
    adapter is refused."""
    from safetensors.torch import load_file, save_file

    path = pathlib.Path(shutil.copytree(adapter, tmp_path / "float64"))
    weights = path / "adapter_model.safetensors"
    tensors = {k: t.double() for k, t in load_file(weights).items()}
    assert len(tensors) == 2 * sum(len(t.slices) for t in store.targets.targets)
    assert all(t.shape[0] == store.max_lora_rank for k, t in tensors.items() if "lora_A" in k)
    save_file(tensors, weights)
    assert load_error(store, path) is None


@pytest.mark.parametrize(
    ("name", "match"),
    [("x" * 257, "lora_name is 257 characters long; at most 256"),
     ("a\ud800", "lora_name is not valid Unicode"),
     ("", "lora_name must be a non-empty str")],
    ids=["too-long", "surrogate", "empty"],
)
def test_an_adapter_name_must_be_short_valid_unicode(name, match):
    with pytest.raises(ValueError, match=match):
        LoRARequest(name, 1, "/adapters/a")
    assert LoRARequest("x" * 256, 1, "/adapters/a").lora_name == "x" * 256

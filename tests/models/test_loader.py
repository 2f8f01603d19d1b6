from __future__ import annotations

import json
import pathlib
import types

import huggingface_hub
import pytest
import torch
import transformers
from safetensors.torch import save_file

from llmlab.models import (
    iterate_weights,
    load_model,
    load_tokenizer,
    max_model_len_from_config,
    resolve_dtype,
    resolve_model_path,
)

# ----------------------------------------------------------------------------- dtype


@pytest.mark.parametrize(
    ("requested", "expected"),
    [
        ("float32", torch.float32),
        ("float", torch.float32),
        ("float16", torch.float16),
        ("half", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_resolve_dtype_accepts_names_and_dtypes(requested, expected):
    assert resolve_dtype(requested, types.SimpleNamespace()) is expected


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (types.SimpleNamespace(dtype="bfloat16"), torch.bfloat16),
        (types.SimpleNamespace(dtype=torch.float16), torch.float16),
        (types.SimpleNamespace(torch_dtype="float16"), torch.float16),  # transformers 4.x
        (types.SimpleNamespace(), torch.float32),
        (types.SimpleNamespace(dtype="float64"), torch.float32),
    ],
)
def test_auto_dtype_follows_the_config_or_falls_back_to_float32(config, expected):
    assert resolve_dtype("auto", config) is expected


@pytest.mark.parametrize("bad", ["float8", "int8", "", torch.int32, 16])
def test_resolve_dtype_rejects_unknown_values_by_name(bad):
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype(bad, types.SimpleNamespace())


# ----------------------------------------------------------------------------- max length


def test_max_model_len_reads_each_family_spelling(tiny_model_dirs):
    lengths = {
        name: max_model_len_from_config(transformers.AutoConfig.from_pretrained(path))
        for name, path in tiny_model_dirs.items()
    }
    assert set(lengths.values()) == {512}  # GPT-2 via n_positions, the rest via max_position_*
    assert max_model_len_from_config(types.SimpleNamespace(seq_length=8192)) == 8192


def test_max_model_len_without_any_field_raises():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        max_model_len_from_config(types.SimpleNamespace(hidden_size=8))


# ----------------------------------------------------------------------------- paths


def test_local_directory_is_used_as_is(tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("should not reach the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        resolve_model_path(str(tmp_path / "nope"))


def _fake_hub(monkeypatch, snapshot: pathlib.Path, files_by_pattern: dict[str, str]):
    """Patch snapshot_download to 'download' the files whose pattern was allowed."""
    calls = []

    def snapshot_download(repo_id, *, revision=None, allow_patterns=None, **kwargs):
        calls.append(
            dict(repo_id=repo_id, revision=revision, allow_patterns=allow_patterns, **kwargs)
        )
        for pattern, name in files_by_pattern.items():
            if pattern in allow_patterns:
                (snapshot / name).write_text("x")
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_hub_repo_downloads_safetensors_and_metadata_only(tmp_path, monkeypatch):
    calls = _fake_hub(monkeypatch, tmp_path, {"*.safetensors": "model.safetensors"})
    assert resolve_model_path("org/model", revision="abc123") == tmp_path
    assert len(calls) == 1
    assert calls[0]["repo_id"] == "org/model"
    assert calls[0]["revision"] == "abc123"
    assert {"*.json", "*.safetensors"} <= set(calls[0]["allow_patterns"])
    assert not any(p.endswith(".bin") for p in calls[0]["allow_patterns"])


def test_hub_repo_without_safetensors_falls_back_to_bin(tmp_path, monkeypatch):
    calls = _fake_hub(monkeypatch, tmp_path, {"pytorch_model*.bin": "pytorch_model.bin"})
    assert resolve_model_path("org/old-model") == tmp_path
    assert len(calls) == 2
    assert "pytorch_model*.bin" in calls[1]["allow_patterns"]
    assert (tmp_path / "pytorch_model.bin").exists()


def test_hub_failure_becomes_a_clear_error(monkeypatch):
    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline and not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="'org/model'.*Hugging Face Hub"):
        resolve_model_path("org/model")


# ----------------------------------------------------------------------------- weights


def test_iterate_weights_falls_back_to_pytorch_bin(tmp_path):
    state = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(2)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    loaded = dict(iterate_weights(tmp_path))
    assert loaded.keys() == state.keys()
    torch.testing.assert_close(loaded["a.weight"], state["a.weight"])


def test_iterate_weights_follows_the_shard_index_and_ignores_strays(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(2)}, tmp_path / "model-00002-of-00002.safetensors")
    save_file({"mistral_native": torch.ones(2)}, tmp_path / "consolidated.safetensors")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(name for name, _ in iterate_weights(tmp_path)) == ["a", "b"]


def test_iterate_weights_without_weights_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        list(iterate_weights(tmp_path))


# ----------------------------------------------------------------------------- models


def test_load_model_returns_frozen_eval_model_in_the_requested_dtype(tiny_model_dirs):
    path = tiny_model_dirs["qwen3"]
    model = load_model(path, transformers.AutoConfig.from_pretrained(path), torch.float16, "cpu")
    assert not model.training
    assert all(p.dtype == torch.float16 and not p.requires_grad for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert torch.get_default_dtype() == torch.float32  # construction did not leak the dtype


def test_load_model_rejects_an_unsupported_architecture(tiny_model_dirs):
    config = transformers.AutoConfig.from_pretrained(tiny_model_dirs["llama"])
    config.architectures = ["FalconForCausalLM"]
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        load_model(tiny_model_dirs["llama"], config, torch.float32, "cpu")


def test_load_tokenizer_round_trips_text(tiny_model_dirs):
    tokenizer = load_tokenizer(tiny_model_dirs["mistral"])
    ids = tokenizer("The river was cold.").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The river was cold."


def test_the_built_in_models_resolve_by_the_names_the_server_gives_them(tmp_path, monkeypatch):
    from llmlab.builtin import builtin_model_path
    from llmlab.models.loader import resolve_model_path

    monkeypatch.chdir(tmp_path)  # no folder of that name here: the shipped model
    assert resolve_model_path("llmlab-stories") == builtin_model_path()
    assert resolve_model_path("llmlab-stories-draft") == builtin_model_path(draft=True)
    (tmp_path / "llmlab-stories").mkdir()  # a local folder of that name comes first
    assert resolve_model_path("llmlab-stories").resolve() == tmp_path / "llmlab-stories"

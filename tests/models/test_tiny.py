from __future__ import annotations

import hashlib
import json

import pytest
import transformers

from llmlab.builtin import builtin_model_path, ensure_builtin_model
from llmlab.models import load_tokenizer
from llmlab.testing import TINY_ARCHITECTURES, build_tiny_model


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_every_supported_architecture_has_a_tiny_recipe(tiny_model_dirs):
    built = {
        json.loads((path / "config.json").read_text())["architectures"][0]
        for path in tiny_model_dirs.values()
    }
    assert built == set(TINY_ARCHITECTURES)


def test_same_seed_gives_identical_files_and_another_seed_does_not(tmp_path):
    first = build_tiny_model(tmp_path / "a", "GPT2LMHeadModel", seed=3)
    second = build_tiny_model(tmp_path / "b", "GPT2LMHeadModel", seed=3)
    other = build_tiny_model(tmp_path / "c", "GPT2LMHeadModel", seed=4)
    assert _digest(first) == _digest(second) != _digest(other)
    tokenizer_json = [(p / "tokenizer.json").read_text() for p in (first, second)]
    assert tokenizer_json[0] == tokenizer_json[1]


@pytest.mark.parametrize("variant", ["llama", "qwen2", "gpt2", "opt"])
def test_tokenizer_ids_fit_the_model_and_match_the_config(variant, tiny_model_dirs):
    path = tiny_model_dirs[variant]
    config = transformers.AutoConfig.from_pretrained(path)
    tokenizer = load_tokenizer(path)
    # Qwen2 is the trap: transformers 5 swaps in Qwen2Tokenizer, which adds its own
    # <|endoftext|> unless pad/unk are named.
    assert len(tokenizer) == config.vocab_size == 512
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    special_ids = (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert special_ids == (config.bos_token_id, config.eos_token_id)
    generation = transformers.GenerationConfig.from_pretrained(path)
    assert generation.eos_token_id == tokenizer.eos_token_id
    assert not generation.do_sample


def test_config_overrides_reach_the_checkpoint(tmp_path):
    path = build_tiny_model(tmp_path / "m", "Qwen3ForCausalLM", vocab_size=300, num_hidden_layers=3)
    config = transformers.AutoConfig.from_pretrained(path)
    assert (config.num_hidden_layers, config.vocab_size, config.head_dim) == (3, 300, 32)


def test_unknown_architecture_and_tiny_vocab_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="FalconForCausalLM.*LlamaForCausalLM"):
        build_tiny_model(tmp_path / "x", "FalconForCausalLM")
    with pytest.raises(ValueError, match="vocab_size must be at least 258"):
        build_tiny_model(tmp_path / "y", vocab_size=100)


def test_builtin_model_is_the_shipped_trained_one_and_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = ensure_builtin_model()
    assert path == builtin_model_path()
    config = transformers.AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (256, 4, 1536)
    assert len(load_tokenizer(path)) == config.vocab_size
    assert list(tmp_path.iterdir()) == []  # nothing built in the cache

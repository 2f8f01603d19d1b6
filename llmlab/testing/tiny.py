"""Tiny random-weight checkpoints in real Hugging Face format, built offline.

Tests, examples and the simulator need a model that loads through exactly the same path as
a downloaded one (config.json, model.safetensors, tokenizer.json) but builds in a second
with no network. :func:`build_tiny_model` writes one for any supported architecture. The
built-in demo model that :func:`llmlab.builtin.ensure_builtin_model` returns is different:
trained, and shipped in :mod:`llmlab.builtin` (whose tokenizer comes from the helpers here).

Weights are redrawn after ``transformers`` initialises the model, because HF init sets
norms to 1 and biases to 0, which would let a loader that drops or misplaces them pass
every comparison. Scales are chosen so activations and logits are O(1).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from collections.abc import Iterable

import torch

from llmlab.testing.tiny_corpus import corpus_lines

BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
# A minimal chat format so chat endpoints work; no special tokens, so it composes with the
# tokenizer adding <s> itself.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

_SHARED_LLAMA_STYLE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}

# Each default exercises something a real checkpoint of that family does.
_TINY_DEFAULTS: dict[str, dict] = {
    # Llama 3.x-style frequency scaling, untied head.
    "LlamaForCausalLM": dict(
        _SHARED_LLAMA_STYLE,
        tie_word_embeddings=False,
        rope={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),
    # Sliding window shorter than a typical test prompt.
    "MistralForCausalLM": dict(_SHARED_LLAMA_STYLE, sliding_window=24, tie_word_embeddings=False),
    # q/k/v bias, tied head, and a window on the second layer only.
    "Qwen2ForCausalLM": dict(
        _SHARED_LLAMA_STYLE,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=24,
        max_window_layers=1,
    ),
    # head_dim (32) that is not hidden / heads (16), q/k norms, tied head.
    "Qwen3ForCausalLM": dict(_SHARED_LLAMA_STYLE, head_dim=32, tie_word_embeddings=True),
    "GPT2LMHeadModel": {
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 512,
        "scale_attn_by_inverse_layer_idx": True,
        "tie_word_embeddings": True,
    },
    # opt-350m's shape: projected embeddings and post-norm blocks.
    "OPTForCausalLM": {
        "hidden_size": 64,
        "ffn_dim": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "word_embed_proj_dim": 32,
        "do_layer_norm_before": False,
        "tie_word_embeddings": True,
    },
    # Mixture of experts: 4 experts, 2 per token, a window as Mixtral v0.1 has.
    "MixtralForCausalLM": dict(
        _SHARED_LLAMA_STYLE, num_local_experts=4, num_experts_per_tok=2, sliding_window=24,
        tie_word_embeddings=False,
    ),
    # Qwen3's attention; experts narrower than the dense MLP the second layer keeps
    # (mlp_only_layers); the picked probabilities not renormalised (norm_topk_prob).
    "Qwen3MoeForCausalLM": dict(
        _SHARED_LLAMA_STYLE, head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False,
        tie_word_embeddings=False,
    ),
    # q/k normalised across all heads, q/k/v clamped, renormalised picks.
    "OlmoeForCausalLM": dict(
        _SHARED_LLAMA_STYLE, num_experts=4, num_experts_per_tok=2, clip_qkv=1.5,
        norm_topk_prob=True, tie_word_embeddings=False,
    ),
}

TINY_ARCHITECTURES = tuple(_TINY_DEFAULTS)

# Sequence classifiers (pooling models, runner="pooling"): the causal LM's recipe with a
# score head of ``num_labels`` (3 unless overridden; 1 makes a cross-encoder).
TINY_CLASSIFIER_ARCHITECTURES = tuple(
    f"{family}ForSequenceClassification" for family in ("Llama", "Mistral", "Qwen2", "Qwen3")
)
for _name in TINY_CLASSIFIER_ARCHITECTURES:
    _TINY_DEFAULTS[_name] = dict(
        _TINY_DEFAULTS[_name.replace("ForSequenceClassification", "ForCausalLM")], num_labels=3
    )

_CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "GPT2LMHeadModel": "GPT2Config",
    "OPTForCausalLM": "OPTConfig",
    "MixtralForCausalLM": "MixtralConfig",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
    "OlmoeForCausalLM": "OlmoeConfig",
    "LlamaForSequenceClassification": "LlamaConfig",
    "MistralForSequenceClassification": "MistralConfig",
    "Qwen2ForSequenceClassification": "Qwen2Config",
    "Qwen3ForSequenceClassification": "Qwen3Config",
}


def train_bpe_tokenizer(lines: Iterable[str], vocab_size: int) -> str:
    """A byte-level BPE with ``<s>``/``</s>`` trained on ``lines``, as tokenizer JSON.

    Encoding adds ``<s>`` in front (as Llama tokenizers do); ``</s>`` is left to the caller.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer.to_str()


def hf_tokenizer(tokenizer_json: str, max_length: int):
    """A ``PreTrainedTokenizerFast`` around ``tokenizer_json`` with llmlab's chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        # Named explicitly because transformers 5 forces its own Qwen2Tokenizer class on
        # qwen2 checkpoints, which otherwise adds an <|endoftext|> pad/unk token at id
        # vocab_size: one past the model's embedding table.
        pad_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        model_max_length=max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(tokenizer, path: str | os.PathLike) -> None:
    """``save_pretrained`` in a form both transformers 4.x and 5 load."""
    out = pathlib.Path(path)
    tokenizer.save_pretrained(out)
    # transformers 5 records its new "TokenizersBackend" class, which 4.x cannot load;
    # "PreTrainedTokenizerFast" means the same thing to both.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """The tiny models' tokenizer, trained on the built-in corpus (cached per size)."""
    return train_bpe_tokenizer(corpus_lines(), vocab_size)


def _build_tokenizer(vocab_size: int, max_length: int):
    # The byte alphabet plus the two specials is the smallest vocab that can encode text.
    min_vocab = 256 + 2
    if vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size must be at least {min_vocab} for a byte-level BPE, got {vocab_size}"
        )
    return hf_tokenizer(_trained_tokenizer_json(vocab_size), max_length)


def _config_kwargs(architecture: str, config_cls: type, overrides: dict) -> dict:
    kwargs = {**_TINY_DEFAULTS[architecture], **overrides}
    rope = kwargs.pop("rope", None)
    if rope is not None:
        # transformers >= 5 takes one rope_parameters dict; 4.x a theta plus rope_scaling.
        if "rope_parameters" in config_cls().to_dict():
            kwargs["rope_parameters"] = dict(rope)
        else:
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            kwargs["rope_theta"] = rope.get("rope_theta", 10000.0)
            is_default = scaling.get("rope_type", "default") == "default"
            kwargs["rope_scaling"] = None if is_default else scaling
    return kwargs


def _redraw_weights(model: torch.nn.Module, hidden_size: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    std = hidden_size**-0.5
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() >= 2:
                param.copy_(noise * std)
            elif name.endswith("bias"):
                param.copy_(noise * 0.1)
            else:  # norm scales
                param.copy_(1.0 + noise * 0.1)


def build_tiny_model(
    path: str | os.PathLike,
    architecture: str = "LlamaForCausalLM",
    *,
    vocab_size: int = 512,
    seed: int = 0,
    **config_overrides: object,
) -> pathlib.Path:
    """Write a tiny random-weight HF checkpoint plus tokenizer to ``path``; return it.

    ``config_overrides`` are passed to the architecture's ``transformers`` config class
    (so use its own field names, e.g. ``n_embd`` for GPT-2); ``rope`` is a shorthand for
    the rope settings in either transformers spelling. The result depends only on the
    arguments.

    The built-in corpus supports a tokenizer of about 2,200 entries; a larger
    ``vocab_size`` leaves the extra embedding rows unused, as padded vocabularies do in
    real checkpoints.
    """
    if architecture not in _TINY_DEFAULTS:
        raise ValueError(
            f"no tiny recipe for {architecture!r}; available: {', '.join(_TINY_DEFAULTS)}"
        )
    import transformers

    config_cls = getattr(transformers, _CONFIG_CLASSES[architecture])
    kwargs = _config_kwargs(architecture, config_cls, config_overrides)
    config = config_cls(
        vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=None, **kwargs
    )
    config.architectures = [architecture]
    model_cls = getattr(transformers, architecture)
    torch_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(torch_state)
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    _redraw_weights(model, hidden, seed)
    model.generation_config = transformers.GenerationConfig(bos_token_id=0, eos_token_id=1)

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    max_len = getattr(config, "max_position_embeddings", None) or config.n_positions
    tokenizer = _build_tokenizer(vocab_size, max_len)
    if tokenizer.bos_token_id != 0 or tokenizer.eos_token_id != 1:
        raise AssertionError("tokenizer special-token ids drifted from the config's")
    save_tokenizer(tokenizer, out)
    return out

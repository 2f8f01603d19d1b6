"""Model implementations, the architecture registry, and checkpoint loading."""

from llmlab.models.base import CausalLM, KVLayout
from llmlab.models.gpt2 import GPT2LMHeadModel
from llmlab.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from llmlab.models.loader import (
    iterate_weights,
    load_model,
    load_tokenizer,
    max_model_len_from_config,
    resolve_dtype,
    resolve_model_path,
)
from llmlab.models.opt import OPTForCausalLM
from llmlab.models.registry import MODEL_REGISTRY, get_model_class, register_model

__all__ = [
    "MODEL_REGISTRY",
    "CausalLM",
    "GPT2LMHeadModel",
    "KVLayout",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "OPTForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
    "iterate_weights",
    "load_model",
    "load_tokenizer",
    "max_model_len_from_config",
    "register_model",
    "resolve_dtype",
    "resolve_model_path",
]

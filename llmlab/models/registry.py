"""Which class implements each Hugging Face architecture name.

``config.json`` names its class in ``architectures`` (e.g. ``["LlamaForCausalLM"]``); we
look that name up here. Researchers add their own with :func:`register_model`.
"""

from __future__ import annotations

from llmlab import registry
from llmlab.models.gpt2 import GPT2LMHeadModel
from llmlab.models.llama import (
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    MistralForCausalLM,
    MistralForSequenceClassification,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
)
from llmlab.models.moe import MixtralForCausalLM, OlmoeForCausalLM, Qwen3MoeForCausalLM
from llmlab.models.opt import OPTForCausalLM

# The "model" kind of the one component registry (llmlab.registry): architecture -> class.
MODEL_REGISTRY: dict[str, type] = registry.table("model")
MODEL_REGISTRY.update({
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "OPTForCausalLM": OPTForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    # Pooling models (runner="pooling"): a classifier head instead of the LM head.
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "MistralForSequenceClassification": MistralForSequenceClassification,
    "Qwen2ForSequenceClassification": Qwen2ForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
})


def register_model(name: str, cls: type) -> None:
    """Make ``cls`` the implementation of architecture ``name`` (replacing any other).

    ``cls`` must follow :class:`llmlab.models.base.CausalLM`; its methods are checked
    against the model contract (``registry.CONTRACTS["model"]``) here, so a class with a
    missing method or the wrong call shape is refused with the expected signature.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"architecture name must be a non-empty str, got {name!r}")
    if not isinstance(cls, type):
        message = f"register_model({name!r}, ...) needs a class, got {cls!r}"
        raise ValueError(message)  # noqa: TRY004 (house style: bad arguments are ValueErrors)
    registry.check("model", cls)
    MODEL_REGISTRY[name] = cls


def get_model_class(architectures: list[str] | None) -> type:
    """The class for the first of ``architectures`` that is registered."""
    for name in architectures or []:
        cls = MODEL_REGISTRY.get(name)
        if cls is not None:
            return cls
    raise ValueError(
        f"no supported architecture among {architectures!r} (from config.json "
        f"'architectures'); supported: {', '.join(sorted(MODEL_REGISTRY))}. "
        "Add one with llmlab.models.register_model(name, cls)."
    )

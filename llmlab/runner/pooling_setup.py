"""Which runner an engine is, and for a pooling engine its tasks, pooler and defaults.

Decided once, when the engine is built, from the config (``runner``, vLLM's older
``task``, ``pooler_config``), the checkpoint's architecture (a ``*ForSequenceClassification``
class has a classifier head and no LM head) and its sentence-transformers files. A
combination that cannot run is a ``ValueError`` naming the setting, before any weights load.
"""

from __future__ import annotations

from typing import Any

from llmlab import registry
from llmlab.config import EngineConfig
from llmlab.models.registry import get_model_class
from llmlab.pooling.pooler import pooler_config_from_checkpoint
from llmlab.pooling.task import PoolingSpec


def pooling_spec(cfg: EngineConfig, hf_config: Any, model_path: str) -> PoolingSpec | None:
    """The pooling engine's :class:`PoolingSpec`, or None for a generating engine."""
    architectures = getattr(hf_config, "architectures", None) or []
    cls = get_model_class(architectures)
    arch = architectures[0] if architectures else cls.__name__
    classifies = getattr(cls, "pooling_task", None) == "classify"
    runner = cfg.runner_type
    if runner == "auto":
        runner = "pooling" if classifies else "generate"
    if runner == "generate":
        if classifies:
            raise ValueError(
                f"{arch} is a pooling model (a classifier head, no LM head): it cannot "
                "generate; build it with runner='pooling' (or 'auto')"
            )
        return None
    if cfg.speculative_config is not None:
        raise ValueError(
            "speculative_config applies to generation only; runner='pooling' runs each "
            "prompt once (prefill) and samples nothing"
        )
    task = cfg.task
    if classifies:
        num_labels = int(getattr(hf_config, "num_labels", 0) or 0)
        if task in ("embed", "embedding"):
            raise ValueError(
                f"task={task!r}: {arch} is a classifier (allowed: 'classify', 'score' for "
                "one label, 'reward', 'auto')"
            )
        if task == "score" and num_labels != 1:
            raise ValueError(
                f"task='score' needs a cross-encoder (num_labels=1); {arch} has "
                f"num_labels={num_labels}"
            )
        tasks = ("classify", "score") if num_labels == 1 else ("classify",)
        default_task = "classify"
    else:
        if task in ("classify", "score"):
            raise ValueError(
                f"task={task!r} needs a classifier head (a *ForSequenceClassification "
                f"checkpoint); {arch} embeds: use task='embed' (LLM.score then compares "
                "embeddings by cosine similarity)"
            )
        num_labels = 0
        tasks = ("embed",)
        default_task = "embed"
    config = pooler_config_from_checkpoint(model_path).merged(
        cfg.pooler_config or cfg.override_pooler_config
    )
    pooling_type = config.pooling_type or "last"
    pooler = registry.create("pooler", pooling_type)
    registry.check("pooler", pooler)
    uses_all = getattr(pooler, "uses_all_positions", None)
    if not isinstance(uses_all, bool):
        raise TypeError(
            f"pooler {pooling_type!r} must say whether it reads every prompt position: a "
            f"bool attribute uses_all_positions, got {uses_all!r}"
        )
    return PoolingSpec(
        tasks=tasks,
        default_task=default_task,
        hidden_size=int(hf_config.hidden_size),
        num_labels=num_labels,
        pooling_type=pooling_type,
        uses_all_positions=uses_all,
        normalize=True if config.normalize is None else config.normalize,
        use_activation=True if config.use_activation is None else config.use_activation,
    )

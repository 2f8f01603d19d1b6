"""``sim_engine``: an :class:`~llmlab.engine.engine.Engine` whose executor is a cost model.

It takes ``LLM``'s keywords (every :class:`~llmlab.config.EngineConfig` field and the
scheduling and eviction policies) and builds the same scheduler and KV cache manager the
real engine would (:func:`~llmlab.engine.assembly.scheduler_for`, with the same defaults:
token budget, block count), reading only the model's ``config.json``: no weights, no
tokenizer, no device. Time is a :class:`~llmlab.runner.executor.VirtualClock`.

    engine = sim_engine("path/to/model", cost_model=ProfiledCostModel.fit(recording),
                        num_gpu_blocks_override=4096, scheduling_policy="priority")

Simulated requests are token ids (no tokenizer) and end at their ``max_tokens`` (the
engine has no EOS token); logprobs are not computed (0.0 placeholders).

Overlapped scheduling (``async_scheduling``) is priced, not run: the simulated engine steps
synchronously (its config reads ``async_scheduling=False``), and its cost model prices each
step as the engine modelled would run it (:func:`~llmlab.sim.cost_model.with_overlap`:
``async_scheduling`` resolved as the real engine resolves it, on for a GPU preset unless
False, off on ``this_machine``; ``engine.executor.cost_model.overlap`` says which).
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from llmlab import registry
from llmlab.config import EngineConfig
from llmlab.dtypes import dtype_from_name
from llmlab.engine.engine import Engine
from llmlab.runner.executor import VirtualClock
from llmlab.sim.cost_model import CostModel, with_overlap
from llmlab.sim.executor import SimulatedExecutor
from llmlab.sim.roofline import (
    THIS_MACHINE,
    Hardware,
    ModelShape,
    RooflineCostModel,
)
from llmlab.sim.roofline import hardware as lookup_hardware

COMPONENT_KEYS = ("scheduling_policy", "eviction_policy")
SIM_KEYS = ("cost_model", "hardware", "clock")
"""Keywords of :func:`sim_engine` besides ``EngineConfig``'s fields and the components."""



def sim_engine(
    model: str | os.PathLike | ModelShape | None = None,
    *,
    cost_model: CostModel | str = "roofline",
    hardware: Hardware | str = "this_machine",  # noqa: A002 - the natural name
    clock: VirtualClock | None = None,
    scheduling_policy: Any = None,
    eviction_policy: Any = None,
    **settings: Any,
) -> Engine:
    """A simulated engine of ``model`` (a model directory, hub id, ``ModelShape``, or None
    for the built-in model).

    Args:
        cost_model: a :class:`~llmlab.sim.cost_model.CostModel`, or ``"roofline"`` for
            :class:`~llmlab.sim.roofline.RooflineCostModel` of this model on ``hardware``.
            One with ``overlap=None`` prices overlapped steps when ``async_scheduling``
            resolves on (see the module).
        hardware: a preset name (``"h100_sxm"``, ``"h200"``, ``"a100_80gb"``, ``"l4"``,
            ``"this_machine"``) or a :class:`~llmlab.sim.roofline.Hardware`: the roofline's
            rates, and the memory the KV cache is sized from on a GPU preset.
        clock: the virtual clock (a fresh one at 0 by default).
        settings: ``LLM``'s keywords (``max_num_seqs``, ``block_size``,
            ``num_gpu_blocks_override``, ``enable_prefix_caching``, ``speculative_config``
            with ``"method": "synthetic"``, ``async_scheduling``, ...).

    Raises ``ValueError`` naming the setting for anything the real engine would refuse, an
    unknown keyword, and a speculative method other than ``synthetic`` (the simulator has
    no drafter: it accepts drafts at the given per-position rates).
    """
    from llmlab.engine.assembly import (
        CONFIG_FIELDS,
        component,
        engine_fields,
        resolve_step_settings,
        scheduler_for,
    )

    unknown = sorted(set(settings) - set(CONFIG_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown simulated-engine argument(s) {unknown}; allowed: "
            f"{', '.join(CONFIG_FIELDS + COMPONENT_KEYS + SIM_KEYS)}"
        )
    shape, name, max_len = _model(model)
    cfg = EngineConfig(model=name, skip_tokenizer_init=True, **settings)
    _refuse_unmodelled(cfg)
    if max_len is None and cfg.max_model_len is None:
        raise ValueError("a ModelShape has no context limit: pass max_model_len")
    max_model_len = max_len if cfg.max_model_len is None else cfg.max_model_len
    if max_len is not None and max_model_len > max_len:
        raise ValueError(
            f"max_model_len={cfg.max_model_len} exceeds the model's limit of {max_len} positions"
        )
    # "this_machine" is measured (about a second): only when something reads it.
    hw = None if hardware == THIS_MACHINE else lookup_hardware(hardware)
    on_gpu = hw is not None and hw.memory_bytes is not None
    device_type = "cuda" if on_gpu else "cpu"
    cfg = resolve_step_settings(cfg, device_type, max_model_len)
    # "auto": what the real engine would pick, bfloat16 on a GPU and float32 on a CPU.
    dtype = dtype_from_name(cfg.dtype)
    dtype_bytes = dtype.itemsize if dtype is not None else 2 if on_gpu else 4
    policy = component("scheduling_policy", scheduling_policy)
    eviction = component("eviction_policy", eviction_policy)
    num_blocks = _num_blocks(cfg, shape, max_model_len, hw, on_gpu, dtype_bytes)
    clock = clock if clock is not None else VirtualClock()
    if isinstance(cost_model, str):
        if cost_model != "roofline":
            raise ValueError(
                f"cost_model={cost_model!r}; give a CostModel instance (e.g. "
                "ProfiledCostModel.fit(recording)) or 'roofline'"
            )
        cost_model = RooflineCostModel(shape, hw or lookup_hardware(hardware),
                                       dtype_bytes=dtype_bytes)
    # The overlap is the cost model's to price; the engine itself steps synchronously (its
    # executor cannot plan ahead: Engine would refuse async_scheduling=True).
    cost_model = with_overlap(cost_model, cfg.async_scheduling, device_type)
    cfg = attrs.evolve(cfg, async_scheduling=False)
    acceptance = None
    length = None
    if cfg.speculative_config is not None:
        spec = cfg.speculative_config
        if spec.method != "synthetic":
            raise ValueError(
                f"speculative_config method {spec.method!r} needs a drafter; the simulator "
                "accepts drafts at given rates: use {'method': 'synthetic', "
                "'synthetic_acceptance_rates': [...]}"
            )
        acceptance = spec.build_proposer()
        length = spec.length_policy()
    given = [("scheduling_policy", scheduling_policy), ("eviction_policy", eviction_policy)]
    registry.check_unclaimed(given)  # an instance keeps the engine it joined's state
    scheduler = scheduler_for(cfg, num_blocks, max_model_len, policy, eviction,
                              speculation=length)
    executor = SimulatedExecutor(cost_model, clock, shape.vocab_size, acceptance)
    engine = Engine(**engine_fields(
        cfg, scheduler, executor, length, tokenizer=None, vocab_size=shape.vocab_size,
        max_model_len=max_model_len, eos_token_ids=frozenset(), clock=clock,
    ))
    registry.claim(given)
    return engine


def _model(model: Any) -> tuple[ModelShape, str, int | None]:
    """The model's shape, the name the config keeps, and its longest context (None: not
    known from a bare ``ModelShape``)."""
    if isinstance(model, ModelShape):
        return model, "simulated", None
    if model is None:
        from llmlab.builtin import builtin_model_path

        model = builtin_model_path()
    from llmlab.models.loader import max_model_len_from_config, resolve_model_path

    path = resolve_model_path(str(model))
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    return ModelShape.from_hf_config(hf_config), str(model), max_model_len_from_config(hf_config)


def _num_blocks(cfg, shape: ModelShape, max_model_len: int, hw: Hardware | None, on_gpu: bool,
                dtype_bytes: int) -> int:
    """KV blocks as the real engine sizes them: the override, the byte budget, else on a
    GPU preset ``gpu_memory_utilization`` of its memory less the weights, else the CPU
    default (room for every sequence at full length, capped at 4 GiB)."""
    from llmlab.cache.kv_tensors import CPU_DEFAULT_KV_CAP_BYTES

    per_block = cfg.block_size * shape.kv_bytes_per_token(dtype_bytes)
    if cfg.num_gpu_blocks_override is not None:
        num_blocks, source = cfg.num_gpu_blocks_override, "num_gpu_blocks_override"
    elif cfg.kv_cache_memory_bytes is not None:
        num_blocks, source = cfg.kv_cache_memory_bytes // per_block, "kv_cache_memory_bytes"
    elif on_gpu:
        weights = shape.num_parameters() * dtype_bytes
        budget = int(hw.memory_bytes * cfg.gpu_memory_utilization) - weights
        num_blocks, source = max(budget, 0) // per_block, f"{hw.name}'s memory"
    else:
        wanted = -(-max_model_len // cfg.block_size) * cfg.max_num_seqs * per_block
        num_blocks = min(wanted, max(CPU_DEFAULT_KV_CAP_BYTES, per_block)) // per_block
        source = "the CPU default"
    needed = -(-max_model_len // cfg.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"KV cache from {source} holds {num_blocks} blocks of {cfg.block_size} tokens, "
            f"but one sequence of max_model_len={max_model_len} needs {needed}; raise it or "
            "lower max_model_len"
        )
    return int(num_blocks)


def _refuse_unmodelled(cfg: EngineConfig) -> None:
    """``ValueError`` naming a setting the simulator would otherwise ignore silently: its
    cost model prices neither adapters nor quantized weights, and its executor moves no KV
    between tiers (it has no host pools), scores no tokens for a KV press and routes no
    token to an expert (the roofline prices experts from ``ExpertRouting`` instead)."""
    unmodelled = {
        "enable_lora": cfg.enable_lora,
        "quantization": cfg.quantization is not None,
        "preemption_mode": cfg.preemption_mode == "swap",
        "kv_offloading_size": bool(cfg.kv_offloading_size),
        "kv_press": cfg.kv_press is not None,
        "record_expert_load": cfg.record_expert_load,
    }
    named = [f"{field}={getattr(cfg, field)!r}" for field, on in unmodelled.items() if on]
    if named:
        raise ValueError(
            f"the simulator does not model {', '.join(named)} (no LoRA or quantized-weight "
            "costs, no host KV pools, no KV press compaction, no routed tokens to count); "
            "leave them at their defaults in sim_engine"
        )


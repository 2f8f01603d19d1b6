"""``LLM``: the offline batch-generation class, with vLLM's constructor and ``generate``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import attrs

from llmlab.config import EngineConfig
from llmlab.engine.builder import EngineBuilder
from llmlab.engine.engine import Engine, PromptType
from llmlab.engine.outputs import RequestOutput
from llmlab.sampling.params import RequestOutputKind, SamplingParams

_CONFIG_FIELDS = tuple(f.name for f in attrs.fields(EngineConfig))


class LLM:
    """Generate text for batches of prompts with a continuous-batching paged-KV engine.

    ``LLM(model, tokenizer=None, **settings)`` takes every :class:`EngineConfig` field as a
    keyword (``dtype``, ``seed``, ``max_model_len``, ``block_size``,
    ``enable_prefix_caching``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``kv_cache_memory_bytes``, ...), plus component instances to swap in:
    ``scheduling_policy``, ``eviction_policy``, ``attention_backend``, ``sampler``.
    """

    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        *,
        scheduling_policy: Any = None,
        eviction_policy: Any = None,
        attention_backend: Any = None,
        sampler: Any = None,
        **settings: Any,
    ) -> None:
        unknown = sorted(set(settings) - set(_CONFIG_FIELDS))
        if unknown:
            raise ValueError(
                f"unknown LLM argument(s) {unknown}; allowed: {', '.join(_CONFIG_FIELDS)}, "
                "scheduling_policy, eviction_policy, attention_backend, sampler"
            )
        config = EngineConfig(model=model, tokenizer=tokenizer, **settings)
        builder = EngineBuilder(
            config,
            scheduling_policy=scheduling_policy,
            eviction_policy=eviction_policy,
            attention_backend=attention_backend,
            sampler=sampler,
        )
        self.llm_engine: Engine = builder.build()
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """Wrap an engine built elsewhere (e.g. by an ``EngineBuilder``)."""
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions; returns one ``RequestOutput`` per prompt, in input order.

        ``prompts``: a string, ``{"prompt_token_ids": [...]}`` (or ``{"prompt": str}``), or a
        list of those. ``sampling_params``: one for all prompts or one per prompt.
        All prompts are validated before any is queued: on ``ValueError`` nothing runs.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        engine = self.llm_engine
        ids = [str(next(self._ids)) for _ in prompt_list]
        try:
            for request_id, prompt, params in zip(ids, prompt_list, params_list, strict=True):
                final_only = attrs.evolve(params, output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(request_id, prompt, final_only)
            return self._run(ids, use_tqdm)
        finally:
            # After an error or an interrupt, leave the engine empty and its blocks free.
            engine.abort_request(ids)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        num_output_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        num_output_tokens += len(out.outputs[0].token_ids)
                        if bar is not None:
                            bar.update(1)
                            rate = num_output_tokens / max(bar.format_dict["elapsed"], 1e-9)
                            bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence):
        if prompts and all(isinstance(p, int) for p in prompts):
            raise ValueError(
                "a bare list of ints is ambiguous; pass {'prompt_token_ids': [...]} for a "
                "tokenized prompt"
            )
        return list(prompts)
    raise ValueError(f"prompts must be a str, a dict or a list of them, got {type(prompts)}")


def _as_params_list(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(
            f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt"
        )
    return params

"""``LLM``: the offline batch-generation class, with vLLM's constructor and ``generate``."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from llmlab.distributed.data_parallel import DataParallelEngine
from llmlab.engine.client import EngineClient
from llmlab.engine.engine import Engine
from llmlab.entrypoints.engines import build_engine
from llmlab.engine.inputs import PromptType, render_chat
from llmlab.observe.metrics_reader import EngineCounters, Metric, collect
from llmlab.engine.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from llmlab.lora.request import LoRARequest
from llmlab.pooling_params import PoolingParams
from llmlab.sampling.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    beam_search,
    candidates_per_beam,
)
from llmlab.sampling.params import RequestOutputKind, SamplingParams
from llmlab.speculative.stats import SpecDecodeStats

logger = logging.getLogger(__name__)

class LLM:
    """Generate text for batches of prompts with a continuous-batching paged-KV engine.

    ``LLM(model, tokenizer=None, **settings)`` takes every :class:`EngineConfig` field as a
    keyword (``dtype``, ``seed``, ``max_model_len``, ``block_size``,
    ``enable_prefix_caching``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``kv_cache_memory_bytes``, ...), and every component kind the one way
    (docs/components.md): ``<kind>=`` a registered name, ``"package.module:Class"`` or an
    instance, and ``<kind>_config=`` a dict of keyword arguments for the named class's
    constructor (refused with an instance). The kinds: ``scheduling_policy``,
    ``eviction_policy``, ``attention_backend``, ``sampler``, ``kv_press``, ``proposer``
    (speculative decoding's drafter: the same setting as ``speculative_config``'s
    ``method``), ``router`` (with ``data_parallel_size > 1``), ``pooler`` (the
    ``pooler_config``'s ``pooling_type``; ``pooler_config`` keeps vLLM's meaning), and
    ``plugins=[...]`` (feature plugins; ``plugin_config={entry: {...}}`` configures the
    named ones). A tool parser is the server's (``llmlab serve --tool-call-parser``). Names
    stay in ``llm_engine.config``; instances are held by the engine builder.

    With ``disable_log_stats=False`` (vLLM's switch; off by default, as in vLLM, so a
    plain ``LLM`` adds no step observer), ``spec_decode_stats`` (a
    :class:`~llmlab.speculative.stats.SpecDecodeStats`) counts speculative decoding's
    drafts and acceptance from construction on, and :meth:`get_metrics` reports it with
    the token and request totals; otherwise ``spec_decode_stats`` is None.

    ``llm_engine`` is the :class:`~llmlab.engine.client.EngineClient` it drives: an
    :class:`~llmlab.engine.engine.Engine`, or with ``data_parallel_size=N > 1`` a
    :class:`~llmlab.distributed.data_parallel.DataParallelEngine`: N replicas of the
    engine in N processes, each request sent whole to one of them by ``router`` (a
    registered name such as ``"round_robin"`` (the default), ``"least_loaded"``,
    ``"prefix_aware"``, ``"session_affinity"``, or an instance); ``generate`` and ``chat``
    work unchanged and return outputs in prompt order. Component instances are then
    pickled to each replica, so they must be picklable. ``router`` is unused at N == 1.
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
        kv_press: Any = None,
        proposer: Any = None,
        router: Any = None,
        pooler: Any = None,
        plugins: Any = (),
        **settings: Any,
    ) -> None:
        components = dict(
            scheduling_policy=scheduling_policy, eviction_policy=eviction_policy,
            attention_backend=attention_backend, sampler=sampler, kv_press=kv_press,
            proposer=proposer, router=router, pooler=pooler, plugins=plugins,
        )
        # Only what was given: a keyword left out keeps the config's default.
        given = {k: v for k, v in components.items() if v is not None}
        if not plugins:
            given.pop("plugins")
        self.llm_engine: EngineClient = build_engine(model, tokenizer, **given, **settings)
        self._init_state()

    @classmethod
    def from_engine(cls, engine: EngineClient) -> LLM:
        """Wrap an engine built elsewhere (e.g. by an ``EngineBuilder``)."""
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        llm._init_state()
        return llm

    def _init_state(self) -> None:
        self._ids = itertools.count()
        # One generate() at a time: a second thread waits for the first to finish rather
        # than interleaving requests and steps with it.
        self._lock = threading.Lock()
        self._profiler: Any = None
        self._profiler_dir: str | None = None
        self.spec_decode_stats: SpecDecodeStats | None = None
        self._counters: EngineCounters | None = None
        if not self.llm_engine.config.disable_log_stats:
            self.spec_decode_stats = SpecDecodeStats()
            self._counters = EngineCounters()
            self.llm_engine.subscribe(self.spec_decode_stats)
            self.llm_engine.subscribe(self._counters)

    def get_metrics(self) -> list[Metric]:
        """vLLM's ``LLM.get_metrics()``: counters since this ``LLM`` was made, and gauges of
        the latest step (names and records: :mod:`llmlab.observe.metrics_reader`). Needs
        ``disable_log_stats=False``, as vLLM's does."""
        config = self.llm_engine.config
        if self._counters is None or self.spec_decode_stats is None:
            raise ValueError(
                "get_metrics() needs stats, which are off: build the LLM with "
                "disable_log_stats=False (got disable_log_stats=True, the default, as in vLLM)"
            )
        spec = config.speculative_config
        return collect(
            self._counters, self.spec_decode_stats, model_name=config.model,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
        )

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Use ``tokenizer`` from now on (vLLM's): for prompts, output text, stop strings and
        ``bad_words`` of requests added after this call. Structured outputs keep compiling
        with the tokenizer the engine was built with."""
        engine = self.llm_engine
        if isinstance(engine, DataParallelEngine):
            raise NotImplementedError(
                "set_tokenizer is not supported with data_parallel_size > 1 (each replica "
                "holds its own tokenizer)"
            )
        if tokenizer is None or not callable(getattr(tokenizer, "encode", None)):
            raise TypeError(
                f"tokenizer must be a Hugging Face tokenizer, got {type(tokenizer).__name__}"
            )
        with self._lock:
            engine.tokenizer = tokenizer
            engine.inputs.tokenizer = tokenizer
            engine.outputs.tokenizer = tokenizer
            sampler = getattr(engine.executor, "sampler", None)
            if sampler is not None and hasattr(sampler, "tokenizer"):
                sampler.tokenizer = tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache's cached blocks that no request holds (vLLM's); True
        when nothing is cached any more, False when running requests still hold cached
        blocks (those stay)."""
        engine = self.llm_engine
        if isinstance(engine, DataParallelEngine):
            raise NotImplementedError(
                "reset_prefix_cache is not supported with data_parallel_size > 1"
            )
        with self._lock:
            return engine.scheduler.kv.reset_prefix_cache()

    def start_profile(self) -> None:
        """Start a ``torch.profiler`` trace of this process (vLLM's); :meth:`stop_profile`
        writes it (a Chrome/TensorBoard trace) to the directory named by
        ``LLMLAB_TORCH_PROFILER_DIR`` (or vLLM's ``VLLM_TORCH_PROFILER_DIR``)."""
        if self._profiler is not None:
            raise RuntimeError("a profile is already running; call stop_profile() first")
        directory = os.environ.get("LLMLAB_TORCH_PROFILER_DIR") or os.environ.get(
            "VLLM_TORCH_PROFILER_DIR"
        )
        if not directory:
            raise RuntimeError(
                "start_profile() needs a directory for the trace: set LLMLAB_TORCH_PROFILER_DIR "
                "(or VLLM_TORCH_PROFILER_DIR) before calling it"
            )
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(directory, exist_ok=True)
        profiler = torch.profiler.profile(
            activities=activities, record_shapes=True, with_stack=True,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(directory),
        )
        profiler.start()
        self._profiler = profiler
        self._profiler_dir = directory

    def stop_profile(self) -> None:
        """Stop the trace :meth:`start_profile` began and write it to its directory."""
        profiler = self._profiler
        if profiler is None:
            raise RuntimeError("no profile is running; call start_profile() first")
        self._profiler = None
        profiler.stop()
        logger.info("torch profiler trace written to %s", self._profiler_dir)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without ``sampling_params``: the model's
        ``generation_config.json`` settings (temperature, top_p, top_k, min_p,
        max_new_tokens), vLLM's defaults for the rest."""
        return self.llm_engine.default_sampling_params

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: int | Sequence[int] | None = None,
        user: str | Sequence[str | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions; returns one ``RequestOutput`` per prompt, in input order.

        ``prompts``: a string, ``{"prompt_token_ids": [...]}`` (or ``{"prompt": str}``), or a
        list of those. ``sampling_params``: one for all prompts, one per prompt, or None
        for :meth:`get_default_sampling_params`. ``priority``: one int for all prompts or one
        per prompt, lower served first by policies that read it (``"priority"``). ``user``:
        one str for all prompts or one str (or None) per prompt, for per-user policies
        (``"fair"``). ``lora_request``: a :class:`~llmlab.lora.request.LoRARequest` for
        all prompts, or one (or None: the base model) per prompt; the LLM needs
        ``enable_lora=True`` (docs/lora.md).
        All prompts are validated before any is queued: on an error nothing runs. After an
        error or Ctrl-C the engine holds none of this call's requests and no blocks for
        them. Calls from several threads run one after another.
        """
        if getattr(self.llm_engine, "pooling", None) is not None:
            raise ValueError(
                "LLM.generate needs a generating model, but this LLM runs a pooling model "
                "(runner='pooling'): use embed, classify, score or encode, or build it with "
                "runner='generate'"
            )
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _as_params_list(sampling_params, len(prompt_list))
        priorities = _as_priorities(priority, len(prompt_list))
        users = _as_users(user, len(prompt_list))
        loras = _as_loras(lora_request, len(prompt_list))
        with self._lock:
            engine = self.llm_engine
            ids = self._new_ids(len(prompt_list))
            try:
                for request_id, prompt, params, prio, who, lora in zip(
                    ids, prompt_list, params_list, priorities, users, loras, strict=True
                ):
                    final_only = attrs.evolve(params, output_kind=RequestOutputKind.FINAL_ONLY)
                    engine.add_request(
                        request_id, prompt, final_only, priority=prio, user=who,
                        **({"lora_request": lora} if lora is not None else {}),
                    )
                return self._run(ids, use_tqdm)
            finally:
                self._abort_quietly(ids)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the tokenizer's chat template.

        ``messages``: one conversation (a list of ``{"role": ..., "content": ...}``) or a
        list of them. ``chat_template`` overrides the tokenizer's; ``add_generation_prompt``
        appends the assistant turn's opening; ``continue_final_message`` continues the last
        (assistant) message instead (the two exclude each other);
        ``chat_template_kwargs`` go to the template. ``tools`` (OpenAI's function
        definitions, as vLLM's ``LLM.chat`` takes them) go to the template as its ``tools``;
        the reply is not parsed for calls (``llmlab serve`` does that). The rendered text is
        then generated exactly as ``generate`` would generate it (``lora_request`` as
        there).
        """
        prompts = self.render_chat(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        return self.generate(
            prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request
        )

    def render_chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> list[dict]:
        """The prompts ``chat`` generates from: ``{"prompt": text, "prompt_token_ids": ids}``
        per conversation. A template that writes the BOS token itself is not given a second
        one by the tokenizer."""
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise TypeError(f"tools must be a list of dicts (OpenAI's tool definitions), "
                                f"got {type(tools).__name__}")
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        return render_chat(
            self.get_tokenizer(),
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's ``LLM.beam_search``): the ``beam_width`` best sequences per
        prompt, best first, scored as Hugging Face's ``generate(num_beams=...)`` scores them.

        Each step asks the engine for the ``2 * beam_width`` most likely next tokens of every
        live beam at once; beams are requests whose prompts share their prefix, so with
        prefix caching (the default) their full KV blocks are shared, not recomputed.
        ``lora_request``: one adapter for every prompt's beams (or None).
        """
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError(
                "beam_search takes one LoRARequest (or None) for all prompts, got "
                f"{type(lora_request).__name__}"
            )
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        engine = self.llm_engine
        k = candidates_per_beam(params, engine.eos_token_ids)
        if engine.max_logprobs != -1 and k > engine.max_logprobs:
            raise ValueError(
                f"beam_width={params.beam_width} needs the top {k} logprobs per beam, more "
                f"than max_logprobs={engine.max_logprobs}; build the LLM with max_logprobs>={k}"
            )
        if not engine.config.enable_prefix_caching:
            logger.warning(
                "beam_search without prefix caching recomputes every beam's whole sequence at "
                "each step; build the LLM with enable_prefix_caching=True to share them"
            )
        token_prompts = []
        for prompt in _as_prompt_list(prompts):
            _, ids = engine.inputs.tokenize(prompt)
            token_prompts.append(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=params.max_tokens, desc="Beam search", dynamic_ncols=True)

        def expand(sequences: list[list[int]], k: int) -> list[list[tuple[int, float]]]:
            step = SamplingParams(max_tokens=1, logprobs=k, temperature=0.0, detokenize=False,
                                  ignore_eos=True)
            outs = self.generate(
                [{"prompt_token_ids": seq} for seq in sequences], step, use_tqdm=False,
                lora_request=lora_request,
            )
            if bar is not None:
                bar.update(1)
            ranked = []
            for out in outs:
                top = out.outputs[0].logprobs[0]
                best = sorted(top.items(), key=lambda kv: kv[1].logprob, reverse=True)[:k]
                ranked.append([(tok, lp.logprob) for tok, lp in best])
            return ranked

        tokenizer = self.get_tokenizer()
        decode = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else None
        try:
            return beam_search(
                expand, token_prompts, params, engine.eos_token_ids,
                max_model_len=engine.max_model_len, decode=decode,
            )
        finally:
            if bar is not None:
                bar.close()

    # -- pooling (runner="pooling"; docs/pooling.md) ------------------------------------

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        *,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt (vLLM's ``LLM.encode``): one ``PoolingRequestOutput`` per prompt,
        in order, whose ``outputs.data`` is a 1-D float32 tensor. ``pooling_task``
        (``"embed"``, ``"classify"``, ``"score"``, ``"encode"``) sets the task of params
        that name none; None: the model's default task. Needs ``runner="pooling"``."""
        return self._pool(
            prompts, pooling_params, pooling_task, use_tqdm, truncate_prompt_tokens, "encode"
        )

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """An embedding per prompt (vLLM's ``LLM.embed``): ``outputs.embedding``, a list of
        floats (L2-normalized unless ``normalize=False``; the first ``dimensions`` values
        when set). Needs ``runner="pooling"`` on a model that embeds."""
        outs = self._pool(
            prompts, pooling_params, "embed", use_tqdm, truncate_prompt_tokens, "embed"
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (vLLM's ``LLM.classify``): ``outputs.probs``, the
        softmax of the classifier's logits (sigmoid for one label; the logits themselves
        with ``use_activation=False``). Needs a ``*ForSequenceClassification`` model."""
        outs = self._pool(
            prompts, pooling_params, "classify", use_tqdm, truncate_prompt_tokens, "classify"
        )
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance scores of text pairs (vLLM's ``LLM.score``): ``data_1[i]`` against
        ``data_2[i]``, or one ``data_1`` against every ``data_2``; one
        ``ScoringRequestOutput`` per pair, ``outputs.score`` a float.

        A cross-encoder (a classifier with one label) reads each pair as the tokenizer's
        pair encoding and scores it with the sigmoid of its logit (the logit itself with
        ``use_activation=False``); an embedding model scores the cosine similarity of the
        two texts' embeddings.
        """
        engine = self._pooling_engine("score")
        pairs = _score_pairs(data_1, data_2)
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(
                f"pooling_params must be PoolingParams or None, got "
                f"{type(pooling_params).__name__}"
            )
        params = pooling_params or PoolingParams()
        if "score" in engine.pooling.tasks:
            tokenizer = self.get_tokenizer()
            if tokenizer is None:
                raise ValueError("score needs a tokenizer (the LLM has skip_tokenizer_init)")
            prompts = [
                {"prompt_token_ids": tokenizer(a, text_pair=b)["input_ids"]} for a, b in pairs
            ]
            outs = self._pool(prompts, params, "score", use_tqdm, truncate_prompt_tokens, "score")
            return [ScoringRequestOutput.from_base(o) for o in outs]
        if "embed" not in engine.pooling.tasks:
            raise ValueError(
                "score needs a cross-encoder (a classifier with num_labels=1) or an "
                f"embedding model; this model has num_labels={engine.pooling.num_labels}"
            )
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        embedded = self._pool(texts, params, "embed", use_tqdm, truncate_prompt_tokens, "score")
        by_text = dict(zip(texts, embedded, strict=True))
        outs = []
        for a, b in pairs:
            first, second = by_text[a], by_text[b]
            similarity = torch.nn.functional.cosine_similarity(
                first.outputs.data, second.outputs.data, dim=0
            )
            outs.append(ScoringRequestOutput(
                request_id=f"{first.request_id}_{second.request_id}",
                outputs=ScoringOutput(float(similarity)),
                prompt_token_ids=first.prompt_token_ids + second.prompt_token_ids,
                finished=True,
            ))
        return outs

    def _pooling_engine(self, method: str) -> Engine:
        engine = self.llm_engine
        if isinstance(engine, DataParallelEngine):
            raise NotImplementedError(f"LLM.{method} is not supported with data_parallel_size > 1")
        if engine.pooling is None:
            raise ValueError(
                f"LLM.{method} needs a pooling model: this LLM generates text "
                "(runner='generate'); build it with runner='pooling' (or vLLM's "
                "task='embed' / 'classify' / 'score')"
            )
        return engine

    def _pool(self, prompts, pooling_params, task, use_tqdm, truncate_prompt_tokens, method):
        """Run pooling requests of ``task`` (None: each params' own, else the model's
        default) and return their ``PoolingRequestOutput``s in prompt order."""
        engine = self._pooling_engine(method)
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(pooling_params, len(prompt_list), PoolingParams)
        own = []
        for i, params in enumerate(params_list):
            if task is not None and params.task not in (None, task):
                raise ValueError(
                    f"pooling_params[{i}].task={params.task!r}, but LLM.{method} runs "
                    f"task={task!r}; leave task None or use LLM.encode"
                )
            params = attrs.evolve(params, task=task or params.task)
            if truncate_prompt_tokens is not None:
                params = attrs.evolve(params, truncate_prompt_tokens=truncate_prompt_tokens)
            own.append(params)
        with self._lock:
            ids = self._new_ids(len(prompt_list))
            try:
                # Checked (and resolved against the model's tasks) before any is queued.
                prepared = [
                    engine.prepare_request(request_id, prompt, params)
                    for request_id, prompt, params in zip(ids, prompt_list, own, strict=True)
                ]
                for request in prepared:
                    engine.add_prepared_request(request)
                return self._run(ids, use_tqdm)
            finally:
                self._abort_quietly(ids)

    def _new_ids(self, n: int) -> list[str]:
        """Fresh request ids that no request in the engine uses (a user's own included)."""
        ids = []
        while len(ids) < n:
            candidate = str(next(self._ids))
            if not self.llm_engine.has_request(candidate):
                ids.append(candidate)
        return ids

    def _abort_quietly(self, ids: list[str]) -> None:
        """Abort whatever is left of ``ids``; an error here must not mask the original one."""
        pending = sys.exc_info()[1] is not None
        try:
            self.llm_engine.abort_request(ids)
        except Exception:
            if not pending:
                raise
            logger.exception("while cleaning up after an error, aborting requests also failed")

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        pending = set(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        num_output_tokens = 0
        try:
            while pending:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(
                        f"the engine has no unfinished requests but {len(pending)} of this "
                        "call's are missing (aborted from outside generate?)"
                    )
                for out in engine.step():
                    if out.request_id not in pending or not out.finished:
                        continue
                    pending.discard(out.request_id)
                    done[out.request_id] = out
                    if isinstance(out, RequestOutput):  # a pooling output generates none
                        num_output_tokens += sum(len(c.token_ids) for c in out.outputs)
                    if bar is not None:
                        bar.update(1)
                        if num_output_tokens:  # a pooling run has no output tokens to rate
                            rate = num_output_tokens / max(bar.format_dict["elapsed"], 1e-9)
                            bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _per_prompt(field: str, values: Any, n: int, check, allowed: str) -> list:
    """A list with one entry per prompt, or ValueError naming the field (type errors too:
    a wrong list is one mistake, whatever is wrong with it, and nothing gets queued)."""
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence):
        # ValueError, not TypeError: every way a per-prompt list can be wrong is one error.
        raise ValueError(  # noqa: TRY004
            f"{field} must be a list with one entry per prompt, got {values!r}"
        )
    if len(values) != n:
        raise ValueError(
            f"got {len(values)} values for {field} but {n} prompts; pass one per prompt"
        )
    for i, value in enumerate(values):
        if not check(value):
            raise ValueError(
                f"{field}[{i}] must be {allowed}, got {type(value).__name__} {value!r}"
            )
    return list(values)


def _as_priorities(priority: Any, n: int) -> list[int]:
    if priority is None:
        return [0] * n
    if isinstance(priority, (int, np.integer)) and not isinstance(priority, (bool, np.bool_)):
        return [int(priority)] * n  # one for all (vLLM accepts a scalar)
    values = _per_prompt(
        "priority", priority, n,
        lambda p: isinstance(p, (int, np.integer)) and not isinstance(p, (bool, np.bool_)),
        "an int",
    )
    return [int(p) for p in values]


def _as_users(user: Any, n: int) -> list[str | None]:
    if user is None:
        return [None] * n
    if isinstance(user, str):
        return [user] * n
    return _per_prompt("user", user, n, lambda u: u is None or isinstance(u, str), "a str or None")


def _as_loras(lora_request: Any, n: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if isinstance(lora_request, (str, bytes)) or not isinstance(lora_request, Sequence):
        raise TypeError(
            "lora_request must be a LoRARequest, a list of them (one per prompt) or None, "
            f"got {type(lora_request).__name__}"
        )
    return _per_prompt(
        "lora_request", lora_request, n, lambda r: r is None or isinstance(r, LoRARequest),
        "a LoRARequest or None",
    )


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise TypeError("prompts must be a str, a dict or a list of them, got bytes")
    if isinstance(prompts, Sequence):
        if prompts and all(isinstance(p, int) for p in prompts):
            raise ValueError(
                "a bare list of ints is ambiguous; pass {'prompt_token_ids': [...]} for a "
                "tokenized prompt"
            )
        return list(prompts)
    raise TypeError(
        f"prompts must be a str, a dict or a list of them, got {type(prompts).__name__}"
    )


def _score_pairs(data_1: Any, data_2: Any) -> list[tuple[str, str]]:
    """vLLM's pairing: one ``data_1`` against every ``data_2``, or ``data_1[i]`` against
    ``data_2[i]``; texts only."""
    def texts(field: str, value: Any) -> list[str]:
        items = [value] if isinstance(value, str) else value
        if isinstance(items, (bytes, dict)) or not isinstance(items, Sequence) or not items:
            raise ValueError(f"{field} must be a str or a non-empty list of str, got {value!r}")
        for i, item in enumerate(items):
            if not isinstance(item, str) or not item:
                raise ValueError(f"{field}[{i}] must be a non-empty str, got {item!r}")
        return list(items)

    first, second = texts("data_1", data_1), texts("data_2", data_2)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(
            f"data_1 has {len(first)} texts and data_2 {len(second)}: pass one data_1, or "
            "as many as data_2"
        )
    return list(zip(first, second, strict=True))


def _as_params_list(params: Any, n: int, kind: type = SamplingParams) -> list:
    """One ``kind`` (SamplingParams or PoolingParams) per prompt: None (the defaults), one
    for every prompt, or a list of ``n``; anything else is an error naming the argument."""
    field = "sampling_params" if kind is SamplingParams else "pooling_params"
    if params is None:
        return [kind()] * n
    if isinstance(params, kind):
        return [params] * n
    if kind is PoolingParams and isinstance(params, SamplingParams):
        raise TypeError(
            "pooling_params must be PoolingParams (SamplingParams are for LLM.generate)"
        )
    if not isinstance(params, Sequence):
        raise TypeError(
            f"{field} must be {kind.__name__} or a list of them, got {type(params).__name__}"
        )
    params = list(params)
    if len(params) != n:
        raise ValueError(
            f"got {len(params)} {kind.__name__} for {n} prompts; pass one, or one per prompt"
        )
    for i, p in enumerate(params):
        if not isinstance(p, kind):
            raise TypeError(f"{field}[{i}] must be {kind.__name__}, got {type(p).__name__}")
    return params

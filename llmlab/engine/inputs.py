"""Input processing: check, tokenize and fan out requests before they reach a step.

Everything a request is checked against (the vocabulary, the model's length, the KV
cache's size, the engine's limits) is known when the engine is built, so
:class:`InputProcessor` holds those facts and reads no state that steps change: it may run
in any thread while the engine steps. ``LLM``, the ``AsyncEngine``, the server and beam
search all queue requests through it (via :meth:`Engine.prepare_request
<llmlab.engine.engine.Engine.prepare_request>`). It also renders chat conversations
(:func:`render_chat`) and builds a request's parallel samples (:meth:`InputProcessor.requests`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import attrs

from llmlab.lora.request import LoRARequest
from llmlab.pooling.task import PoolingSpec
from llmlab.pooling_params import PoolingParams
from llmlab.request import Request, SampleGroup
from llmlab.sampling.metadata import GrammarFactory
from llmlab.sampling.params import SamplingParams
from llmlab.sampling.processors import tokenize_bad_words
from llmlab.validation import as_int, as_real, as_token_ids, check_encodable

PromptType = str | dict | Sequence[int]

# Characters of prompt text allowed per token of max_model_len, checked before tokenizing:
# tokenizing a huge text costs seconds of CPU and gigabytes that are never given back, and
# no tokenizer packs more than a few dozen characters of real text into a token.
CHARS_PER_TOKEN = 32

_PROMPT_KEYS = ("prompt", "prompt_token_ids")

# A pooling request's ``sampling_params``: never read to sample (it generates nothing),
# but policies and output processing may look at it.
_POOLING_SAMPLING = SamplingParams(max_tokens=1, detokenize=False).snapshot()


def check_prompt_text(field: str, text: str, max_model_len: int) -> None:
    """``ValueError`` unless ``text`` is valid Unicode of at most :data:`CHARS_PER_TOKEN`
    characters per token of ``max_model_len``: checked before tokenizing, because
    tokenizing a huge text costs a minute of CPU and memory that is never given back."""
    limit = max_model_len * CHARS_PER_TOKEN
    if len(text) > limit:
        raise ValueError(
            f"{field} has {len(text)} characters, more than the {limit} allowed "
            f"({CHARS_PER_TOKEN} per token of max_model_len={max_model_len}), checked "
            "before tokenizing"
        )
    check_encodable(field, text)


@attrs.frozen
class PreparedRequest:
    """A request checked and tokenized by :meth:`InputProcessor.prepare`, not yet queued."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    arrival_time: float
    priority: int = 0
    user: str | None = None
    grammar: Any = None  # the compiled structured-output grammar, if any (checked early)
    lora_request: Any = None  # its LoRARequest (the adapter loaded and checked), or None


@attrs.define
class InputProcessor:
    """Checks and tokenizes requests against the engine's fixed limits.

    Attributes:
        tokenizer: the tokenizer, or None (``skip_tokenizer_init``: token ids only).
        vocab_size, max_model_len, eos_token_ids: the model's.
        max_num_seqs: the most requests running at once (bounds ``n`` / ``best_of``).
        block_size, num_kv_blocks: the KV cache's geometry (a prompt must fit it).
        max_logprobs: the most logprobs a request may ask for (-1: no limit).
        grammars: compiles structured-output constraints (shared with the executor).
        pooling: a pooling engine's tasks and defaults (``runner="pooling"``: requests
            take ``PoolingParams``), or None (a generating engine: ``SamplingParams``).
        lora: the LoRA adapters in host memory (:class:`~llmlab.lora.store.AdapterStore`)
            when the engine has ``enable_lora``, else None.
        kv_press: whether the engine has a KV press (a request's
            ``extra_args["kv_budget"]`` needs one).
    """

    tokenizer: Any | None
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int
    max_logprobs: int = 20
    grammars: GrammarFactory | None = None
    pooling: PoolingSpec | None = None
    lora: Any = None
    kv_press: bool = False

    @classmethod
    def of(cls, engine: Any) -> InputProcessor:
        """The input processor of an engine (its model's and scheduler's limits)."""
        kv = engine.scheduler.kv
        return cls(
            engine.tokenizer, engine.vocab_size, engine.max_model_len, engine.eos_token_ids,
            engine.scheduler.max_num_seqs, kv.block_size, kv.num_blocks,
            engine.max_logprobs, engine.grammars, getattr(engine, "pooling", None),
            getattr(engine, "lora", None),
            kv_press=engine.scheduler.plugin("kv_press") is not None,
        )

    def prepare(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        arrival_time: float | None,
        priority: int,
        user: str | None,
        now: float,
        lora_request: Any = None,
        client: Hashable = None,
    ) -> PreparedRequest:
        """Check and tokenize one request (``now``: its arrival time when none is given).
        Raises ``TypeError``/``ValueError`` naming the field. ``lora_request``'s adapter is
        loaded and checked here (before anything is queued)."""
        if not isinstance(request_id, str):
            raise TypeError(
                f"request_id must be a str, got {type(request_id).__name__} {request_id!r}"
            )
        params = self._params(params)
        arrival_time = as_real("arrival_time", arrival_time, allow_none=True)
        priority = as_int("priority", priority)
        if user is not None and not isinstance(user, str):
            raise TypeError(f"user must be a str or None, got {type(user).__name__} {user!r}")
        text, token_ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            keep = params.truncate_prompt_tokens
            keep = self.max_model_len if keep == -1 else keep
            token_ids = token_ids[-keep:]  # vLLM keeps the end of the prompt
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, longer than max_model_len="
                f"{self.max_model_len}"
            )
        needed = -(-len(token_ids) // self.block_size)
        if needed > self.num_kv_blocks:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, needing {needed} KV blocks of "
                f"{self.block_size} tokens, but the whole KV cache has {self.num_kv_blocks}; "
                "shorten the prompt or give the cache more memory"
            )
        if lora_request is not None:
            self.check_lora(lora_request)
        if isinstance(params, PoolingParams):
            return PreparedRequest(
                request_id=request_id, prompt=text, prompt_token_ids=token_ids, params=params,
                arrival_time=now if arrival_time is None else arrival_time,
                priority=priority, user=user,
            )
        self.check_params(params)
        budget = (params.extra_args or {}).get("kv_budget")
        if budget is not None and not self.kv_press:
            raise ValueError(
                f"extra_args['kv_budget']={budget!r} needs an engine built with a KV press "
                "(LLM(..., kv_press='snapkv'), llmlab serve --kv-press snapkv)"
            )
        grammar = None
        if params.structured_outputs is not None:
            # Compiles queue fairly per client: who sent it (a front end's knowledge),
            # else the request's user (None: one shared client).
            grammar = self.grammars.compile(
                params.structured_outputs, client=user if client is None else client)
        return PreparedRequest(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            arrival_time=now if arrival_time is None else arrival_time,
            priority=priority,
            user=user,
            grammar=grammar,
            lora_request=lora_request,
        )

    def check_lora(self, lora_request: Any) -> None:
        """Load ``lora_request``'s adapter into host memory, checking it against the model
        (``ValueError`` naming the field; ``enable_lora`` off is one too)."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(
                f"lora_request must be a LoRARequest or None, got "
                f"{type(lora_request).__name__}"
            )
        if self.lora is None:
            raise ValueError(
                f"lora_request={lora_request!r} needs an engine built with enable_lora=True "
                "(LLM(..., enable_lora=True), llmlab serve --enable-lora)"
            )
        self.lora.get(lora_request)

    def _params(self, params: object) -> SamplingParams | PoolingParams:
        """The request's own read-only copy of its parameters, of the kind this engine
        runs: ``SamplingParams`` on a generating engine, ``PoolingParams`` on a pooling
        one (checked against the model's tasks, defaults filled in)."""
        if self.pooling is not None:
            if params is None:
                params = PoolingParams()
            if isinstance(params, SamplingParams):
                raise ValueError(
                    "params is SamplingParams, but this engine runs a pooling model "
                    "(runner='pooling'): it embeds, classifies or scores (PoolingParams); "
                    "to generate text, build it with runner='generate'"
                )
            if not isinstance(params, PoolingParams):
                raise TypeError(
                    f"params must be PoolingParams or None, got {type(params).__name__}"
                )
            return self.pooling.resolve(params)
        if isinstance(params, PoolingParams):
            raise ValueError(
                "params is PoolingParams, but this engine generates text "
                "(runner='generate'); to embed, classify or score, build it with "
                "runner='pooling'"
            )
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams or None, got {type(params).__name__}")
        # SamplingParams are mutable (vLLM's): the request keeps its own read-only copy, so
        # the caller changing (or reusing) the object afterwards does not reach the engine.
        return params.snapshot()

    def check_params(self, params: SamplingParams) -> None:
        """What only the engine can check: vocabulary, tokenizer, limits."""
        for tok in params.stop_token_ids:
            if tok >= self.vocab_size:
                raise ValueError(
                    f"stop_token_ids contains {tok}, outside the vocabulary [0, {self.vocab_size})"
                )
        for field in ("allowed_token_ids",):
            for tok in getattr(params, field) or ():
                if tok >= self.vocab_size:
                    raise ValueError(
                        f"{field} contains {tok}, outside the vocabulary [0, {self.vocab_size})"
                    )
        for tok in params.logit_bias or ():
            if tok >= self.vocab_size:
                raise ValueError(
                    f"logit_bias has token id {tok}, outside the vocabulary [0, {self.vocab_size})"
                )
        limit = self.max_logprobs
        for field in ("logprobs", "prompt_logprobs"):
            k = getattr(params, field)
            wanted = self.vocab_size if k == -1 else k
            if k is not None and limit != -1 and wanted > limit:
                raise ValueError(
                    f"{field}={k} is more than max_logprobs={limit} (an engine setting: "
                    f"LLM(max_logprobs=...), -1 for no limit); allowed: 0 to {limit}"
                )
        if params.num_samples > self.max_num_seqs:
            raise ValueError(
                f"{'best_of' if params.best_of else 'n'}={params.num_samples} parallel samples "
                f"cannot run at once with max_num_seqs={self.max_num_seqs}"
            )
        if self.tokenizer is None:
            for field in ("stop", "bad_words"):
                if getattr(params, field):
                    raise ValueError(f"{field} needs a tokenizer (skip_tokenizer_init=True)")
        elif params.bad_words:
            # Tokenized here, once, so a word the tokenizer cannot take fails this request
            # now instead of the sampler's step shared with every other request.
            try:
                tokenize_bad_words(params.bad_words, self.tokenizer)
            except Exception as err:  # noqa: BLE001 - whatever the tokenizer raises
                raise ValueError(
                    f"bad_words could not be tokenized: {type(err).__name__}: {err}"
                ) from err
        elif params.stop and not params.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text)")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (skip_tokenizer_init=True)")

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt in any accepted form."""
        text = None
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - set(_PROMPT_KEYS), key=str)
            if unknown:
                raise ValueError(
                    f"prompt dict has unsupported key(s) {unknown}; allowed: 'prompt', "
                    "'prompt_token_ids'"
                )
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise TypeError(f"prompt must be a str, got {type(text).__name__}")
                prompt = prompt["prompt_token_ids"]
                if isinstance(prompt, str):
                    raise TypeError("prompt_token_ids must be a sequence of ints, got a str")
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: it must contain at least one character")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True)")
            check_prompt_text("prompt", prompt, self.max_model_len)
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"prompt must be a str, a dict or a sequence of token ids, got "
                f"{type(prompt).__name__} (decode bytes to str first)"
            )
        token_ids = as_token_ids("prompt_token_ids", prompt, vocab_size=self.vocab_size)
        if not token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        return text, token_ids

    def requests(self, prepared: PreparedRequest) -> list[Request]:
        """The request, or its ``best_of`` parallel samples (the first one leads; a
        sample's id is ``f"{index}_{request_id}"``)."""
        request_id, params = prepared.request_id, prepared.params
        # What every request of this prompt carries, pooling or sampled.
        common = dict(
            arrival_time=prepared.arrival_time, priority=prepared.priority,
            user=prepared.user, prompt=prepared.prompt,
        )
        if isinstance(params, PoolingParams):
            return [Request(
                request_id=request_id,
                prompt_token_ids=list(prepared.prompt_token_ids),
                sampling_params=_POOLING_SAMPLING,
                pooling_params=params,
                pools_all_positions=self.pooling.uses_all_positions,
                **common,
            )]
        num = params.num_samples
        ids = [request_id] if num == 1 else [f"{i}_{request_id}" for i in range(num)]
        group = SampleGroup(request_id, params.n) if num > 1 else None
        lora = prepared.lora_request
        members = []
        for index, rid in enumerate(ids):
            own = params
            if num > 1:
                # vLLM's rule: sample i draws from seed + i, so samples differ but repeat.
                seed = None if params.seed is None else params.seed + index
                own = attrs.evolve(params, n=1, best_of=None, seed=seed).snapshot()
            members.append(
                Request(
                    request_id=rid,
                    prompt_token_ids=list(prepared.prompt_token_ids),
                    sampling_params=own,
                    eos_token_ids=self.eos_token_ids,
                    group=group,
                    index=index,
                    lora_request=lora,
                    hash_salt=None if lora is None else lora.hash_salt,
                    **common,
                )
            )
            if params.prompt_logprobs is not None:
                members[-1].prompt_logprobs = [None]  # the first token has no context
        if group is not None:
            group.members = members
            members[0].forks = members[1:]
        return members


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict] | Sequence[Sequence[dict]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    max_chars: int | None = None,
) -> list[dict]:
    """Render conversations with ``tokenizer``'s chat template (or ``chat_template``):
    ``{"prompt": text, "prompt_token_ids": ids}`` per conversation (see
    ``LLM.render_chat``; the server renders chat requests with this too). A rendered text
    longer than ``max_chars`` is refused before it is tokenized."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer (the LLM was built with skip_tokenizer_init)")
    conversations = _as_conversations(messages)
    for i, conversation in enumerate(conversations):
        for j, message in enumerate(conversation):
            for key, value in message.items():
                if isinstance(value, str):
                    check_encodable(f"messages[{j}].{key}", value)
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "add_generation_prompt and continue_final_message exclude each other; set "
            "add_generation_prompt=False to continue the final message"
        )
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be a str or None, got {type(chat_template).__name__}")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "the tokenizer has no chat template; pass chat_template=... (a Jinja template)"
        )
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(
            "chat_template_kwargs must be a dict or None, got "
            f"{type(chat_template_kwargs).__name__}"
        )
    bos = getattr(tokenizer, "bos_token", None)
    prompts = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
        if max_chars is not None and len(text) > max_chars:
            raise ValueError(
                f"the chat template rendered {len(text)} characters, more than the "
                f"{max_chars} allowed (a prompt that long could never fit max_model_len)"
            )
        has_bos = bool(bos) and text.startswith(bos)
        ids = tokenizer.encode(text, add_special_tokens=not has_bos)
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    return prompts


def _as_conversations(messages: Any) -> list[list[dict]]:
    """One conversation or a list of them, each a list of message dicts."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError(
            "messages must be a non-empty list of {'role': ..., 'content': ...} dicts, or a "
            f"list of such lists, got {messages!r}"
        )
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conversation in enumerate(conversations):
        if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence):
            raise ValueError(  # noqa: TRY004 - one error kind for every malformed conversation
                f"messages[{i}] must be a list of message dicts, got {conversation!r}"
            )
        for j, message in enumerate(conversation):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(
                    f"message {j} of conversation {i} must be a dict with 'role' and "
                    f"'content', got {message!r}"
                )
    return [list(c) for c in conversations]

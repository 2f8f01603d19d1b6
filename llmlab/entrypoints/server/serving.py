"""Turn OpenAI requests into engine requests, and engine outputs into OpenAI responses.

Everything a request can get wrong is found here, before anything reaches the engine:
the model name, the prompt, token counts against the model length, every sampling field
(through :class:`~llmlab.sampling.params.SamplingParams`' own checks) and the structured
output constraint (compiled while the request is prepared). Each is an :class:`APIError`
with OpenAI's error shape. A request with several prompts is added only when all of them
are valid; if adding one fails, the ones already added are aborted.

:class:`OpenAIServing` prepares requests and adds them to the engine; the rest lives beside
it: ``errors.py`` (:class:`APIError`), ``request_params.py`` (request fields as engine
arguments), ``responses.py`` (engine outputs as responses and SSE streams) and
``logprobs.py`` (OpenAI's two logprob shapes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import attrs

from llmlab.entrypoints.async_engine import AsyncEngine, EngineDeadError, RequestStream
from llmlab.engine.inputs import CHARS_PER_TOKEN, check_prompt_text, render_chat
from llmlab.sampling.params import RequestOutputKind, SamplingParams
from llmlab.entrypoints.server import protocol as p
from llmlab.entrypoints.server.admission import Admission, Ticket, Weight
from llmlab.entrypoints.server.errors import APIError, bad_request
from llmlab.entrypoints.server.request_params import (
    _default,
    _fields,
    _logit_bias,
    _message_text,
    _structured,
    _unsupported,
)
from llmlab.entrypoints.server.responses import (
    _ChatRun,
    _CompletionRun,
    _Prompt,
    _until_disconnected,
)
from llmlab.entrypoints.server.templates import TemplateProcesses, TemplateTimeout
from llmlab.entrypoints.server.tools import check_tools, template_tools, tool_constraint
from llmlab.validation import check_encodable

# _params' structured-output default: the request's own constraint.
_FROM_REQUEST = object()

# What waiting for a request template's render may add for starting its worker processes.
_WORKER_START_S = 60.0



@attrs.define
class OpenAIServing:
    """The endpoints' logic, independent of the web framework.

    Attributes:
        trust_request_chat_template: accept a request's own ``chat_template`` (off by
            default, as in vLLM: a template is code the server runs).
        template_timeout_s: the longest a chat template may take to render. The server's
            own template renders on ``own_template_workers`` threads of its own; a
            request's own template (``trust_request_chat_template``) in one of
            ``template_workers`` worker processes (:mod:`llmlab.entrypoints.server.templates`), ended
            when it runs past its time, waited for on as many threads of their own. So the
            server's template never waits behind a request's (a template bomb holds only
            the request-template pool), and neither holds the engine loop or the threads
            other requests tokenize on.
        max_prompts_per_request / max_sequences_per_request: the most prompts in one
            request, and prompts x ``max(n, best_of)`` (400 beyond them).
        admission: the bounds on work in flight (sequences and tokens, queued or
            running; :mod:`llmlab.entrypoints.server.admission`): a request that would pass one is
            answered 429 with ``Retry-After`` at once, before any of it is tokenized.
        return_tokens_as_token_ids: the default of the request field: logprob tokens as
            ``"token_id:{id}"`` (vLLM's format).
        response_role: the role of chat responses (with ``add_generation_prompt=false``,
            the last message's role, as in vLLM).
        tool_parser: makes a tool-call parser per choice for ``tool_choice="auto"`` (None:
            auto is a 400; see :mod:`llmlab.entrypoints.server.tool_parsers`).
    """

    engine: AsyncEngine
    model_names: list[str]
    model_path: str | None = None
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    template_timeout_s: float = 10.0
    template_workers: int = 2
    own_template_workers: int = 4
    max_prompts_per_request: int = 256
    max_sequences_per_request: int = 1024
    admission: Admission = attrs.field(factory=Admission)
    return_tokens_as_token_ids: bool = False
    response_role: str = "assistant"
    tool_parser: Callable[[], Any] | None = None
    # The LoRA adapters served by name (llmlab.entrypoints.server.lora.LoRAAdapters), or None.
    lora: Any = None
    _templates: concurrent.futures.ThreadPoolExecutor = attrs.field(init=False, default=None)
    _request_templates: concurrent.futures.ThreadPoolExecutor = attrs.field(
        init=False, default=None)
    _processes: TemplateProcesses | None = attrs.field(init=False, default=None)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def __attrs_post_init__(self) -> None:
        self._templates = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.own_template_workers, thread_name_prefix="llmlab-chat-template"
        )
        # Each thread waits for one worker process: as many threads as processes.
        self._request_templates = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.template_workers, thread_name_prefix="llmlab-request-template"
        )

    def _template_pool(self, request) -> concurrent.futures.ThreadPoolExecutor:
        """The request's own template renders apart from the server's."""
        if request.chat_template is not None and self.trust_request_chat_template:
            return self._request_templates
        return self._templates

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def _tokens_as_ids(self, request) -> bool:
        """``return_tokens_as_token_ids``: the request's, else the server's default."""
        return _default(request.return_tokens_as_token_ids, self.return_tokens_as_token_ids)

    def check_model(self, model: str | None) -> str:
        """The served name the request is for; 404 for a model this server does not serve."""
        if model is None or model == "":
            return self.model_names[0]
        try:
            check_encodable("model", model)
        except ValueError as err:
            raise APIError(str(err), param="model") from None
        if model not in self.model_names and (self.lora is None or self.lora.get(model) is None):
            raise APIError(
                f"The model `{model}` does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.model_names)}",
                status=404, param="model", code="model_not_found",
            )
        return model

    def _check_capacity(self, request, num_prompts: int, max_tokens: int | None = None,
                        known_prompt_tokens: int = 0) -> Ticket:
        """The request's size against the per-request limits, then its room in the
        server: a :class:`~llmlab.entrypoints.server.admission.Ticket` for the work it reserves
        (an estimate until :meth:`_settle`), or a 429."""
        if num_prompts > self.max_prompts_per_request:
            raise APIError(
                f"prompt has {num_prompts} prompts, more than the "
                f"{self.max_prompts_per_request} allowed per request", param="prompt",
            )
        per_prompt = _sequences_per_prompt(request)
        sequences = num_prompts * per_prompt
        if sequences > self.max_sequences_per_request:
            raise APIError(
                f"{num_prompts} prompt(s) x {per_prompt} sample(s) = {sequences} sequences, "
                f"more than the {self.max_sequences_per_request} allowed per request",
                param="n",
            )
        # Before tokenizing, prompt text counts as nothing (the estimate must not refuse
        # what fits); the exact weight replaces it once the prompts are tokenized.
        tokens = known_prompt_tokens + sequences * max(1, max_tokens or 1)
        return self.admission.admit(Weight(num_prompts, sequences, tokens))

    def _settle(self, ticket: Ticket, request, prompts: list[_Prompt],
                params_list: list[SamplingParams]) -> None:
        """The ticket's exact weight: per prompt, its tokens plus max_tokens per sequence."""
        per_prompt = _sequences_per_prompt(request)
        ticket.settle([
            Weight(1, per_prompt, len(prompt.token_ids) + per_prompt * params.max_tokens)
            for prompt, params in zip(prompts, params_list, strict=True)
        ])

    def _check_text(self, field: str, text: str) -> None:
        """The engine's check of prompt text (bounded, valid Unicode) before this server
        tokenizes it itself, as an API error."""
        try:
            check_prompt_text(field, text, self.max_model_len)
        except ValueError as err:
            raise APIError(str(err), param=field) from None

    def models(self) -> p.ModelList:
        created = p.now()
        return p.ModelList(
            data=[
                # root: the served name, not the server's filesystem path.
                p.ModelCard(id=name, created=created, root=self.model_names[0],
                            max_model_len=self.max_model_len)
                for name in self.model_names
            ] + ([] if self.lora is None else self.lora.cards(created, self.max_model_len))
        )

    # -- completions ---------------------------------------------------------------------

    async def completions(self, request: p.CompletionRequest, disconnected=None,
                          client: str | None = None):
        """A :class:`~llmlab.entrypoints.server.protocol.CompletionResponse`, or an async iterator of
        SSE lines when ``stream`` is set. ``client``: the peer's address (grammar compiles
        queue fairly per client)."""
        model = self.check_model(request.model)
        _unsupported(request)
        if request.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if request.echo and request.prompt_logprobs is not None:
            raise APIError("echo and prompt_logprobs cannot be combined; use one of them",
                           param="prompt_logprobs")
        _check_stream_prompt_logprobs(request)
        # echo with max_tokens=0 scores the prompt (HELM, lm-eval's loglikelihood): the
        # engine generates one token, which the response leaves out (as vLLM does).
        echo_only = bool(request.echo) and request.max_tokens == 0
        ticket = self._check_capacity(request, _num_prompts(request.prompt), request.max_tokens,
                                      _known_prompt_tokens(request.prompt))
        try:
            return await self._completions(request, model, echo_only, ticket, disconnected,
                                           client)
        except BaseException:
            ticket.release()  # what no stream took over
            raise

    async def _completions(self, request, model, echo_only, ticket, disconnected, client):
        prompts = await asyncio.to_thread(self._completion_prompts, request)
        params_list = [
            self._params(
                request, prompt, request.max_tokens,
                logprobs=request.logprobs,
                # echo with logprobs reports the prompt's tokens too
                prompt_logprobs=request.logprobs if request.echo and request.logprobs is not None
                else request.prompt_logprobs,
                stream=bool(request.stream), echo_only=echo_only,
            )
            for prompt in prompts
        ]
        self._settle(ticket, request, prompts, params_list)
        streams = await self._add_all(prompts, params_list, request, ticket, client)
        run = _CompletionRun(self.tokenizer, self._tokens_as_ids(request), request, model,
                             prompts, streams, echo_only=echo_only)
        if request.stream:
            return run.stream()
        return await _until_disconnected(run.collect(), streams, disconnected)

    def _completion_prompts(self, request: p.CompletionRequest) -> list[_Prompt]:
        raw = request.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise APIError("prompt is empty: give a string, a list of strings or token ids",
                           param="prompt")
        prompts = []
        for item in raw:
            if isinstance(item, str):
                if not item:
                    raise APIError("prompt is empty: it must contain at least one character",
                                   param="prompt")
                if self.tokenizer is None:
                    raise APIError("text prompts need a tokenizer", param="prompt")
                self._check_text("prompt", item)
                ids = self.tokenizer.encode(item, add_special_tokens=request.add_special_tokens)
                prompts.append(_Prompt(item, list(ids)))
            else:
                if not item:
                    raise APIError("prompt is empty: it must contain at least one token",
                                   param="prompt")
                vocab = self.engine.engine.vocab_size
                bad = [t for t in item if not 0 <= t < vocab]
                if bad:
                    raise APIError(
                        f"prompt contains token id {bad[0]}, outside the vocabulary [0, {vocab})",
                        param="prompt",
                    )
                prompts.append(_Prompt(None, list(item)))
        return prompts

    # -- chat ----------------------------------------------------------------------------

    async def chat(self, request: p.ChatCompletionRequest, disconnected=None,
                   client: str | None = None):
        model = self.check_model(request.model)
        _unsupported(request)
        tools, tool_mode = check_tools(request, self.tool_parser)
        structured = _structured(request)
        if tool_mode is not None and request.echo:
            raise APIError("echo is not supported with a tool_choice that calls a tool",
                           param="echo")
        if tool_mode is not None and tool_mode.kind != "auto":  # auto: the parser reads text
            if structured is not None:
                raise APIError(f"tool_choice {tool_mode.kind} constrains the output: it "
                               "excludes other structured-output constraints",
                               param="tool_choice")
            structured = tool_constraint(tools, tool_mode)
        if request.top_logprobs is not None:
            if not request.logprobs:
                raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
            if request.top_logprobs < 0:
                raise APIError(f"top_logprobs must be >= 0, got {request.top_logprobs}",
                               param="top_logprobs")
        _check_stream_prompt_logprobs(request)
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        ticket = self._check_capacity(request, 1, max_tokens)
        try:
            return await self._chat(request, model, structured, tool_mode, max_tokens, ticket,
                                    disconnected, client)
        except BaseException:
            ticket.release()  # what no stream took over
            raise

    async def _chat(self, request, model, structured, tool_mode, max_tokens, ticket,
                    disconnected, client):
        prompt = await self._render(request)
        params = self._params(
            request, prompt, max_tokens,
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=request.prompt_logprobs,
            stream=bool(request.stream), structured=structured,
        )
        self._settle(ticket, request, [prompt], [params])
        streams = await self._add_all([prompt], [params], request, ticket, client)
        echo = ""
        last = request.messages[-1]
        if request.echo and last.role == "assistant":
            echo = _message_text(last) or ""
        # vLLM's role: the server's response_role, or with no generation prompt (the model
        # continues the last message) that message's role
        role = self.response_role if request.add_generation_prompt else last.role
        run = _ChatRun(self.tokenizer, self._tokens_as_ids(request), request, model, prompt,
                       streams[0], echo, role, tool_mode)
        if request.stream:
            return run.stream()
        return await _until_disconnected(run.collect(), streams, disconnected)

    async def _render(self, request) -> _Prompt:
        """The request's chat prompt, rendered on the template threads within the timeout."""
        future = self._template_pool(request).submit(self._chat_prompt, request)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self._wait_s(request))
        except asyncio.TimeoutError:
            future.cancel()  # still queued behind other templates: never run it
            raise self._too_slow() from None

    def render_sync(self, request) -> _Prompt:
        """:meth:`_render` for callers already on a worker thread (``/tokenize``)."""
        future = self._template_pool(request).submit(self._chat_prompt, request)
        try:
            return future.result(timeout=self._wait_s(request))
        except concurrent.futures.TimeoutError:
            future.cancel()  # still queued behind other templates: never run it
            raise self._too_slow() from None

    def _too_slow(self) -> APIError:
        return APIError(
            f"the chat template took longer than {self.template_timeout_s:g} s to render",
            param="chat_template",
        )

    def _wait_s(self, request) -> float:
        """How long to wait for a render: a request's own template is bounded inside its
        worker process, whose first start (importing the tokenizer's libraries) is not
        the template's time."""
        extra = _WORKER_START_S if request.chat_template is not None else 0.0
        return self.template_timeout_s + extra

    def _template_processes(self) -> TemplateProcesses:
        with self._lock:
            if self._processes is None:
                self._processes = TemplateProcesses(self.tokenizer, self.template_workers)
            return self._processes

    def close(self) -> None:
        """Stop the template threads and worker processes (the app's shutdown)."""
        self._templates.shutdown(wait=False, cancel_futures=True)
        self._request_templates.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            self._processes.close()

    def _chat_prompt(self, request) -> _Prompt:
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise APIError(
                "this server does not accept a chat_template in requests (start it with "
                "--trust-request-chat-template to allow them)", param="chat_template",
            )
        messages = [
            {"role": m.role, "content": _message_text(m) or "",
             **({"name": m.name} if m.name else {}),
             **({"tool_calls": m.tool_calls} if m.tool_calls is not None else {}),
             **({"tool_call_id": m.tool_call_id} if m.tool_call_id is not None else {})}
            for m in request.messages
        ]
        template = request.chat_template
        if template is None:
            template = self.chat_template
        kwargs = request.chat_template_kwargs
        tools = template_tools(request)
        if tools:  # apply_chat_template's own tools= argument
            kwargs = {**(kwargs or {}), "tools": tools}
        args = (messages, template, request.add_generation_prompt,
                request.continue_final_message, kwargs,
                self.max_model_len * CHARS_PER_TOKEN)
        try:
            if request.chat_template is not None:  # the request's own code: a worker process
                rendered = self._template_processes().render(self.template_timeout_s, *args)
            else:
                rendered = render_chat(
                    self.tokenizer, args[0], chat_template=args[1],
                    add_generation_prompt=args[2], continue_final_message=args[3],
                    chat_template_kwargs=args[4], max_chars=args[5],
                )[0]
        except TemplateTimeout:
            raise self._too_slow() from None
        except (ValueError, TypeError) as err:
            raise bad_request(err, _fields(request)) from err
        except Exception as err:  # a Jinja error in a user's template: theirs to fix
            raise APIError(f"the chat template failed to render: {type(err).__name__}: {err}",
                           param="chat_template") from err
        return _Prompt(rendered["prompt"], rendered["prompt_token_ids"])

    # -- tokenizer endpoints -------------------------------------------------------------

    def tokenize(self, request: p.TokenizeRequest) -> p.TokenizeResponse:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if self.tokenizer is None:
            raise APIError("this server has no tokenizer")
        if request.messages is not None:
            if not request.messages:
                raise APIError("messages is empty", param="messages")
            ids = self.render_sync(request).token_ids
        else:
            self._check_text("prompt", request.prompt)
            ids = list(self.tokenizer.encode(request.prompt,
                                             add_special_tokens=request.add_special_tokens))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return p.TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                  token_strs=strs)

    def detokenize(self, request: p.DetokenizeRequest) -> p.DetokenizeResponse:
        self.check_model(request.model)
        if self.tokenizer is None:
            raise APIError("this server has no tokenizer")
        vocab = self.engine.engine.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens contains {bad[0]}, outside the vocabulary [0, {vocab})",
                           param="tokens")
        return p.DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))

    def tokenizer_info(self) -> p.TokenizerInfoResponse:
        """vLLM's ``/tokenizer_info``: the tokenizer's ``init_kwargs`` (special tokens as
        their text), ``tokenizer_class``, and the chat template this server renders with.
        Unlike vLLM it leaves out the tokenizer's files and directory (``name_or_path``,
        ...): this server does not show its filesystem."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise APIError("this server has no tokenizer")
        config = {k: _json_safe(v) for k, v in
                  dict(getattr(tokenizer, "init_kwargs", None) or {}).items()
                  if k not in _TOKENIZER_PATH_KEYS}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(tokenizer, name, None)
            if config.get(name) is None and value is not None:
                config[name] = _json_safe(value)
        config.setdefault("model_max_length", self.max_model_len)
        config["tokenizer_class"] = type(tokenizer).__name__
        template = self.chat_template
        if template is None:
            template = getattr(tokenizer, "chat_template", None)
        if template is not None:
            config["chat_template"] = template
        return p.TokenizerInfoResponse(**config)

    # -- shared --------------------------------------------------------------------------

    def _params(self, request, prompt: _Prompt, max_tokens, *, logprobs, prompt_logprobs,
                stream: bool, echo_only: bool = False,
                structured=_FROM_REQUEST) -> SamplingParams:
        fields = _fields(request)
        num_prompt = len(prompt.token_ids)
        if request.truncate_prompt_tokens is not None and request.truncate_prompt_tokens > 0:
            num_prompt = min(num_prompt, request.truncate_prompt_tokens)
        room = self.max_model_len - num_prompt
        # the field the limit came from, for the error (chat has two names for it)
        name = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) \
            is not None else "max_tokens"
        if echo_only:
            # max_tokens=0 with echo: the engine (max_tokens >= 1) generates one token that
            # the response drops, so the prompt may fill the whole context.
            if num_prompt > self.max_model_len:
                raise APIError(
                    f"the prompt has {num_prompt} tokens, more than this model's maximum "
                    f"context length of {self.max_model_len} tokens", param="prompt")
            max_tokens = 1
        elif max_tokens is None:
            if room < 1:
                raise APIError(
                    f"the prompt has {num_prompt} tokens, which leaves no room to generate "
                    f"within this model's maximum context length of {self.max_model_len} "
                    "tokens", param="messages" if "messages" in fields else "prompt")
            max_tokens = room
        elif max_tokens < 1:
            hint = " (0 only with echo, to score the prompt)" if max_tokens == 0 \
                and isinstance(request, p.CompletionRequest) else ""
            raise APIError(f"{name} must be at least 1{hint}, got {max_tokens}", param=name)
        elif num_prompt + max_tokens > self.max_model_len:
            raise APIError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt + max_tokens} were requested ({num_prompt} in the prompt and "
                f"{max_tokens} to generate); shorten the prompt or lower {name}", param=name)
        defaults = self.engine.engine.default_sampling_params
        if structured is _FROM_REQUEST:
            structured = _structured(request)
        try:
            return SamplingParams(
                n=_default(request.n, 1),
                best_of=request.best_of,
                presence_penalty=_default(request.presence_penalty, 0.0),
                frequency_penalty=_default(request.frequency_penalty, 0.0),
                repetition_penalty=_default(request.repetition_penalty,
                                            defaults.repetition_penalty),
                temperature=_default(request.temperature, defaults.temperature),
                top_p=_default(request.top_p, defaults.top_p),
                top_k=_default(request.top_k, defaults.top_k),
                min_p=_default(request.min_p, defaults.min_p),
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                bad_words=request.bad_words,
                include_stop_str_in_output=request.include_stop_str_in_output,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=0 if echo_only else request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                logit_bias=_logit_bias(request.logit_bias),
                allowed_token_ids=request.allowed_token_ids,
                truncate_prompt_tokens=request.truncate_prompt_tokens,
                structured_outputs=structured,
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
                extra_args=getattr(request, "vllm_xargs", None),
            )
        except (ValueError, TypeError) as err:
            raise bad_request(err, fields) from err

    async def _add_all(self, prompts: list[_Prompt], params_list, request,
                       ticket: Ticket, client: str | None = None) -> list[RequestStream]:
        base = p.random_id("req")
        streams: list[RequestStream] = []
        # A request whose model names a served LoRA adapter runs with it.
        lora = None if self.lora is None else self.lora.get(request.model)
        extra = {} if lora is None else {"lora_request": lora}
        if client is not None:  # the peer, not the client-chosen `user`, keys fairness
            extra["client"] = client
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                engine_prompt = {"prompt_token_ids": prompt.token_ids}
                if prompt.text is not None:
                    engine_prompt["prompt"] = prompt.text
                stream = await self.engine.add_request(
                    f"{base}-{i}", engine_prompt, params,
                    priority=request.priority, user=request.user, **extra,
                )
                # The stream holds prompt i's part of the reservation until it ends.
                ticket.attach(stream, i)
                streams.append(stream)
        except (ValueError, TypeError) as err:
            for stream in streams:
                stream.abort()
            raise bad_request(err, _fields(request)) from err
        except EngineDeadError as err:
            for stream in streams:
                stream.abort()
            raise APIError(str(err), status=503, type="server_error") from err
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams


# init_kwargs that name the tokenizer's files or where it was loaded from.
_TOKENIZER_PATH_KEYS = frozenset({
    "vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local",
    "local_files_only", "cache_dir", "_commit_hash", "token",
})


def _json_safe(value):
    """A tokenizer setting as JSON: AddedToken as its text (as vLLM), containers
    recursively, anything else unknown as its ``str``."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _check_stream_prompt_logprobs(request) -> None:
    """vLLM's rule: ``prompt_logprobs`` has no place in a streamed response."""
    if request.stream and request.prompt_logprobs is not None and request.prompt_logprobs != 0:
        raise APIError("prompt_logprobs are not available when stream=true",
                       param="prompt_logprobs")


def _sequences_per_prompt(request) -> int:
    return max(request.n or 1, getattr(request, "best_of", None) or 1)


def _known_prompt_tokens(prompt) -> int:
    """The tokens of the prompts given as token ids (text is counted once tokenized)."""
    if not prompt or isinstance(prompt, str):
        return 0
    if isinstance(prompt[0], int):
        return len(prompt)
    return sum(len(item) for item in prompt if not isinstance(item, str))


def _num_prompts(prompt) -> int:
    """How many prompts a completion request's ``prompt`` holds (one string, one id list,
    or a list of either)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)

"""Turn OpenAI requests into engine requests, and engine outputs into OpenAI responses.

Everything a request can get wrong is found here, before anything reaches the engine:
the model name, the prompt, token counts against the model length, every sampling field
(through :class:`~llmlab.sampling.params.SamplingParams`' own checks) and the structured
output constraint (compiled while the request is prepared). Each is an :class:`APIError`
with OpenAI's error shape. A request with several prompts is added only when all of them
are valid; if adding one fails, the ones already added are aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import attrs

from llmlab.engine.async_engine import AsyncEngine, EngineDeadError, EngineError, RequestStream
from llmlab.engine.outputs import RequestOutput
from llmlab.errors import RequestFailedError
from llmlab.llm import render_chat
from llmlab.sampling.params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from llmlab.server import protocol as p

logger = logging.getLogger(__name__)

# JSON has no -inf: a token with probability 0 is reported with this logprob (as vLLM does).
_MIN_LOGPROB = -9999.0


class APIError(Exception):
    """An error to send as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: int | str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = status if code is None else code

    def body(self) -> dict:
        info = p.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return p.ErrorResponse(error=info).model_dump()


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


def bad_request(err: Exception, fields: Sequence[str] = ()) -> APIError:
    """A 400 for a ``ValueError``/``TypeError`` raised by the engine or ``SamplingParams``;
    ``param`` is the request field the message starts with, when it names one."""
    message = " ".join(str(err).split()) or type(err).__name__
    match = re.match(r"[`'\"]?([A-Za-z_][A-Za-z0-9_]*)", message)
    param = match.group(1) if match and match.group(1) in fields else None
    return APIError(message, param=param)


@attrs.define
class _Prompt:
    text: str | None
    token_ids: list[int]


@attrs.define
class OpenAIServing:
    """The endpoints' logic, independent of the web framework."""

    engine: AsyncEngine
    model_names: list[str]
    model_path: str | None = None
    chat_template: str | None = None

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_model(self, model: str | None) -> str:
        """The served name the request is for; 404 for a model this server does not serve."""
        if model is None or model == "":
            return self.model_names[0]
        if model not in self.model_names:
            raise APIError(
                f"The model `{model}` does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.model_names)}",
                status=404, param="model", code="model_not_found",
            )
        return model

    def models(self) -> p.ModelList:
        created = p.now()
        return p.ModelList(
            data=[
                p.ModelCard(id=name, created=created, root=self.model_path,
                            max_model_len=self.max_model_len)
                for name in self.model_names
            ]
        )

    # -- completions ---------------------------------------------------------------------

    async def completions(self, request: p.CompletionRequest, disconnected=None):
        """A :class:`~llmlab.server.protocol.CompletionResponse`, or an async iterator of
        SSE lines when ``stream`` is set."""
        model = self.check_model(request.model)
        _unsupported(request)
        if request.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if request.echo and request.prompt_logprobs is not None:
            raise APIError("echo and prompt_logprobs cannot be combined; use one of them",
                           param="prompt_logprobs")
        prompts = await asyncio.to_thread(self._completion_prompts, request)
        params_list = [
            self._params(
                request, prompt, request.max_tokens,
                logprobs=request.logprobs,
                # echo with logprobs reports the prompt's tokens too
                prompt_logprobs=request.logprobs if request.echo and request.logprobs is not None
                else request.prompt_logprobs,
                stream=bool(request.stream),
            )
            for prompt in prompts
        ]
        streams = await self._add_all(prompts, params_list, request)
        run = _CompletionRun(self, request, model, prompts, streams)
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

    async def chat(self, request: p.ChatCompletionRequest, disconnected=None):
        model = self.check_model(request.model)
        _unsupported(request)
        if request.tools and request.tool_choice != "none":
            raise APIError("tools (function calling) are not supported by this server",
                           param="tools")
        if request.top_logprobs is not None:
            if not request.logprobs:
                raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
            if request.top_logprobs < 0:
                raise APIError(f"top_logprobs must be >= 0, got {request.top_logprobs}",
                               param="top_logprobs")
        prompt = await asyncio.to_thread(self._chat_prompt, request)
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        params = self._params(
            request, prompt, max_tokens,
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=request.prompt_logprobs,
            stream=bool(request.stream),
        )
        streams = await self._add_all([prompt], [params], request)
        echo = ""
        last = request.messages[-1]
        if request.echo and last.role == "assistant":
            echo = _message_text(last) or ""
        run = _ChatRun(self, request, model, prompt, streams[0], echo)
        if request.stream:
            return run.stream()
        return await _until_disconnected(run.collect(), streams, disconnected)

    def _chat_prompt(self, request) -> _Prompt:
        messages = [
            {"role": m.role, "content": _message_text(m) or "",
             **({"name": m.name} if m.name else {})}
            for m in request.messages
        ]
        template = request.chat_template if request.chat_template is not None else self.chat_template
        try:
            rendered = render_chat(
                self.tokenizer, messages, chat_template=template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs,
            )[0]
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
            ids = self._chat_prompt(request).token_ids
        else:
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

    # -- shared --------------------------------------------------------------------------

    def _params(self, request, prompt: _Prompt, max_tokens, *, logprobs, prompt_logprobs,
                stream: bool) -> SamplingParams:
        fields = _fields(request)
        num_prompt = len(prompt.token_ids)
        if request.truncate_prompt_tokens is not None and request.truncate_prompt_tokens > 0:
            num_prompt = min(num_prompt, request.truncate_prompt_tokens)
        room = self.max_model_len - num_prompt
        # the field the limit came from, for the error (chat has two names for it)
        name = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) \
            is not None else "max_tokens"
        if max_tokens is None:
            if room < 1:
                raise APIError(
                    f"the prompt has {num_prompt} tokens, which leaves no room to generate "
                    f"within this model's maximum context length of {self.max_model_len} "
                    "tokens", param="messages" if "messages" in fields else "prompt")
            max_tokens = room
        elif max_tokens < 1:
            raise APIError(f"{name} must be at least 1, got {max_tokens}", param=name)
        elif num_prompt + max_tokens > self.max_model_len:
            raise APIError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt + max_tokens} were requested ({num_prompt} in the prompt and "
                f"{max_tokens} to generate); shorten the prompt or lower {name}", param=name)
        defaults = self.engine.engine.default_sampling_params
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
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                logit_bias=_logit_bias(request.logit_bias),
                allowed_token_ids=request.allowed_token_ids,
                truncate_prompt_tokens=request.truncate_prompt_tokens,
                structured_outputs=_structured(request),
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            )
        except (ValueError, TypeError) as err:
            raise bad_request(err, fields) from err

    async def _add_all(self, prompts: list[_Prompt], params_list, request) -> list[RequestStream]:
        base = p.random_id("req")
        streams: list[RequestStream] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                engine_prompt = {"prompt_token_ids": prompt.token_ids}
                if prompt.text is not None:
                    engine_prompt["prompt"] = prompt.text
                streams.append(await self.engine.add_request(
                    f"{base}-{i}", engine_prompt, params,
                    priority=request.priority, user=request.user,
                ))
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


# -- runs: one request's responses ---------------------------------------------------------


@attrs.define
class _CompletionRun:
    serving: OpenAIServing
    request: p.CompletionRequest
    model: str
    prompts: list[_Prompt]
    streams: list[RequestStream]
    id: str = attrs.field(factory=lambda: p.random_id("cmpl"))
    created: int = attrs.field(factory=p.now)

    @property
    def n(self) -> int:
        return _default(self.request.n, 1)

    def _prompt_text(self, i: int) -> str:
        prompt = self.prompts[i]
        if prompt.text is not None:
            return prompt.text
        return self.serving.tokenizer.decode(prompt.token_ids) if self.serving.tokenizer else ""

    async def collect(self) -> p.CompletionResponse:
        finals = await asyncio.gather(*(_last(s) for s in self.streams))
        choices = []
        completion_tokens = 0
        for i, out in enumerate(finals):
            for c in out.outputs:
                text = c.text
                logprobs = None
                if self.request.logprobs is not None:
                    logprobs = _LogprobText(self.serving.tokenizer)
                    if self.request.echo:
                        logprobs.add(self.prompts[i].token_ids, out.prompt_logprobs,
                                     self.request.logprobs)
                    logprobs.add(c.token_ids, c.logprobs, self.request.logprobs)
                    logprobs = logprobs.result
                if self.request.echo:
                    text = self._prompt_text(i) + text
                choices.append(p.CompletionChoice(
                    index=i * self.n + c.index, text=text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                ))
                completion_tokens += len(c.token_ids)
        choices.sort(key=lambda c: c.index)
        prompt_tokens = sum(len(pr.token_ids) for pr in self.prompts)
        return p.CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices,
            usage=_usage(prompt_tokens, completion_tokens),
        )

    async def stream(self) -> AsyncIterator[str]:
        completion_tokens = 0
        echoed: set[int] = set()
        offsets: dict[int, _LogprobText] = {}
        try:
            async for i, out in _merge(self.streams):
                for c in out.outputs:
                    index = i * self.n + c.index
                    text = c.text
                    if self.request.echo and index not in echoed:
                        echoed.add(index)
                        text = self._prompt_text(i) + text
                    logprobs = None
                    if self.request.logprobs is not None:
                        lp = offsets.setdefault(index, _LogprobText(self.serving.tokenizer))
                        lp.reset()
                        if self.request.echo and out.prompt_logprobs is not None:
                            lp.add(self.prompts[i].token_ids, out.prompt_logprobs,
                                   self.request.logprobs)
                        lp.add(c.token_ids, c.logprobs, self.request.logprobs)
                        logprobs = lp.result
                    completion_tokens += len(c.token_ids)
                    if not (text or c.finish_reason or logprobs):
                        continue  # the detokenizer holds back half a character: nothing to say
                    chunk = p.CompletionStreamResponse(
                        id=self.id, created=self.created, model=self.model,
                        choices=[p.CompletionChoice(
                            index=index, text=text, logprobs=logprobs,
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)],
                    )
                    yield _sse(chunk)
            if _include_usage(self.request):
                prompt_tokens = sum(len(pr.token_ids) for pr in self.prompts)
                yield _sse(p.CompletionStreamResponse(
                    id=self.id, created=self.created, model=self.model, choices=[],
                    usage=_usage(prompt_tokens, completion_tokens)))
        except Exception as err:  # noqa: BLE001 - the stream has started: the error goes in-band
            yield _sse_error(err)
        finally:
            for s in self.streams:
                s.abort()
        yield "data: [DONE]\n\n"


@attrs.define
class _ChatRun:
    serving: OpenAIServing
    request: p.ChatCompletionRequest
    model: str
    prompt: _Prompt
    stream_: RequestStream
    echo: str = ""
    id: str = attrs.field(factory=lambda: p.random_id("chatcmpl"))
    created: int = attrs.field(factory=p.now)

    def _logprobs(self, c) -> p.ChatLogProbs | None:
        if not self.request.logprobs:
            return None
        return _chat_logprobs(self.serving.tokenizer, c.token_ids, c.logprobs,
                              self.request.top_logprobs or 0)

    async def collect(self) -> p.ChatCompletionResponse:
        out = await _last(self.stream_)
        choices = [
            p.ChatChoice(
                index=c.index,
                message=p.ChatMessage(role="assistant", content=self.echo + c.text),
                logprobs=self._logprobs(c),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            )
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return p.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices,
            usage=_usage(len(self.prompt.token_ids), completion_tokens),
        )

    async def stream(self) -> AsyncIterator[str]:
        n = _default(self.request.n, 1)
        completion_tokens = 0

        def chunk(choices, usage=None) -> str:
            return _sse(p.ChatCompletionStreamResponse(
                id=self.id, created=self.created, model=self.model, choices=choices, usage=usage))

        try:
            # OpenAI opens each choice with the assistant's role and no content yet.
            for index in range(n):
                yield chunk([p.ChatStreamChoice(
                    index=index, delta=p.DeltaMessage(role="assistant", content=""))])
            if self.echo:
                for index in range(n):
                    yield chunk([p.ChatStreamChoice(
                        index=index, delta=p.DeltaMessage(content=self.echo))])
            async for out in self.stream_:
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if not (c.text or c.finish_reason or self.request.logprobs):
                        continue  # the detokenizer holds back half a character: nothing to say
                    yield chunk([p.ChatStreamChoice(
                        index=c.index, delta=p.DeltaMessage(content=c.text),
                        logprobs=self._logprobs(c),
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
            if _include_usage(self.request):
                yield chunk([], _usage(len(self.prompt.token_ids), completion_tokens))
        except Exception as err:  # noqa: BLE001 - sent in-band, as above
            yield _sse_error(err)
        finally:
            self.stream_.abort()
        yield "data: [DONE]\n\n"


# -- helpers -------------------------------------------------------------------------------


def _default(value, default):
    return default if value is None else value


def _fields(request) -> tuple[str, ...]:
    return tuple(type(request).model_fields)


def _unsupported(request) -> None:
    if request.use_beam_search:
        raise APIError("use_beam_search is not supported by the server; use LLM.beam_search",
                       param="use_beam_search")


def _message_text(message: p.ChatMessageParam) -> str | None:
    content = message.content
    if content is None or isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(f"only text content parts are supported, got type {part.type!r}",
                           param="messages")
        parts.append(part.text)
    return "\n".join(parts)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise APIError(f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                           param="logit_bias") from None
    return out


def _structured(request) -> StructuredOutputsParams | None:
    """The one structured-output constraint of a request, from any of its spellings."""
    found: list[tuple[str, dict]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError("response_format of type json_schema needs json_schema.schema",
                           param="response_format")
        found.append(("response_format", {"json": fmt.json_schema.json_schema}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            found.append((name, {key: value}))
    if request.structured_outputs is not None:
        given = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(("structured_outputs", given))
    if not found:
        return None
    if len(found) > 1:
        raise APIError(
            f"give one structured-output constraint, got {', '.join(n for n, _ in found)}",
            param=found[1][0])
    name, kwargs = found[0]
    if "json" in kwargs and isinstance(kwargs["json"], str):
        try:
            kwargs["json"] = json.loads(kwargs["json"])
        except json.JSONDecodeError as err:
            raise APIError(f"{name}: the JSON schema is not valid JSON: {err}", param=name) from None
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as err:
        raise APIError(f"{name}: {err}", param=name) from err


def _usage(prompt_tokens: int, completion_tokens: int) -> p.UsageInfo:
    return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       total_tokens=prompt_tokens + completion_tokens)


def _include_usage(request) -> bool:
    return bool(request.stream_options and request.stream_options.include_usage)


def _sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _sse_error(err: Exception) -> str:
    if isinstance(err, APIError):
        api = err
    elif isinstance(err, RequestFailedError):
        api = APIError(str(err), status=400)
    elif isinstance(err, (EngineError, EngineDeadError)):
        api = APIError(str(err), status=503, type="server_error")
    else:
        logger.exception("a streamed response failed")
        api = APIError(f"internal error: {type(err).__name__}", status=500, type="server_error")
    return f"data: {json.dumps(api.body())}\n\n"


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


async def _last(stream: RequestStream) -> RequestOutput:
    final = None
    async for out in stream:
        final = out
    if final is None:
        raise APIError("the request was aborted", status=503, type="server_error")
    return final


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as err:  # noqa: BLE001 - handed to the reader, who raises it
            await queue.put((i, err))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _until_disconnected(
    work: Awaitable, streams: list[RequestStream], disconnected
) -> Any:
    """Await ``work``, unless the client disconnects first: then abort its requests.

    ``disconnected`` is an async callable that returns when the client has gone."""
    if disconnected is None:
        return await work
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    for stream in streams:
        stream.abort()
    raise ClientDisconnected


class _LogprobText:
    """Completions-style logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.offset = 0
        self.reset()

    def reset(self) -> None:
        self.result = p.CompletionLogProbs()

    def add(self, token_ids, positions, k: int) -> None:
        if positions is None:
            return
        for token_id, position in zip(token_ids, positions, strict=False):
            if position is None:  # the first prompt token has no logprob
                text = _token_text(self.tokenizer, token_id, None)
                self.result.tokens.append(text)
                self.result.token_logprobs.append(None)
                self.result.top_logprobs.append(None)
            else:
                chosen = position.get(token_id)
                text = _token_text(self.tokenizer, token_id, chosen)
                self.result.tokens.append(text)
                self.result.token_logprobs.append(
                    _finite(chosen.logprob) if chosen is not None else _MIN_LOGPROB)
                top = {}
                for tid, lp in sorted(position.items(), key=lambda kv: kv[1].rank):
                    if lp.rank <= k or tid == token_id:
                        top.setdefault(_token_text(self.tokenizer, tid, lp), _finite(lp.logprob))
                self.result.top_logprobs.append(top)
            self.result.text_offset.append(self.offset)
            self.offset += len(text)


def _token_text(tokenizer, token_id: int, logprob) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def _chat_logprobs(tokenizer, token_ids, positions, k: int) -> p.ChatLogProbs:
    content = []
    for token_id, position in zip(token_ids, positions or (), strict=False):
        chosen = position.get(token_id)
        text = _token_text(tokenizer, token_id, chosen)
        top = [
            p.ChatLogProb(token=(t := _token_text(tokenizer, tid, lp)),
                          logprob=_finite(lp.logprob), bytes=list(t.encode("utf-8")))
            for tid, lp in sorted(position.items(), key=lambda kv: kv[1].rank)
            if lp.rank <= k
        ][:k]
        content.append(p.ChatLogProbsContent(
            token=text,
            logprob=_finite(chosen.logprob) if chosen is not None else _MIN_LOGPROB,
            bytes=list(text.encode("utf-8")),
            top_logprobs=top,
        ))
    return p.ChatLogProbs(content=content)

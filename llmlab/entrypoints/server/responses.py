"""Engine outputs as OpenAI responses: one run per request (:class:`_CompletionRun`,
:class:`_ChatRun`) collects its outputs into one response or streams them as server-sent
events; errors after a stream has started go in-band.

The streamed chunks are the hot path of a busy server (one per request per engine step):
each is a plain dict in the JSON shape of its protocol model (``CompletionStreamResponse``,
``ChatCompletionStreamResponse``), serialized by orjson, with no pydantic model built per
chunk; full responses still go through the models. A run reads its request's stream of
DELTA outputs, which the engine coalesces while the run has not taken the previous one, so
a client that reads slower than the engine steps gets fewer, larger chunks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import attrs
import orjson

from llmlab.distributed.data_parallel import ReplicaFailedError, ReplicasDeadError
from llmlab.entrypoints.async_engine import EngineDeadError, EngineError, RequestStream
from llmlab.engine.outputs import RequestOutput
from llmlab.errors import RequestFailedError
from llmlab.entrypoints.server import protocol as p
from llmlab.entrypoints.server.errors import APIError, ClientDisconnected
from llmlab.entrypoints.server.logprobs import _chat_logprobs, _LogprobText, _prompt_logprobs
from llmlab.entrypoints.server.request_params import _default
from llmlab.entrypoints.server.tools import ToolMode, ToolStreamer, final_message, finish_reason

logger = logging.getLogger(__name__)


@attrs.define
class _Prompt:
    """A prompt as the engine takes it: its text (None when given as token ids) and ids."""

    text: str | None
    token_ids: list[int]


@attrs.define
class _CompletionRun:
    tokenizer: Any  # the server's (None: it has none)
    as_ids: bool  # logprob tokens as "token_id:{id}" (return_tokens_as_token_ids, resolved)
    request: p.CompletionRequest
    model: str
    prompts: list[_Prompt]
    streams: list[RequestStream]
    # echo with max_tokens=0: each choice is the prompt alone (its one generated token and
    # that token's logprobs are dropped), finish_reason "length", no completion tokens
    echo_only: bool = False
    id: str = attrs.field(factory=lambda: p.random_id("cmpl"))
    created: int = attrs.field(factory=p.now)

    @property
    def n(self) -> int:
        return _default(self.request.n, 1)

    def _prompt_text(self, i: int) -> str:
        prompt = self.prompts[i]
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids) if self.tokenizer else ""

    async def collect(self) -> p.CompletionResponse:
        finals = await asyncio.gather(*(_last(s) for s in self.streams))
        choices = []
        completion_tokens = 0
        tokenizer = self.tokenizer
        for i, out in enumerate(finals):
            prompt_logprobs = None
            if self.request.prompt_logprobs is not None:
                prompt_logprobs = _prompt_logprobs(tokenizer, out.prompt_logprobs)
            for c in out.outputs:
                text = "" if self.echo_only else c.text
                logprobs = None
                if self.request.logprobs is not None:
                    logprobs = _LogprobText(tokenizer, self.as_ids)
                    if self.request.echo:
                        logprobs.add(out.prompt_token_ids, out.prompt_logprobs,
                                     self.request.logprobs)
                    if not self.echo_only:
                        logprobs.add(c.token_ids, c.logprobs, self.request.logprobs)
                    logprobs = logprobs.result
                if self.request.echo:
                    text = self._prompt_text(i) + text
                finish_reason, stop_reason = c.finish_reason, c.stop_reason
                if self.echo_only:
                    finish_reason, stop_reason = "length", None
                else:
                    completion_tokens += len(c.token_ids)
                choices.append(p.CompletionChoice(
                    index=i * self.n + c.index, text=text, logprobs=logprobs,
                    finish_reason=finish_reason, stop_reason=stop_reason,
                    prompt_logprobs=prompt_logprobs,
                ))
        choices.sort(key=lambda c: c.index)
        prompt_tokens = sum(len(pr.token_ids) for pr in self.prompts)
        return p.CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices,
            usage=_usage(prompt_tokens, completion_tokens),
        )

    async def stream(self) -> AsyncIterator[bytes]:
        completion_tokens = 0
        head = {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model}
        echoed: set[int] = set()
        prompt_sent: set[int] = set()
        continuous = _continuous_usage(self.request)
        so_far: dict[int, int] = {}  # completion tokens per choice, for continuous usage
        offsets: dict[int, _LogprobText] = {}
        # the prompt's logprobs come with a prompt's first output only
        prompt_positions: dict[int, list] = {}
        try:
            async for i, out in _merge(self.streams):
                if out.prompt_logprobs is not None:
                    prompt_positions.setdefault(i, out.prompt_logprobs)
                for c in out.outputs:
                    index = i * self.n + c.index
                    text, token_ids, positions = c.text, c.token_ids, c.logprobs
                    finish_reason, stop_reason = c.finish_reason, c.stop_reason
                    if self.echo_only:
                        if not c.finish_reason:
                            continue
                        text, token_ids, positions = "", [], []
                        finish_reason, stop_reason = "length", None
                    if self.request.echo and index not in echoed:
                        echoed.add(index)
                        text = self._prompt_text(i) + text
                    logprobs = None
                    if self.request.logprobs is not None:
                        lp = offsets.setdefault(
                            index, _LogprobText(self.tokenizer, self.as_ids))
                        lp.reset()
                        if self.request.echo and index not in prompt_sent:
                            prompt_sent.add(index)
                            lp.add(out.prompt_token_ids, prompt_positions.get(i),
                                   self.request.logprobs)
                        lp.add(token_ids, positions, self.request.logprobs)
                        logprobs = lp.result
                    completion_tokens += len(token_ids)
                    so_far[index] = so_far.get(index, 0) + len(token_ids)
                    if not (text or finish_reason or logprobs):
                        continue  # the detokenizer holds back half a character: nothing to say
                    yield _sse_json({
                        **head,
                        "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                     "finish_reason": finish_reason, "stop_reason": stop_reason}],
                        "usage": _usage_dict(len(out.prompt_token_ids), so_far[index])
                        if continuous else None,
                    })
            if _include_usage(self.request):
                prompt_tokens = sum(len(pr.token_ids) for pr in self.prompts)
                yield _sse_json({**head, "choices": [],
                                 "usage": _usage_dict(prompt_tokens, completion_tokens)})
        except Exception as err:  # noqa: BLE001 - the stream has started: the error goes in-band
            yield _sse_error(err)
        finally:
            for s in self.streams:
                s.abort()
        yield _DONE


@attrs.define
class _ChatRun:
    tokenizer: Any  # the server's (None: it has none)
    as_ids: bool  # logprob tokens as "token_id:{id}" (return_tokens_as_token_ids, resolved)
    request: p.ChatCompletionRequest
    model: str
    prompt: _Prompt
    stream_: RequestStream
    echo: str = ""
    role: str = "assistant"
    tool_mode: ToolMode | None = None  # a named, required or auto tool_choice (tools.py)
    id: str = attrs.field(factory=lambda: p.random_id("chatcmpl"))
    created: int = attrs.field(factory=p.now)

    def _logprobs(self, c) -> dict | None:
        if not self.request.logprobs:
            return None
        return _chat_logprobs(self.tokenizer, c.token_ids, c.logprobs,
                              self.request.top_logprobs or 0, as_ids=self.as_ids)

    def _finish_reason(self, reason: str | None, called: bool = False) -> str | None:
        """vLLM's: "tool_calls" when a tool_choice made calls (tools.finish_reason)."""
        return finish_reason(self.tool_mode, reason, called)

    def _message(self, c) -> p.ChatMessage:
        content, calls = final_message(self.tool_mode, c.text)
        if calls is None:
            return p.ChatMessage(role=self.role, content=self.echo + content)
        return p.ChatMessage(role=self.role, content=content, tool_calls=calls)

    async def collect(self) -> p.ChatCompletionResponse:
        out = await _last(self.stream_)
        choices = [
            p.ChatChoice(
                index=c.index,
                message=(message := self._message(c)),
                logprobs=self._logprobs(c),
                finish_reason=self._finish_reason(c.finish_reason, bool(message.tool_calls)),
                stop_reason=c.stop_reason,
            )
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        prompt_logprobs = None
        if self.request.prompt_logprobs is not None:
            prompt_logprobs = _prompt_logprobs(self.tokenizer, out.prompt_logprobs)
        return p.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices,
            usage=_usage(len(self.prompt.token_ids), completion_tokens),
            prompt_logprobs=prompt_logprobs,
        )

    async def stream(self) -> AsyncIterator[bytes]:
        n = _default(self.request.n, 1)
        completion_tokens = 0

        num_prompt = len(self.prompt.token_ids)
        continuous = _continuous_usage(self.request)
        so_far = [0] * n  # completion tokens per choice, for continuous usage
        tool_streams = [ToolStreamer(self.tool_mode) for _ in range(n)] \
            if self.tool_mode is not None else None

        head = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model}

        def chunk(choices, usage=None) -> bytes:
            if usage is None and continuous and choices:
                usage = _usage_dict(num_prompt, so_far[choices[0]["index"]])
            return _sse_json({**head, "choices": choices, "usage": usage})

        try:
            # OpenAI opens each choice with the assistant's role and no content yet.
            for index in range(n):
                yield chunk([_chat_choice(index, _delta(role=self.role, content=""))])
            if self.echo:
                for index in range(n):
                    yield chunk([_chat_choice(index, _delta(content=self.echo))])
            async for out in self.stream_:
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    so_far[c.index] += len(c.token_ids)
                    if tool_streams is not None:
                        content, calls = tool_streams[c.index].feed(
                            c.text, final=c.finish_reason is not None)
                        delta = p.DeltaMessage(content=content or None, tool_calls=calls) \
                            if calls else _delta(content=content or None)
                        if not (content or calls or c.finish_reason or self.request.logprobs):
                            continue
                    else:
                        delta = _delta(content=c.text)
                        if not (c.text or c.finish_reason or self.request.logprobs):
                            continue  # the detokenizer holds back half a character
                    yield chunk([_chat_choice(
                        index=c.index, delta=delta, logprobs=self._logprobs(c),
                        finish_reason=self._finish_reason(
                            c.finish_reason,
                            tool_streams is not None and tool_streams[c.index].called),
                        stop_reason=c.stop_reason)])
            if _include_usage(self.request):
                yield chunk([], _usage_dict(len(self.prompt.token_ids), completion_tokens))
        except Exception as err:  # noqa: BLE001 - sent in-band, as above
            yield _sse_error(err)
        finally:
            self.stream_.abort()
        yield _DONE


def _usage(prompt_tokens: int, completion_tokens: int) -> p.UsageInfo:
    return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       total_tokens=prompt_tokens + completion_tokens)


def _usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    """:func:`_usage` as the plain dict a streamed chunk carries."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _delta(role: str | None = None, content: str | None = None) -> dict:
    """A chat chunk's ``delta`` (``DeltaMessage``'s JSON shape)."""
    return {"role": role, "content": content, "tool_calls": None}


def _chat_choice(index: int, delta, logprobs: dict | None = None,
                 finish_reason: str | None = None, stop_reason=None) -> dict:
    """One choice of a chat chunk: ``ChatStreamChoice``'s arguments and JSON shape;
    ``delta`` a dict from :func:`_delta` or a ``DeltaMessage`` (tool calls; serialized by
    :func:`_json_default`)."""
    return {"index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def _include_usage(request) -> bool:
    """A last chunk with the whole request's usage (also with continuous usage)."""
    return bool(request.stream_options and request.stream_options.include_usage) \
        or _continuous_usage(request)


def _continuous_usage(request) -> bool:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries its choice's
    usage so far (the prompt's tokens, and the choice's completion tokens until then). As
    in vLLM, where ``include_usage`` defaults to true, only an explicit
    ``include_usage: false`` turns it off."""
    options = request.stream_options
    if not (options and options.continuous_usage_stats):
        return False
    return bool(options.include_usage) or "include_usage" not in options.model_fields_set


_DONE = b"data: [DONE]\n\n"


def _json_default(value):
    """What orjson cannot serialize itself: a protocol model (the tool-call deltas) as its
    JSON-mode dump, an array or numpy scalar as its list or number."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot serialize {type(value).__name__} as JSON")


def _sse_json(chunk: dict) -> bytes:
    """One server-sent event holding ``chunk`` as JSON."""
    return b"data: " + orjson.dumps(chunk, default=_json_default) + b"\n\n"


def _sse_error(err: Exception) -> bytes:
    if isinstance(err, APIError):
        api = err
    elif isinstance(err, ReplicaFailedError):  # its replica died: the server's fault
        api = APIError(str(err), status=503, type="server_error")
    elif isinstance(err, RequestFailedError):
        api = APIError(str(err), status=400)
    elif isinstance(err, (EngineError, EngineDeadError, ReplicasDeadError)):
        api = APIError(str(err), status=503, type="server_error")
    else:
        logger.exception("a streamed response failed")
        api = APIError(f"internal error: {type(err).__name__}", status=500, type="server_error")
    return _sse_json(api.body())


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
    # Bounded, so a pump waits for the reader instead of draining its stream: outputs then
    # stay in the stream, which coalesces them (RequestStream), rather than queueing here.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
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

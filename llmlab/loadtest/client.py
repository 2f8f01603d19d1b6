"""The load test's HTTP client: send every request, streamed, at its arrival time, and time
its chunks (:func:`benchmark`)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import orjson

from llmlab.loadtest.config import BenchConfig
from llmlab.loadtest.datasets import BenchRequest, arrival_offsets_s, sample_requests
from llmlab.loadtest.report import RequestResult, summarize

if TYPE_CHECKING:  # imported where used, so `llmlab` starts without the HTTP clients
    import aiohttp
    import httpx


def _sse_data(line: str) -> str:
    """The payload of an SSE ``data:`` line; "" for blank lines, comments and other fields."""
    return line[5:].strip() if line.startswith("data:") else ""


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or [{}]
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _error_text(error: object) -> str:
    if isinstance(error, dict):
        error = error.get("message") or error
    return " ".join(str(error).split())


def _error_body(body: bytes) -> str:
    """The message in an error response: OpenAI's ``error.message``, FastAPI's ``detail``."""
    text = body.decode("utf-8", "replace")
    try:
        payload = json.loads(text)
    except ValueError:
        return " ".join(text.split())[:200]
    if isinstance(payload, dict):
        return _error_text(payload.get("error") or payload.get("detail") or payload)
    return _error_text(payload)


async def _stream(
    session: aiohttp.ClientSession, url: str, payload: dict, headers: dict, chat: bool,
    result: RequestResult,
) -> None:
    """Send one request and record its timings in ``result`` as its chunks arrive.

    aiohttp (as vLLM's ``bench serve`` uses) and orjson: on a small machine the load
    generator shares the cores with the server it measures, so its CPU per chunk counts
    (BENCHMARKS.md, "the server hot path")."""
    sent = last = time.perf_counter()
    num_text_chunks, usage_tokens, texts = 0, None, []
    async with session.post(url, json=payload, headers=headers) as response:
        if response.status >= 400:
            result.error = f"HTTP {response.status}: {_error_body(await response.read())}"
            return
        async for line in response.content:  # one SSE line at a time
            data = _sse_data(line.decode("utf-8"))
            if not data:
                continue
            if data == "[DONE]":
                result.success = True
                break
            chunk = orjson.loads(data)
            if chunk.get("error"):
                result.error = _error_text(chunk["error"])
                return
            now = time.perf_counter()
            if text := _chunk_text(chunk, chat):
                if result.ttft_s is None:
                    result.ttft_s = now - sent
                else:
                    result.itl_s.append(now - last)
                last = now
                num_text_chunks += 1
                texts.append(text)
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                result.prompt_tokens = usage.get("prompt_tokens") or result.prompt_tokens
                usage_tokens = usage.get("completion_tokens")
    result.e2el_s = time.perf_counter() - sent
    result.output_tokens = num_text_chunks if usage_tokens is None else usage_tokens
    result.generated_text = "".join(texts)
    if not result.success:
        result.error = "the stream ended before data: [DONE]"


async def _send(
    session: aiohttp.ClientSession, url: str, payload: dict, headers: dict, chat: bool,
    result: RequestResult, timeout_s: float,
) -> None:
    try:
        await asyncio.wait_for(_stream(session, url, payload, headers, chat, result), timeout_s)
    except asyncio.TimeoutError:
        result.success, result.error = False, f"timed out after {timeout_s:g} s"
    except Exception as err:  # noqa: BLE001 - one bad response must not end a long run
        result.success, result.error = False, f"{type(err).__name__}: {err}".strip()


def _payload(config: BenchConfig, model: str, request: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.is_chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


async def _resolve_model(
    session: aiohttp.ClientSession, config: BenchConfig, headers: dict
) -> str:
    """``config.model``, else the first model the server lists. Either way the server is
    asked first, so a wrong ``base_url`` is one clear error, not ``num_prompts`` failures."""
    import aiohttp

    url = f"{config.base_url}/v1/models"
    try:
        async with session.get(url, headers=headers) as response:
            status, body = response.status, await response.read()
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as err:
        reason = str(err) or type(err).__name__
        raise ConnectionError(f"cannot reach the server at {config.base_url} ({reason})") from None
    if config.model is not None:
        return config.model
    try:
        return str(json.loads(body)["data"][0]["id"])
    except (ValueError, LookupError, TypeError):
        raise ValueError(
            f"could not read a model id from GET {url} (HTTP {status}); pass --model"
        ) from None


async def _run_requests(
    session: aiohttp.ClientSession, config: BenchConfig, model: str,
    requests: Sequence[BenchRequest], headers: dict,
) -> tuple[list[RequestResult], float]:
    from tqdm.auto import tqdm

    url = config.base_url + config.endpoint
    offsets_s = arrival_offsets_s(
        len(requests), config.request_rate, config.burstiness, config.seed
    )
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    progress = tqdm(total=len(requests), disable=config.disable_tqdm, dynamic_ncols=True)
    start = time.perf_counter()

    async def one(request: BenchRequest, offset_s: float) -> RequestResult:
        # Sleep to an absolute time, so arrival times do not drift as gaps add up.
        await asyncio.sleep(max(0.0, start + offset_s - time.perf_counter()))
        result = RequestResult(prompt_tokens=request.prompt_len, max_tokens=request.output_len)
        async with limit or contextlib.nullcontext():
            result.send_s = time.perf_counter() - start
            payload = _payload(config, model, request)
            await _send(session, url, payload, headers, config.is_chat, result, config.timeout_s)
        progress.update(1)
        return result

    try:
        results = await asyncio.gather(*map(one, requests, offsets_s))
    finally:
        progress.close()
    return list(results), time.perf_counter() - start


def _settings(config: BenchConfig, model: str) -> dict[str, Any]:
    """What the saved result records about the run (never the API key)."""
    rate = config.request_rate
    return {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "model_id": model,
        "dataset_name": config.dataset_name,
        "dataset_path": config.dataset_path,
        "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(rate) else rate,  # JSON has no infinity
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "seed": config.seed,
        "tokenizer": config.tokenizer,
        "ignore_eos": config.ignore_eos,
        "temperature": config.temperature,
        "percentile_metrics": list(config.percentile_metrics),
        "metric_percentiles": list(config.metric_percentiles),
    }


@attrs.define
class RemoteTokenizer:
    """The served model's tokenizer, through the server's ``POST /tokenize`` and
    ``POST /detokenize`` (llmlab's and vLLM's), without special tokens."""

    client: httpx.Client
    base_url: str
    model: str
    headers: dict

    def _post(self, path: str, body: dict) -> dict:
        response = self.client.post(f"{self.base_url}{path}", json={"model": self.model, **body},
                                    headers=self.headers)
        response.raise_for_status()
        return response.json()

    def encode(self, text: str) -> list[int]:
        return list(self._post("/tokenize", {"prompt": text, "add_special_tokens": False})
                    ["tokens"])

    def decode(self, token_ids: list[int]) -> str:
        return str(self._post("/detokenize", {"tokens": list(token_ids)})["prompt"])


@attrs.define
class _LocalTokenizer:
    """A Hugging Face tokenizer (``--tokenizer``), without special tokens."""

    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(list(token_ids))


def _sample(config: BenchConfig, model: str, headers: dict) -> tuple[list[BenchRequest], str]:
    """The dataset's requests, and what their lengths count: random ones ``"tokens"`` of
    ``config.tokenizer``, else of the server's tokenizer through ``/tokenize``; ``"words"``
    when the server has no ``/tokenize`` either."""
    import httpx

    if config.dataset_name != "random":
        return sample_requests(config), "words"  # a file's prompts: their word counts
    if config.tokenizer is not None:
        from transformers import AutoTokenizer

        try:
            loaded = AutoTokenizer.from_pretrained(config.tokenizer)
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot load the tokenizer {config.tokenizer!r}: {err}") from None
        return sample_requests(config, _LocalTokenizer(loaded)), "tokens"
    with httpx.Client(timeout=60.0) as client:
        remote = RemoteTokenizer(client, config.base_url, model, headers)
        try:
            remote.encode("hello")
        except (httpx.HTTPError, ValueError, LookupError, TypeError):
            return sample_requests(config), "words"  # no /tokenize here: about a token a word
        return sample_requests(config, remote), "tokens"


async def benchmark(
    config: BenchConfig, requests: Sequence[BenchRequest] | None = None
) -> dict[str, Any]:
    """Run one benchmark against ``config.base_url``.

    ``requests`` replaces the dataset ``config`` names. Returns the run's settings, the
    :func:`summarize` statistics and ``"requests"``: one :meth:`RequestResult.as_dict` per
    request, in dataset order. Raises ``ConnectionError`` if the server cannot be reached,
    ``ValueError``/``OSError`` for a bad dataset; failed requests are counted, not raised.
    """
    import aiohttp

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    unit = "given"
    # limit=0: no pool limit (aiohttp's default of 100 connections would cap concurrency
    # unasked); no session timeout: each request has its own (``_send``); a read buffer of
    # 16 MiB, because aiohttp refuses a line over twice its buffer (64 KiB by default) and
    # one SSE chunk with many logprobs is one long line.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     read_bufsize=16 << 20) as session:
        model = await _resolve_model(session, config, headers)
        if requests is None:
            requests, unit = await asyncio.to_thread(_sample, config, model, headers)
        results, duration_s = await _run_requests(session, config, model, requests, headers)
    summary = summarize(results, duration_s, config.percentile_metrics, config.metric_percentiles)
    settings = {**_settings(config, model), "prompt_len_unit": unit}
    return {**settings, **summary, "requests": [r.as_dict() for r in results]}

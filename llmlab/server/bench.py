"""``llmlab bench serve``: load-test an OpenAI-compatible server, as ``vllm bench serve`` does.

    llmlab bench serve --num-prompts 200 --request-rate 8 --max-concurrency 32 --ignore-eos
    llmlab bench serve --endpoint /v1/chat/completions --dataset-name json --dataset-path sg.json

From a notebook (Jupyter already runs an event loop, so ``await`` works directly)::

    from llmlab.server.bench import BenchConfig, benchmark
    result = await benchmark(BenchConfig(num_prompts=50, request_rate=4.0))

Every request streams. The client has no tokenizer, so token counts come from the server's
final ``usage`` chunk; without one, output tokens fall back to the number of text chunks and
input tokens to the prompt's word count.

Definitions (vLLM's; the report gives times in ms):

* TTFT: from sending a request to its first chunk that carries text.
* ITL: the gaps between successive text-carrying chunks, pooled over all requests.
* TPOT: per request with more than one output token, ``(e2el - ttft) / (output_tokens - 1)``.
* E2EL: from sending a request to the end of its stream.
* duration: from the start of the run to the end of its last request; throughputs divide by it.

Only successful requests enter the statistics; a metric without samples reads 0, as in vLLM.
A request is sent at its arrival time, or later if ``max_concurrency`` requests are in
flight; its clock starts when it is sent, so time queued in the client is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

if TYPE_CHECKING:  # imported where used, so `llmlab` starts without the HTTP client
    import httpx

from llmlab.validation import as_bool, as_choice, as_int, as_real, as_str

METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
# What a JSON prompt without a length of its own asks for (vLLM's custom dataset uses 256).
DEFAULT_JSON_OUTPUT_LEN = 128
_HUMAN_ROLES = ("human", "user")
_ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt", "bard", "model")

# Common short English words: most are a single token in GPT-2 and Llama vocabularies, so a
# prompt of N words is roughly N tokens.
_WORD_TEXT = """
the of and to in is it you that he was for on are with as his they be at one have this from or
had by word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form great think say help low line turn cause much mean before move right boy old
too same tell does set three want air well also play small end put home read hand port large
spell add even land here must big high such follow act why ask men change went light kind off
need house picture try us again animal point mother world near build self earth father head
stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story
saw far sea draw left late run while press close night real life few north open seem together
"""
WORDS = tuple(_WORD_TEXT.split())


def _positive(field: str, *, allow_none: bool = False):
    return functools.partial(as_int, field, min=1, allow_none=allow_none)


def _rate(value: object) -> float:
    """``request_rate``: a positive number; ``inf`` (send everything at once) is allowed."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == math.inf:
        return math.inf
    return as_real("request_rate", value, min=0, min_inclusive=False, allowed="> 0 or inf")


def _base_url(value: object) -> str:
    url = as_str("base_url", value, allow_empty=False)
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


def _endpoint(value: object) -> str:
    endpoint = as_str("endpoint", value, allow_empty=False)
    if not endpoint.startswith("/") or not endpoint.endswith("completions"):
        raise ValueError(
            "endpoint must be a path ending in /completions or /chat/completions, "
            f"got {endpoint!r}"
        )
    return endpoint


def _metrics(value: Sequence[str]) -> tuple[str, ...]:
    return tuple(as_choice("percentile_metrics", name, METRIC_TITLES) for name in value)


def _percentiles(value: Sequence[float]) -> tuple[float, ...]:
    return tuple(
        as_real("metric_percentiles", p, min=0, max=100, min_inclusive=False) for p in value
    )


def _api_key_from_env() -> str | None:
    return os.environ.get("OPENAI_API_KEY") or os.environ.get("LLMLAB_API_KEY")


@attrs.frozen(kw_only=True)
class BenchConfig:
    """Settings of one benchmark run (vLLM's names and defaults where vLLM has them).

    Attributes:
        base_url: the server, without ``/v1``; requests go to ``base_url + endpoint``.
        endpoint: ``/v1/completions`` or ``/v1/chat/completions`` (any path ending in
            ``chat/completions`` is sent chat messages).
        model: the model to ask for; None takes the first id of ``GET /v1/models``.
        api_key: sent as ``Authorization: Bearer``; defaults to ``$OPENAI_API_KEY``, then
            ``$LLMLAB_API_KEY``.
        dataset_name: ``"random"`` (random words) or ``"json"`` (``dataset_path``).
        dataset_path: a JSON (or ``.jsonl``) file, see :func:`load_json_requests`.
        num_prompts: requests to send.
        random_input_len, random_output_len: prompt words and ``max_tokens`` of the random
            dataset, each drawn uniformly from ``[len * (1 - r), len * (1 + r)]`` with
            ``r = random_range_ratio``.
        random_prefix_len: words of one random prefix shared by every random prompt
            (to exercise prefix caching).
        json_output_len: ``max_tokens`` of every JSON prompt, overriding the file's.
        request_rate: mean requests per second; ``inf`` sends all at once.
        burstiness: shape of the gamma-distributed gaps between arrivals; 1 is Poisson,
            below 1 burstier, above 1 more regular.
        max_concurrency: most requests in flight at once (None: no limit).
        seed: seeds the random dataset and the arrival times.
        ignore_eos: send ``ignore_eos: true`` (a vLLM extra) so outputs have the asked length.
        temperature: sampling temperature of every request.
        extra_body: more fields merged into every request body (``top_p``, ...).
        timeout_s: the most one request may take before it counts as failed.
        disable_tqdm: no progress bar.
        percentile_metrics: which of ``ttft``, ``tpot``, ``itl``, ``e2el`` to report.
        metric_percentiles: the percentiles to report for each, in ``(0, 100]``.
    """

    base_url: str = attrs.field(default="http://127.0.0.1:8000", converter=_base_url)
    endpoint: str = attrs.field(default="/v1/completions", converter=_endpoint)
    model: str | None = attrs.field(
        default=None,
        converter=functools.partial(as_str, "model", allow_none=True, allow_empty=False),
    )
    api_key: str | None = attrs.field(factory=_api_key_from_env, repr=False)
    dataset_name: str = attrs.field(
        default="random",
        converter=functools.partial(as_choice, "dataset_name", choices=("random", "json")),
    )
    dataset_path: str | None = attrs.field(default=None)
    num_prompts: int = attrs.field(default=100, converter=_positive("num_prompts"))
    random_input_len: int = attrs.field(default=128, converter=_positive("random_input_len"))
    random_output_len: int = attrs.field(default=64, converter=_positive("random_output_len"))
    random_range_ratio: float = attrs.field(
        default=0.0,
        converter=functools.partial(
            as_real, "random_range_ratio", min=0, max=1, max_inclusive=False
        ),
    )
    random_prefix_len: int = attrs.field(
        default=0, converter=functools.partial(as_int, "random_prefix_len", min=0)
    )
    json_output_len: int | None = attrs.field(
        default=None, converter=_positive("json_output_len", allow_none=True)
    )
    request_rate: float = attrs.field(default=math.inf, converter=_rate)
    burstiness: float = attrs.field(
        default=1.0,
        converter=functools.partial(as_real, "burstiness", min=0, min_inclusive=False),
    )
    max_concurrency: int | None = attrs.field(
        default=None, converter=_positive("max_concurrency", allow_none=True)
    )
    seed: int = attrs.field(default=0, converter=functools.partial(as_int, "seed", min=0))
    ignore_eos: bool = attrs.field(
        default=False, converter=functools.partial(as_bool, "ignore_eos")
    )
    temperature: float = attrs.field(
        default=0.0, converter=functools.partial(as_real, "temperature", min=0)
    )
    extra_body: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    timeout_s: float = attrs.field(
        default=6 * 60 * 60.0,
        converter=functools.partial(as_real, "timeout_s", min=0, min_inclusive=False),
    )
    disable_tqdm: bool = attrs.field(
        default=False, converter=functools.partial(as_bool, "disable_tqdm")
    )
    percentile_metrics: tuple[str, ...] = attrs.field(
        default=tuple(METRIC_TITLES), converter=_metrics
    )
    metric_percentiles: tuple[float, ...] = attrs.field(default=(50.0, 99.0), converter=_percentiles)

    def __attrs_post_init__(self) -> None:
        if self.dataset_name == "json" and not self.dataset_path:
            raise ValueError("dataset_name='json' needs a dataset_path")
        if self.dataset_name != "json" and self.dataset_path:
            raise ValueError("dataset_path is only read with dataset_name='json'")

    @property
    def is_chat(self) -> bool:
        return self.endpoint.endswith("chat/completions")


@attrs.frozen
class BenchRequest:
    """One prompt to send: its text, its ``max_tokens``, and its word count (the input-token
    estimate when the server reports no usage)."""

    prompt: str
    output_len: int
    prompt_len: int


def _uniform_lens(rng: np.random.Generator, length: int, ratio: float, size: int) -> np.ndarray:
    low = max(1, int(length * (1 - ratio)))
    high = max(low, int(length * (1 + ratio)))
    return rng.integers(low, high, size=size, endpoint=True)


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts of random :data:`WORDS` (a shared prefix of ``prefix_len`` words, then about
    ``input_len`` more), each asking for about ``output_len`` tokens."""
    rng = np.random.default_rng(seed)
    input_lens = _uniform_lens(rng, input_len, range_ratio, num_prompts)
    output_lens = _uniform_lens(rng, output_len, range_ratio, num_prompts)
    prefix = list(rng.choice(WORDS, size=prefix_len))
    requests = []
    for num_words, num_out in zip(input_lens, output_lens):
        words = prefix + list(rng.choice(WORDS, size=int(num_words)))
        requests.append(BenchRequest(" ".join(words), int(num_out), len(words)))
    return requests


def _read_entries(path: Path) -> list:
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        entries = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a non-empty JSON list of prompts, got {_brief(entries)}")
    return entries


def _brief(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _sharegpt_turns(where: str, turns: object) -> tuple[str | None, int | None]:
    """The first human turn, and the word count of the first assistant turn."""
    # ValueError throughout (TRY004): one error kind for every malformed dataset file.
    if not isinstance(turns, list):
        raise ValueError(  # noqa: TRY004
            f"{where}: \"conversations\" must be a list, got {_brief(turns)}"
        )
    prompt = output_len = None
    for turn in turns:
        if not isinstance(turn, dict):
            raise ValueError(  # noqa: TRY004
                f"{where}: each conversation turn must be an object, got {_brief(turn)}"
            )
        role = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if not isinstance(text, str):
            raise ValueError(  # noqa: TRY004
                f"{where}: a turn's \"value\"/\"content\" must be a string, got {_brief(text)}"
            )
        if role in _HUMAN_ROLES and prompt is None:
            prompt = text
        elif role in _ASSISTANT_ROLES and output_len is None:
            output_len = max(1, len(text.split()))
    return prompt or None, output_len


def _entry_request(where: str, entry: object, override: int | None) -> BenchRequest | None:
    """One dataset entry as a request; None for a ShareGPT entry without a human turn."""
    own = None
    if isinstance(entry, str):
        prompt = entry
    elif isinstance(entry, dict) and "prompt" in entry:
        prompt = entry["prompt"]
        own = entry.get("max_tokens", entry.get("output_len"))
        if own is not None and (isinstance(own, bool) or not isinstance(own, int) or own < 1):
            raise ValueError(f"{where}: max_tokens/output_len must be an int >= 1, got {own!r}")
    elif isinstance(entry, dict) and "conversations" in entry:
        prompt, own = _sharegpt_turns(where, entry["conversations"])
        if prompt is None:
            return None  # ShareGPT dumps hold such entries; vLLM skips them too
    else:
        raise ValueError(
            f"{where}: expected a string, an object with \"prompt\", or a ShareGPT object "
            f"with \"conversations\", got {_brief(entry)}"
        )
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: the prompt must be a non-empty string, got {_brief(prompt)}")
    return BenchRequest(prompt, override or own or DEFAULT_JSON_OUTPUT_LEN, len(prompt.split()))


def load_json_requests(
    path: str | os.PathLike, num_prompts: int, output_len: int | None = None
) -> list[BenchRequest]:
    """The first ``num_prompts`` prompts of a JSON file (cycling if it holds fewer).

    The file holds a list (``.jsonl``: one entry a line) of strings; or of objects with
    ``"prompt"`` and optional ``"max_tokens"`` or ``"output_len"``; or of ShareGPT objects,
    ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}`` (``role`` /
    ``content`` also read), whose first human turn is the prompt and whose first assistant
    turn's word count is the output length. ``output_len`` overrides every entry's length;
    entries without one ask for :data:`DEFAULT_JSON_OUTPUT_LEN` tokens.
    """
    path = Path(path)
    requests = []
    for i, entry in enumerate(_read_entries(path)):
        request = _entry_request(f"{path}: entry {i}", entry, output_len)
        if request is not None:
            requests.append(request)
    if not requests:
        raise ValueError(f"{path}: no entry has a prompt (ShareGPT entries need a human turn)")
    return [requests[i % len(requests)] for i in range(num_prompts)]


def sample_requests(config: BenchConfig) -> list[BenchRequest]:
    """The requests ``config`` describes."""
    if config.dataset_name == "json":
        return load_json_requests(config.dataset_path, config.num_prompts, config.json_output_len)
    return random_requests(
        config.num_prompts, config.random_input_len, config.random_output_len,
        config.random_range_ratio, config.random_prefix_len, config.seed,
    )


def arrival_offsets_s(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """When each request arrives, in seconds after the first (which arrives at 0).

    At rate ``inf`` all arrive at once. Otherwise the gaps are gamma-distributed with mean
    ``1 / request_rate`` and shape ``burstiness`` (vLLM's arrival process): shape 1 gives
    exponential gaps, i.e. a Poisson process.
    """
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    scale = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=scale, size=max(num_requests - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:num_requests]


@attrs.define
class RequestResult:
    """What happened to one request (seconds; ``send_s`` counts from the run's start).

    ``prompt_tokens`` and ``output_tokens`` are the server's ``usage`` when it sent one, else
    the prompt's word count and the number of text chunks.
    """

    prompt_tokens: int
    max_tokens: int
    success: bool = False
    error: str = ""
    send_s: float = 0.0
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = attrs.Factory(list)
    output_tokens: int = 0
    generated_text: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2el_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "tpot_s": self.tpot_s}


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
    client: httpx.AsyncClient, url: str, payload: dict, headers: dict, chat: bool,
    result: RequestResult,
) -> None:
    """Send one request and record its timings in ``result`` as its chunks arrive."""
    sent = last = time.perf_counter()
    num_text_chunks, usage_tokens, texts = 0, None, []
    async with client.stream("POST", url, json=payload, headers=headers) as response:
        if response.status_code >= 400:
            result.error = f"HTTP {response.status_code}: {_error_body(await response.aread())}"
            return
        async for line in response.aiter_lines():
            data = _sse_data(line)
            if not data:
                continue
            if data == "[DONE]":
                result.success = True
                break
            chunk = json.loads(data)
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
    client: httpx.AsyncClient, url: str, payload: dict, headers: dict, chat: bool,
    result: RequestResult, timeout_s: float,
) -> None:
    try:
        await asyncio.wait_for(_stream(client, url, payload, headers, chat, result), timeout_s)
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


async def _resolve_model(client: httpx.AsyncClient, config: BenchConfig, headers: dict) -> str:
    """``config.model``, else the first model the server lists. Either way the server is
    asked first, so a wrong ``base_url`` is one clear error, not ``num_prompts`` failures."""
    import httpx

    url = f"{config.base_url}/v1/models"
    try:
        response = await client.get(url, headers=headers)
    except httpx.TransportError as err:
        reason = str(err) or type(err).__name__
        raise ConnectionError(f"cannot reach the server at {config.base_url} ({reason})") from None
    if config.model is not None:
        return config.model
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, LookupError, TypeError):
        raise ValueError(
            f"could not read a model id from GET {url} (HTTP {response.status_code}); "
            "pass --model"
        ) from None


async def _run_requests(
    client: httpx.AsyncClient, config: BenchConfig, model: str,
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
            await _send(client, url, payload, headers, config.is_chat, result, config.timeout_s)
        progress.update(1)
        return result

    try:
        results = await asyncio.gather(*map(one, requests, offsets_s))
    finally:
        progress.close()
    return list(results), time.perf_counter() - start


def _percentile_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _metric_stats(metric: str, samples_s: list[float], percentiles: Sequence[float]) -> dict:
    # No samples (say, no request got past one token for TPOT) reads 0, as in vLLM.
    ms = np.asarray(samples_s or [0.0], dtype=float) * 1000.0
    stats = {
        f"mean_{metric}_ms": float(np.mean(ms)),
        f"median_{metric}_ms": float(np.median(ms)),
        f"std_{metric}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        stats[f"p{_percentile_name(p)}_{metric}_ms"] = float(np.percentile(ms, p))
    return stats


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    percentile_metrics: Sequence[str] = tuple(METRIC_TITLES),
    metric_percentiles: Sequence[float] = (50.0, 99.0),
) -> dict[str, Any]:
    """The run's totals, throughputs and latency statistics (vLLM's keys; see the module
    docstring for the definitions). Pure: it reads only its arguments."""
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    summary: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) * per_s,
        "output_throughput": total_output * per_s,
        "total_token_throughput": (total_input + total_output) * per_s,
    }
    samples_s = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2el": [r.e2el_s for r in done if r.e2el_s is not None],
    }
    for metric in percentile_metrics:
        summary.update(_metric_stats(metric, samples_s[metric], metric_percentiles))
    return summary


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
        "ignore_eos": config.ignore_eos,
        "temperature": config.temperature,
        "percentile_metrics": list(config.percentile_metrics),
        "metric_percentiles": list(config.metric_percentiles),
    }


async def benchmark(
    config: BenchConfig, requests: Sequence[BenchRequest] | None = None
) -> dict[str, Any]:
    """Run one benchmark against ``config.base_url``.

    ``requests`` replaces the dataset ``config`` names. Returns the run's settings, the
    :func:`summarize` statistics and ``"requests"``: one :meth:`RequestResult.as_dict` per
    request, in dataset order. Raises ``ConnectionError`` if the server cannot be reached,
    ``ValueError``/``OSError`` for a bad dataset; failed requests are counted, not raised.
    """
    import httpx

    if requests is None:
        requests = sample_requests(config)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # No pool limit: httpx's default of 100 connections would cap concurrency unasked.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits) as client:
        model = await _resolve_model(client, config, headers)
        results, duration_s = await _run_requests(client, config, model, requests, headers)
    summary = summarize(results, duration_s, config.percentile_metrics, config.metric_percentiles)
    return {**_settings(config, model), **summary, "requests": [r.as_dict() for r in results]}


def format_report(result: Mapping[str, Any]) -> str:
    """The result as vLLM's plain-text table (ms for latencies)."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]

    def row(label: str, value: object) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40} {text}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    for metric in result.get("percentile_metrics", METRIC_TITLES):
        name = metric.upper()
        lines.append(f"{METRIC_TITLES[metric]:-^50}")
        row(f"Mean {name} (ms):", result[f"mean_{metric}_ms"])
        row(f"Median {name} (ms):", result[f"median_{metric}_ms"])
        for p in result.get("metric_percentiles", (50.0, 99.0)):
            p_name = _percentile_name(p)
            row(f"P{p_name} {name} (ms):", result[f"p{p_name}_{metric}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def _comma_list(text: str, convert, what: str) -> list:
    try:
        return [convert(item.strip()) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma-separated list, got {text!r}") from None


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``llmlab bench serve`` (vLLM's names where vLLM has the flag)."""
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="server URL, without /v1")
    add("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    add("--model", default=None, help="default: the first id of GET /v1/models")
    add("--api-key", default=None, help="default: $OPENAI_API_KEY, then $LLMLAB_API_KEY")
    add("--dataset-name", default="random", choices=("random", "json"))
    add("--dataset-path", default=None,
        help="JSON list of strings, of {prompt, max_tokens} objects, or ShareGPT entries")
    add("--num-prompts", type=int, default=100)
    add("--random-input-len", type=int, default=128, help="prompt words (~tokens)")
    add("--random-output-len", type=int, default=64, help="max_tokens of random prompts")
    add("--random-range-ratio", type=float, default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]")
    add("--random-prefix-len", type=int, default=0, help="words of a prefix every prompt shares")
    add("--json-output-len", type=int, default=None, help="override max_tokens of JSON prompts")
    add("--request-rate", type=float, default=math.inf,
        help="requests per second (default inf: all at once)")
    add("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1: Poisson")
    add("--max-concurrency", type=int, default=None, help="most requests in flight")
    add("--seed", type=int, default=0)
    add("--ignore-eos", action="store_true", help="send ignore_eos so outputs have full length")
    add("--temperature", type=float, default=0.0)
    add("--extra-body", default=None, help='JSON object merged into each request, e.g. {"top_p":0.9}')
    add("--timeout", type=float, default=6 * 60 * 60.0, help="seconds per request")
    add("--disable-tqdm", action="store_true")
    add("--save-result", action="store_true", help="write the result as JSON")
    add("--result-file", default=None,
        help="where --save-result writes (implies it); default llmlab-bench-DATE.json")
    add("--percentile-metrics", default="ttft,tpot,itl,e2el")
    add("--metric-percentiles", default="50,99")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` the parsed flags describe."""
    extra_body = {}
    if args.extra_body:
        try:
            extra_body = json.loads(args.extra_body)
        except ValueError:
            extra_body = None
        if not isinstance(extra_body, dict):
            raise ValueError(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    api_key = {} if args.api_key is None else {"api_key": args.api_key}
    return BenchConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model, **api_key,
        dataset_name=args.dataset_name, dataset_path=args.dataset_path,
        num_prompts=args.num_prompts, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len, json_output_len=args.json_output_len,
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed, ignore_eos=args.ignore_eos,
        temperature=args.temperature, extra_body=extra_body, timeout_s=args.timeout,
        disable_tqdm=args.disable_tqdm,
        percentile_metrics=_comma_list(args.percentile_metrics, str, "--percentile-metrics"),
        metric_percentiles=_comma_list(args.metric_percentiles, float, "--metric-percentiles"),
    )


def _first_errors(result: Mapping[str, Any], limit: int = 5) -> list[str]:
    failed = [(i, r["error"]) for i, r in enumerate(result["requests"]) if not r["success"]]
    return [f"request {i}: {error}" for i, error in failed[:limit]]


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def run_bench_serve(args: argparse.Namespace) -> int:
    """``llmlab bench serve``: 0 when some request succeeded, 1 when all failed, 2 for a
    usage error (bad flag, missing dataset, unreachable server)."""
    try:
        config = config_from_args(args)
        result = asyncio.run(benchmark(config))
    except (ValueError, TypeError, OSError) as err:
        # The user's to fix: one line, no traceback.
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    if result["failed"]:
        head = "error: all" if not result["completed"] else "warning:"
        print(f"{head} {result['failed']} requests failed; the first errors:", file=sys.stderr)
        for line in _first_errors(result):
            print(f"  {line}", file=sys.stderr)
    if result["completed"]:
        print(format_report(result))
    if args.save_result or args.result_file:
        path = Path(args.result_file or f"llmlab-bench-{result['date']}.json")
        try:
            path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        except OSError as err:
            print(f"error: cannot write {path}: {_one_line(err)}", file=sys.stderr)
            return 2
        print(f"Saved the result to {path}")
    return 0 if result["completed"] else 1

"""``llmlab bench serve``: load-test an OpenAI-compatible server, as ``vllm bench serve`` does.

    llmlab bench serve --num-prompts 200 --request-rate 8 --max-concurrency 32 --ignore-eos
    llmlab bench serve --endpoint /v1/chat/completions --dataset-name json --dataset-path sg.json

From a notebook (Jupyter already runs an event loop, so ``await`` works directly)::

    from llmlab.loadtest import BenchConfig, benchmark
    result = await benchmark(BenchConfig(num_prompts=50, request_rate=4.0))

Every request streams. Random prompts are so many tokens of the server's tokenizer (through
its ``/tokenize`` and ``/detokenize``) or of ``--tokenizer``; words (about a token each) when
there is neither. Token counts come from the server's final ``usage`` chunk; without one,
output tokens fall back to the number of text chunks and input tokens to the prompt's
length.

Definitions (vLLM's; the report gives times in ms):

* TTFT: from sending a request to its first chunk that carries text.
* ITL: the gaps between successive text-carrying chunks, pooled over all requests.
* TPOT: per request with more than one output token, ``(e2el - ttft) / (output_tokens - 1)``.
* E2EL: from sending a request to the end of its stream.
* duration: from the start of the run to the end of its last request; throughputs divide by it.

Only successful requests enter the statistics; a metric without samples reads 0, as in vLLM.
A request is sent at its arrival time, or later if ``max_concurrency`` requests are in
flight; its clock starts when it is sent, so time queued in the client is not counted.

Modules: ``config.py`` (:class:`BenchConfig`), ``datasets.py`` (the prompts and their
arrival times), ``client.py`` (:func:`benchmark`: the HTTP client and its timings),
``report.py`` (:class:`RequestResult`, :func:`summarize`, :func:`format_report`) and
``cli.py`` (the flags and :func:`run_bench_serve`).
"""

from llmlab.loadtest.cli import add_bench_serve_args, config_from_args, run_bench_serve
from llmlab.loadtest.client import benchmark
from llmlab.loadtest.config import METRIC_TITLES, BenchConfig
from llmlab.loadtest.datasets import (
    DEFAULT_JSON_OUTPUT_LEN,
    WORDS,
    BenchRequest,
    arrival_offsets_s,
    load_json_requests,
    random_requests,
    sample_requests,
)
from llmlab.loadtest.report import RequestResult, format_report, summarize

__all__ = [
    "DEFAULT_JSON_OUTPUT_LEN",
    "METRIC_TITLES",
    "WORDS",
    "BenchConfig",
    "BenchRequest",
    "RequestResult",
    "add_bench_serve_args",
    "arrival_offsets_s",
    "benchmark",
    "config_from_args",
    "format_report",
    "load_json_requests",
    "random_requests",
    "run_bench_serve",
    "sample_requests",
    "summarize",
]

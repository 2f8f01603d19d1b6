"""``llmlab bench serve``: its flags (:func:`add_bench_serve_args`) and what it runs
(:func:`run_bench_serve`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmlab.loadtest.client import benchmark
from llmlab.loadtest.config import BenchConfig
from llmlab.loadtest.report import format_report


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
    add("--tokenizer", default=None,
        help="HF tokenizer counting random prompts' tokens; default: the server's /tokenize")
    add("--random-input-len", type=int, default=128,
        help="prompt tokens (words when neither --tokenizer nor the server's /tokenize)")
    add("--random-output-len", type=int, default=64, help="max_tokens of random prompts")
    add("--random-range-ratio", type=float, default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]")
    add("--random-prefix-len", type=int, default=0, help="tokens of a prefix every prompt shares")
    add("--json-output-len", type=int, default=None, help="override max_tokens of JSON prompts")
    add("--request-rate", type=float, default=math.inf,
        help="requests per second (default inf: all at once)")
    add("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1: Poisson")
    add("--max-concurrency", type=int, default=None, help="most requests in flight")
    add("--seed", type=int, default=0)
    add("--ignore-eos", action="store_true", help="send ignore_eos so outputs have full length")
    add("--temperature", type=float, default=0.0)
    add("--extra-body", default=None,
        help='JSON object merged into each request, e.g. {"top_p":0.9}')
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
        tokenizer=args.tokenizer,
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

"""Settings of one load-test run: :class:`BenchConfig`, each field checked as it is set."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from llmlab.validation import as_bool, as_choice, as_int, as_real, as_str

METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


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
        tokenizer: a Hugging Face tokenizer (path or name) to count random prompts' tokens
            with; None uses the server's own through ``/tokenize`` and ``/detokenize``
            (llmlab's and vLLM's), and words (about a token each) if it has none.
        random_input_len, random_output_len: prompt tokens and ``max_tokens`` of the random
            dataset, each drawn uniformly from ``[len * (1 - r), len * (1 + r)]`` with
            ``r = random_range_ratio`` (tokens as ``vllm bench serve`` counts them: the
            prompt text's, without the BOS the server adds).
        random_prefix_len: tokens of one random prefix shared by every random prompt
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
    tokenizer: str | None = attrs.field(
        default=None,
        converter=functools.partial(as_str, "tokenizer", allow_none=True, allow_empty=False),
    )
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
    metric_percentiles: tuple[float, ...] = attrs.field(
        default=(50.0, 99.0), converter=_percentiles
    )

    def __attrs_post_init__(self) -> None:
        if self.dataset_name == "json" and not self.dataset_path:
            raise ValueError("dataset_name='json' needs a dataset_path")
        if self.dataset_name != "json" and self.dataset_path:
            raise ValueError("dataset_path is only read with dataset_name='json'")

    @property
    def is_chat(self) -> bool:
        return self.endpoint.endswith("chat/completions")

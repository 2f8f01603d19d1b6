"""The pooling endpoints (a ``runner="pooling"`` engine): vLLM's shapes.

* ``POST /v1/embeddings`` (OpenAI's): ``input`` a string, a list of strings, a list of
  token ids or a list of such lists; ``encoding_format`` ``"float"`` or ``"base64"``
  (little-endian float32 bytes, as OpenAI encodes them, which the ``openai`` client asks
  for by default); ``dimensions`` (Matryoshka truncation); ``usage``.
* ``POST /pooling``: the task's raw output per input (``data``), vLLM's ``/pooling``.
* ``POST /classify`` (and ``/v1/classify``): a classifier's ``probs`` per input, with the
  ``label`` of the likeliest class from the checkpoint's ``id2label`` (vLLM's).
* ``POST /score`` (and ``/v1/score``): ``text_1`` against ``text_2`` (one against many, or
  pairwise), ``data[i].score``: a cross-encoder's sigmoid, or the cosine similarity of two
  embeddings.
* ``POST /rerank`` (and ``/v1/rerank``, ``/v2/rerank``): ``query`` against ``documents``,
  ``results`` sorted by ``relevance_score``, the best ``top_n``.

On an engine that generates, each answers 400 saying the model does not support it (as
vLLM does); on a pooling engine, ``/v1/completions`` and ``/v1/chat/completions`` are
refused the same way (:func:`refuse_generation`). Bad input is a 400 naming the field,
with nothing queued.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations at runtime.
import asyncio
import base64
import functools
from typing import Annotated, Any, Literal

import numpy as np
import torch
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from llmlab.entrypoints.async_engine import EngineDeadError, EngineError
from llmlab.engine.inputs import check_prompt_text
from llmlab.errors import RequestFailedError
from llmlab.pooling_params import PoolingParams
from llmlab.entrypoints.server import protocol as p
from llmlab.entrypoints.server.admission import Weight
from llmlab.entrypoints.server.errors import APIError, bad_request

Int = p.Int
Str = p.Str
TokenIds = p.TokenIds
PositiveInt = Annotated[int, Field(strict=True, ge=1)]

# Served outside /v1 too; build_app puts them behind the API key as /v1 is.
KEYED_PATHS = ("/pooling", "/classify", "/score", "/rerank", "/v2/rerank")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings`` (OpenAI's fields plus vLLM's ``truncate_prompt_tokens``,
    ``normalize``, ``priority``)."""

    model: Str | None = None
    input: list[TokenIds] | TokenIds | list[Str] | Str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: Str | None = None
    truncate_prompt_tokens: Int | None = None
    normalize: p.Bool | None = None
    priority: Int = 0


class PoolingRequest(EmbeddingRequest):
    """``POST /pooling`` (vLLM's): the model's default task unless ``task`` names one."""

    task: Literal["embed", "classify", "score", "encode"] | None = None
    use_activation: p.Bool | None = None


class ClassificationRequest(_Request):
    """``POST /classify`` (vLLM's): ``input`` a string or strings (token ids too, as
    current vLLM takes them); ``use_activation=False`` returns the logits."""

    model: Str | None = None
    input: list[TokenIds] | TokenIds | list[Str] | Str
    truncate_prompt_tokens: Int | None = None
    user: Str | None = None
    use_activation: p.Bool | None = None
    priority: Int = 0


class ScoreRequest(_Request):
    """``POST /score`` (vLLM's)."""

    model: Str | None = None
    text_1: list[Str] | Str
    text_2: list[Str] | Str
    truncate_prompt_tokens: Int | None = None
    use_activation: p.Bool | None = None
    priority: Int = 0


class RerankRequest(_Request):
    """``POST /rerank`` (vLLM's, Jina's and Cohere's shape)."""

    model: Str | None = None
    query: Str
    documents: list[Str]
    top_n: Annotated[int, Field(strict=True, ge=0)] | None = None
    truncate_prompt_tokens: Int | None = None
    use_activation: p.Bool | None = None
    priority: Int = 0


class PoolingUsage(_Response):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0


class EmbeddingData(_Response):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(_Response):
    id: str = Field(default_factory=lambda: p.random_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=p.now)
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingData(_Response):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(_Response):
    id: str = Field(default_factory=lambda: p.random_id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=p.now)
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ClassificationData(_Response):
    """One input's classes: ``probs`` (logits with ``use_activation=False``) and the
    ``label`` of the likeliest (None when the checkpoint names none)."""

    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(_Response):
    """``POST /classify``'s answer (vLLM's ``ClassificationResponse``)."""

    id: str = Field(default_factory=lambda: p.random_id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=p.now)
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class ScoreData(_Response):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_Response):
    id: str = Field(default_factory=lambda: p.random_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=p.now)
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(_Response):
    text: str


class RerankResult(_Response):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(_Response):
    total_tokens: int


class RerankResponse(_Response):
    id: str = Field(default_factory=lambda: p.random_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]


# -- the logic ---------------------------------------------------------------------------


def _spec(serving: Any, api: str):
    """The engine's pooling spec, or a 400 saying the model does not support ``api``."""
    spec = getattr(serving.engine.engine, "pooling", None)
    if spec is None:
        raise APIError(
            f"The model does not support the {api} API: it generates text "
            "(runner='generate'); serve a pooling model with --runner pooling"
        )
    return spec


def refuse_generation(request: Request) -> None:
    """A 400 for a generation endpoint on a pooling engine (vLLM's answer)."""
    serving = request.app.state.serving
    if getattr(serving.engine.engine, "pooling", None) is not None:
        raise APIError(
            "The model does not support the Completions API: it is a pooling model "
            "(runner='pooling'); use /v1/embeddings, /pooling, /classify, /score or /rerank"
        )


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        # OpenAI's encoding: the float32 values' little-endian bytes, base64.
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _inputs(value: Any, field: str = "input") -> list[Any]:
    """One engine prompt per input (text or token ids)."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and isinstance(value[0], int):
        items = [value]
    else:
        items = list(value)
    if not items:
        raise APIError(f"{field} must not be empty", param=field)
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append({"prompt": item})
        elif not item:
            raise APIError(f"{field} has an empty token list", param=field)
        else:
            prompts.append({"prompt_token_ids": item})
    return prompts


def _check_capacity(serving: Any, num: int, field: str) -> None:
    if num > serving.max_prompts_per_request:
        raise APIError(
            f"{field} has {num} inputs, more than the {serving.max_prompts_per_request} "
            "allowed per request", param=field,
        )


async def _pool(serving: Any, prompts: list[Any], params: PoolingParams, request: Any,
                fields: tuple[str, ...]) -> list[Any]:
    """Add every prompt (aborting those added if one is refused), await each output."""
    engine = serving.engine
    base = p.random_id("pool")
    streams = []
    # One sequence per prompt; text's tokens are not known before the engine tokenizes it.
    ticket = serving.admission.admit(
        *(Weight(1, 1, len(pr.get("prompt_token_ids", ()))) for pr in prompts))
    try:
        try:
            for i, prompt in enumerate(prompts):
                stream = await engine.add_request(
                    f"{base}-{i}", prompt, params, priority=request.priority,
                    user=getattr(request, "user", None),
                )
                ticket.attach(stream, i)
                streams.append(stream)
        except (ValueError, TypeError) as err:
            raise bad_request(err, fields) from err
        except EngineDeadError as err:
            raise APIError(str(err), status=503, type="server_error") from err

        async def final(stream):
            last = None
            async for output in stream:
                last = output
            return last

        try:
            return await asyncio.gather(*(final(s) for s in streams))
        except RequestFailedError as err:
            raise APIError(str(err)) from err
        except (EngineError, EngineDeadError) as err:
            raise APIError(str(err), status=503, type="server_error") from err
    finally:
        ticket.release()  # the prompts that never reached the engine
        for stream in streams:  # a no-op for the finished ones
            stream.abort()


def _usage(outputs: list[Any]) -> PoolingUsage:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def _params(field: str = "input", **kwargs: Any) -> PoolingParams:
    try:
        return PoolingParams(**{k: v for k, v in kwargs.items() if v is not None})
    except (ValueError, TypeError) as err:
        raise bad_request(err, tuple(kwargs)) from err


async def embeddings(serving: Any, body: EmbeddingRequest) -> EmbeddingResponse:
    _spec(serving, "Embeddings")
    model = serving.check_model(body.model)
    prompts = _inputs(body.input)
    _check_capacity(serving, len(prompts), "input")
    params = _params(task="embed", dimensions=body.dimensions, normalize=body.normalize,
                     truncate_prompt_tokens=body.truncate_prompt_tokens)
    outputs = await _pool(serving, prompts, params, body,
                          ("input", "dimensions", "truncate_prompt_tokens", "task"))
    data = [
        EmbeddingData(index=i, embedding=_encode(o.outputs.data, body.encoding_format))
        for i, o in enumerate(outputs)
    ]
    return EmbeddingResponse(model=model, data=data, usage=_usage(outputs))


async def pooling(serving: Any, body: PoolingRequest) -> PoolingResponse:
    _spec(serving, "Pooling")
    model = serving.check_model(body.model)
    prompts = _inputs(body.input)
    _check_capacity(serving, len(prompts), "input")
    params = _params(task=body.task, dimensions=body.dimensions, normalize=body.normalize,
                     use_activation=body.use_activation,
                     truncate_prompt_tokens=body.truncate_prompt_tokens)
    outputs = await _pool(serving, prompts, params, body,
                          ("input", "dimensions", "truncate_prompt_tokens", "task"))
    data = [
        PoolingData(index=i, data=_encode(o.outputs.data, body.encoding_format))
        for i, o in enumerate(outputs)
    ]
    return PoolingResponse(model=model, data=data, usage=_usage(outputs))


@functools.lru_cache(maxsize=8)
def _id2label(model: str, revision: str | None, download_dir: str | None) -> dict[int, str]:
    """The checkpoint's class names by index (``config.json``'s ``id2label``, with
    transformers' ``LABEL_i`` defaults), read once per model: the engine keeps no HF
    config, and the labels are the classify route's alone."""
    from transformers import AutoConfig

    from llmlab.models.loader import resolve_model_path

    path = resolve_model_path(model, revision, cache_dir=download_dir)  # already local
    labels = getattr(AutoConfig.from_pretrained(path), "id2label", None) or {}
    return {int(index): str(name) for index, name in labels.items()}


async def _labels(serving: Any) -> dict[int, str]:
    cfg = serving.engine.engine.config
    try:
        return await asyncio.to_thread(_id2label, cfg.model, cfg.revision, cfg.download_dir)
    except (OSError, ValueError):
        # The engine loaded from there moments ago; if the config cannot be read again,
        # answer without labels (vLLM's label may be null) rather than fail the request.
        return {}


async def classify(serving: Any, body: ClassificationRequest) -> ClassificationResponse:
    """Each input's class probabilities and label; admitted, queued and refused as
    :func:`embeddings` is."""
    _spec(serving, "Classification")
    model = serving.check_model(body.model)
    prompts = _inputs(body.input)
    _check_capacity(serving, len(prompts), "input")
    params = _params(task="classify", use_activation=body.use_activation,
                     truncate_prompt_tokens=body.truncate_prompt_tokens)
    outputs = await _pool(serving, prompts, params, body,
                          ("input", "truncate_prompt_tokens", "task", "use_activation"))
    labels = await _labels(serving)
    data = []
    for i, output in enumerate(outputs):
        probs = output.outputs.data.tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassificationData(index=i, label=labels.get(best), probs=probs,
                                       num_classes=len(probs)))
    return ClassificationResponse(model=model, data=data, usage=_usage(outputs))


def _pairs(text_1: Any, text_2: Any) -> list[tuple[str, str]]:
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise APIError("text_1 and text_2 must not be empty", param="text_1" if not first
                       else "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise APIError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: send one text_1, or "
            "as many as text_2", param="text_1",
        )
    return list(zip(first, second, strict=True))


async def _scores(serving: Any, pairs: list[tuple[str, str]], body: Any) -> tuple[list, int]:
    """Each pair's score and the prompt tokens used: a cross-encoder's, or the cosine
    similarity of two embeddings."""
    spec = _spec(serving, "Score")
    fields = ("text_1", "text_2", "query", "documents", "truncate_prompt_tokens")
    for a, b in pairs:
        for field, text in (("text_1", a), ("text_2", b)):
            try:
                check_prompt_text(field, text, serving.max_model_len)
            except ValueError as err:
                raise APIError(str(err), param=field) from None
    if "score" in spec.tasks:
        tokenizer = serving.tokenizer
        if tokenizer is None:
            raise APIError("scoring needs a tokenizer (the server has none)")
        _check_capacity(serving, len(pairs), "text_2")
        encoded = await asyncio.to_thread(
            lambda: [tokenizer(a, text_pair=b)["input_ids"] for a, b in pairs]
        )
        params = _params(task="score", use_activation=body.use_activation,
                         truncate_prompt_tokens=body.truncate_prompt_tokens)
        outputs = await _pool(serving, [{"prompt_token_ids": ids} for ids in encoded],
                              params, body, fields)
        scores = [float(o.outputs.data.reshape(-1)[0]) for o in outputs]
        return scores, _usage(outputs).prompt_tokens
    if "embed" not in spec.tasks:
        raise APIError(
            "The model does not support the Score API: it needs a cross-encoder (a "
            f"classifier with num_labels=1) or an embedding model; num_labels={spec.num_labels}"
        )
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    _check_capacity(serving, len(texts), "text_2")
    params = _params(task="embed", truncate_prompt_tokens=body.truncate_prompt_tokens)
    outputs = await _pool(serving, [{"prompt": t} for t in texts], params, body, fields)
    by_text = {t: o.outputs.data for t, o in zip(texts, outputs, strict=True)}
    scores = [
        float(torch.nn.functional.cosine_similarity(by_text[a], by_text[b], dim=0))
        for a, b in pairs
    ]
    return scores, _usage(outputs).prompt_tokens


async def score(serving: Any, body: ScoreRequest) -> ScoreResponse:
    _spec(serving, "Score")
    model = serving.check_model(body.model)
    scores, tokens = await _scores(serving, _pairs(body.text_1, body.text_2), body)
    return ScoreResponse(
        model=model, data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


async def rerank(serving: Any, body: RerankRequest) -> RerankResponse:
    _spec(serving, "Rerank")
    model = serving.check_model(body.model)
    if not body.documents:
        raise APIError("documents must not be empty", param="documents")
    scores, tokens = await _scores(serving, [(body.query, d) for d in body.documents], body)
    order = np.argsort(-np.asarray(scores), kind="stable")
    top_n = body.top_n or len(order)
    results = [
        RerankResult(index=int(i), document=RerankDocument(text=body.documents[i]),
                     relevance_score=scores[i])
        for i in order[:top_n]
    ]
    return RerankResponse(model=model, usage=RerankUsage(total_tokens=tokens), results=results)


# -- routes ------------------------------------------------------------------------------


def _serving(request: Request) -> Any:
    return request.app.state.serving


Serving = Annotated[Any, Depends(_serving)]
_ERRORS = {
    400: {"model": p.ErrorResponse, "description": "Bad request, or not a pooling model"},
    404: {"model": p.ErrorResponse, "description": "Unknown model"},
    503: {"model": p.ErrorResponse, "description": "The engine cannot serve now"},
}

router = APIRouter()


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
async def create_embeddings(body: EmbeddingRequest, serving: Serving):
    return await embeddings(serving, body)


@router.post("/pooling", response_model=PoolingResponse, responses=_ERRORS)
async def create_pooling(body: PoolingRequest, serving: Serving):
    return await pooling(serving, body)


@router.post("/classify", response_model=ClassificationResponse, responses=_ERRORS)
@router.post("/v1/classify", response_model=ClassificationResponse, responses=_ERRORS)
async def create_classify(body: ClassificationRequest, serving: Serving):
    return await classify(serving, body)


@router.post("/score", response_model=ScoreResponse, responses=_ERRORS)
@router.post("/v1/score", response_model=ScoreResponse, responses=_ERRORS)
async def create_score(body: ScoreRequest, serving: Serving):
    return await score(serving, body)


@router.post("/rerank", response_model=RerankResponse, responses=_ERRORS)
@router.post("/v1/rerank", response_model=RerankResponse, responses=_ERRORS)
@router.post("/v2/rerank", response_model=RerankResponse, responses=_ERRORS)
async def create_rerank(body: RerankRequest, serving: Serving):
    return await rerank(serving, body)

"""The OpenAI-compatible FastAPI app (``llmlab serve`` runs it under uvicorn).

:func:`build_app` wraps an :class:`~llmlab.entrypoints.async_engine.AsyncEngine`. Routes:
``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE
with ``stream``), ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (with
``enable_tokenizer_info_endpoint``), ``GET /health``, ``GET /version``, ``GET /metrics``
(Prometheus); for a pooling engine (``--runner pooling``) ``POST /v1/embeddings``,
``/pooling``, ``/score``, ``/rerank`` (:mod:`llmlab.entrypoints.server.pooling`, its own router);
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (:mod:`llmlab.entrypoints.server.lora`).

Every error is OpenAI's ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
input (malformed JSON and wrong types included: FastAPI's 422 is turned into 400), 401
without the API key on ``/v1`` routes, 404 for an unknown model or route, 503 while the
engine cannot serve, 500 only for a bug. A client that disconnects has its requests aborted.

Each route is a module-level function on ``v1`` (the ``/v1`` routes, behind the API key) or
``router`` (the rest), and reaches the app's :class:`OpenAIServing` through the ``Serving``
dependency (``request.app.state.serving``). A new endpoint is one route function here, one
``OpenAIServing`` method and its request/response models in ``protocol.py``.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route functions'
# annotations at runtime. This module is imported only to serve, so it imports FastAPI at
# the top.
import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from pydantic import ValidationError
from starlette.exceptions import HTTPException

import llmlab
from llmlab.distributed.data_parallel import (
    DataParallelEngine,
    ReplicaFailedError,
    ReplicasDeadError,
)
from llmlab.entrypoints.async_engine import AsyncEngine, EngineDeadError, EngineError
from llmlab.errors import RequestFailedError
from llmlab.entrypoints.server import protocol as p
from llmlab.entrypoints.server.admission import RETRY_AFTER_S, Admission, busy, default_max_tokens
from llmlab.entrypoints.server.errors import APIError, ClientDisconnected, bad_request
from llmlab.entrypoints.server.lora import router as lora_router
from llmlab.entrypoints.server.lora import serve_lora_modules
from llmlab.entrypoints.server.metrics import DataParallelMetrics, EngineMetrics
from llmlab.entrypoints.server.pooling import KEYED_PATHS as _POOLING_PATHS
from llmlab.entrypoints.server.pooling import refuse_generation
from llmlab.entrypoints.server.pooling import router as pooling_router
from llmlab.entrypoints.server.serving import OpenAIServing
from llmlab.utils.gc_heap import frozen_heap

logger = logging.getLogger(__name__)

_ERRORS = {
    400: {"model": p.ErrorResponse, "description": "Bad request"},
    401: {"model": p.ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": p.ErrorResponse, "description": "Unknown model"},
    500: {"model": p.ErrorResponse, "description": "Internal error"},
    503: {"model": p.ErrorResponse, "description": "The engine cannot serve now"},
}
_PLAIN_ERRORS = {k: v for k, v in _ERRORS.items() if k != 401}


def build_app(
    engine: AsyncEngine,
    *,
    served_model_names: Sequence[str] = ("llmlab",),
    model_path: str | None = None,
    api_key: str | None = None,
    chat_template: str | None = None,
    allowed_origins: Sequence[str] = (),
    shutdown_engine: bool = True,
    freeze_gc: bool = False,
    trust_request_chat_template: bool = False,
    open_metrics: bool = False,
    open_docs: bool = False,
    max_request_body_bytes: int = 32 * 2**20,
    max_prompts_per_request: int = 256,
    max_sequences_per_request: int = 1024,
    max_queued_sequences: int = 4096,
    max_queued_tokens: int | None = None,
    return_tokens_as_token_ids: bool = False,
    enable_tokenizer_info_endpoint: bool = False,
    response_role: str = "assistant",
    root_path: str | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser=None,
    tool_parser_config=None,
    lora_modules: Sequence[Any] = (),
):
    """The FastAPI app serving ``engine``.

    ``served_model_names``: the names clients use (the first is the default for requests
    that name none). ``api_key``: required as ``Authorization: Bearer KEY`` on the ``/v1``
    routes, ``/tokenize`` and ``/detokenize``, and on ``/metrics`` and the API docs
    (``/docs``, ``/redoc``, ``/openapi.json``) unless ``open_metrics`` / ``open_docs``;
    ``/health`` and ``/version`` are always open. ``chat_template``: overrides the
    tokenizer's. ``trust_request_chat_template``: accept a ``chat_template`` in requests
    (off: a template is code the server runs). ``max_request_body_bytes``: larger bodies
    get a 413 before they are read. ``max_prompts_per_request``,
    ``max_sequences_per_request`` (prompts x n): see :class:`OpenAIServing`.
    ``max_queued_sequences`` and ``max_queued_tokens`` (prompt + ``max_tokens`` per
    sequence; None: :func:`~llmlab.entrypoints.server.admission.default_max_tokens`): the work in
    flight, queued or running; a request that would pass either gets a 429 with
    ``Retry-After`` at once (:mod:`llmlab.entrypoints.server.admission`).
    ``allowed_origins``: CORS origins.
    ``shutdown_engine``: stop the engine's loop when the app shuts down.
    ``freeze_gc``: while the app serves, keep the garbage collector's full passes off
    everything alive when it started (:mod:`llmlab.utils.gc_heap`; ``llmlab serve``, whose
    process serves one engine, turns it on).
    ``return_tokens_as_token_ids``: the default of the request field of that name (vLLM's
    ``--return-tokens-as-token-ids``): logprob tokens as ``"token_id:{id}"``.
    ``enable_tokenizer_info_endpoint``: serve ``GET /tokenizer_info`` (vLLM's flag of that
    name; off by default as there: it shows the chat template and tokenizer settings; turn
    it on for lm-eval's ``tokenizer_backend=remote``, which reads it, then ``/tokenize``
    and ``/detokenize``). Behind the API key, as ``/tokenize`` is.
    ``response_role``: the role of chat responses' messages (vLLM's ``--response-role``).
    ``root_path``: the path prefix a proxy serves this app under (FastAPI's ``root_path``).
    ``enable_auto_tool_choice`` and ``tool_call_parser`` (vLLM's flags): ``tool_choice="auto"``
    (the default with tools), whose calls the parser finds in the model's text; the parser
    is a registered ``tool_parser`` name (``"hermes"``), a ``"module:Class"`` path or a
    class, checked here (:mod:`llmlab.entrypoints.server.tool_parsers`). Without them "auto" is a 400.
    ``tool_parser_config``: keyword arguments for a named parser's constructor (each stream
    gets a fresh parser built with them).
    ``lora_modules``: LoRA adapters to serve by name (``"name=path"``, vLLM's JSON form, or
    :class:`~llmlab.entrypoints.server.lora.LoRAModulePath`); they and ``/v1/load_lora_adapter`` need
    an engine with ``enable_lora`` (:mod:`llmlab.entrypoints.server.lora`).
    """
    names = list(served_model_names)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"served_model_names must be non-empty strings, got {names!r}")
    if not isinstance(response_role, str) or not response_role:
        raise ValueError(f"response_role must be a non-empty string, got {response_role!r}")
    parser = None
    if tool_call_parser is not None or tool_parser_config:
        from llmlab import registry
        from llmlab.entrypoints.server.tool_parsers import parser_factory

        if tool_parser_config:  # a factory of configured parsers (refused without a name)
            tool_call_parser = registry.factory("tool_parser", tool_call_parser,
                                                tool_parser_config)
        parser = parser_factory(tool_call_parser)
    if enable_auto_tool_choice and parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser "
                         "NAME; `llmlab components tool_parser` lists them)")
    root = (root_path or "").rstrip("/")
    if root and not root.startswith("/"):
        raise ValueError(f"root_path must start with '/', got {root_path!r}")
    serving = OpenAIServing(engine, names, model_path=model_path, chat_template=chat_template,
                            trust_request_chat_template=trust_request_chat_template,
                            max_prompts_per_request=max_prompts_per_request,
                            max_sequences_per_request=max_sequences_per_request,
                            admission=Admission(max_queued_sequences, default_max_tokens(
                                max_queued_sequences, engine.engine.max_model_len)
                                if max_queued_tokens is None else max_queued_tokens),
                            return_tokens_as_token_ids=return_tokens_as_token_ids,
                            response_role=response_role,
                            tool_parser=parser if enable_auto_tool_choice else None)
    serving.lora = serve_lora_modules(engine.engine, names, lora_modules)
    if isinstance(engine.engine, DataParallelEngine):
        # Series per replica (engine="0", ...) and for all of them (engine="all").
        dp = engine.engine
        metrics = DataParallelMetrics(names[0], dp.num_replicas, health=dp.health)
        dp.subscribe(metrics, replica=True)
    else:
        metrics = EngineMetrics(names[0])
        engine.engine.subscribe(metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            with frozen_heap(freeze_gc, collect=True):
                yield
        finally:
            engine.engine.unsubscribe(metrics)
            serving.close()
            if shutdown_engine:
                await asyncio.to_thread(engine.shutdown)

    app = FastAPI(
        title="llmlab OpenAI-compatible server", version=llmlab.__version__, lifespan=lifespan
    )
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.engine = engine

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)

    # Innermost: any exception a route lets out becomes a response here (a 500 with a
    # request id), and the connection stays usable.
    app.add_middleware(_CatchAllMiddleware)
    # Inside CORS (a browser can read the 429), outside everything that reads the body.
    app.add_middleware(_FullServerMiddleware, admission=serving.admission)
    if allowed_origins:
        # Credentials only for origins named one by one: with "*", any site could make a
        # user's browser send their credentials here.
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins),
            allow_credentials="*" not in allowed_origins,
            allow_methods=["*"], allow_headers=["*"],
        )
    # Outermost but the key check: a body too large is refused before it is read.
    app.add_middleware(_BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:
        protected = set(_KEYED_PATHS) | set(_POOLING_PATHS)
        if enable_tokenizer_info_endpoint:
            protected.add("/tokenizer_info")
        if not open_metrics:
            protected.add("/metrics")
        if not open_docs:
            protected.update(_DOC_PATHS)
        app.add_middleware(_APIKeyMiddleware, api_key=api_key, paths=frozenset(protected))
    if root:
        # Outermost: what FastAPI(root_path=...) did before FastAPI deprecated it.
        app.add_middleware(_RootPathMiddleware, root_path=root)

    # Declares the bearer scheme in /openapi.json; the middleware above enforces it (before
    # the body is even read, so a bad key is a 401 whatever the body holds).
    app.include_router(v1, dependencies=[Depends(_bearer)] if api_key else [])
    app.include_router(router)
    # /v1/embeddings, /pooling, /score, /rerank (llmlab.entrypoints.server.pooling): a 400 on a
    # generating engine, as vLLM answers.
    app.include_router(pooling_router)
    app.include_router(lora_router, dependencies=[Depends(_bearer)] if api_key else [])
    if enable_tokenizer_info_endpoint:
        app.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"],
                          response_model=p.TokenizerInfoResponse, responses=_PLAIN_ERRORS)
    _truthful_openapi(app)
    return app


# -- errors -----------------------------------------------------------------------------


class _ErrorJSON(JSONResponse):
    """Errors as ASCII JSON: a message that quotes the client's own text (a lone
    surrogate included) is still a valid body."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def _error_response(err: APIError) -> JSONResponse:
    return _ErrorJSON(err.body(), status_code=err.status, headers=err.headers or None)


async def _api_error(request: Request, err: APIError):
    return _error_response(err)


async def _validation_error(request: Request, err: RequestValidationError):
    return _error_response(_validation_api_error(err))


async def _http_error(request: Request, err: HTTPException):
    kind = "invalid_request_error" if err.status_code < 500 else "server_error"
    response = _error_response(APIError(str(err.detail), status=err.status_code, type=kind))
    for name, value in (getattr(err, "headers", None) or {}).items():
        response.headers[name] = value  # e.g. a 405's Allow
    return response


async def _internal_error(request: Request, err: Exception):
    return _error_response(_unexpected(err, request.method, request.url.path))


def _unexpected(err: BaseException, method: str, path: str) -> APIError:
    """The answer to an exception no route turned into an API error: a 400 for input
    pydantic refused or nested past Python's recursion limit, else a 500 naming a request
    id that the server log also names (with the traceback)."""
    if isinstance(err, (RequestValidationError, ValidationError)):
        return _validation_api_error(err)
    if isinstance(err, RecursionError):
        return APIError("the request is nested too deeply to process")
    request_id = p.random_id("err")
    logger.error("unhandled error on %s %s (request id %s)", method, path, request_id,
                 exc_info=err)
    return APIError(f"internal error: {type(err).__name__} (request id {request_id})",
                    status=500, type="server_error", code="internal_error",
                    headers={"X-Request-Id": request_id})


# -- routes: one function each; the serving object comes from app.state -------------------


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


Serving = Annotated[OpenAIServing, Depends(_serving)]

# The /v1 routes; build_app adds the API key's bearer scheme to them when it has a key.
v1 = APIRouter(prefix="/v1")
# The routes outside /v1 (no API key).
router = APIRouter()
_bearer = HTTPBearer(auto_error=False)
_STREAM_200 = {200: {"content": {"text/event-stream": {}},
                     "description": "JSON, or server-sent events with stream=true"}}


async def _run(coro):
    """Await a serving call, its errors as API errors."""
    try:
        return await coro
    except (ValueError, TypeError) as err:
        raise bad_request(err) from err
    except ReplicaFailedError as err:  # its replica died: the server's fault
        raise APIError(str(err), status=503, type="server_error") from err
    except RequestFailedError as err:
        raise APIError(str(err)) from err
    except (EngineError, EngineDeadError, ReplicasDeadError) as err:  # none can serve
        raise APIError(str(err), status=503, type="server_error") from err


def _respond(result):
    if isinstance(result, p.BaseModel):
        return result
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _peer(request: Request) -> str | None:
    """Who sent the request: the peer's host (behind a proxy uvicorn trusts, the
    forwarded client's), or None. Unlike ``user``, a client cannot choose it."""
    return request.client.host if request.client is not None else None


def _watcher(request: Request):
    async def disconnected():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return
    return disconnected


@v1.get("/models", response_model=p.ModelList, responses=_ERRORS)
async def list_models(serving: Serving):
    return serving.models()


@v1.post("/completions", response_model=p.CompletionResponse,
         responses={**_ERRORS, **_STREAM_200})
async def completions(body: p.CompletionRequest, request: Request, serving: Serving):
    refuse_generation(request)
    try:
        return _respond(await _run(serving.completions(body, _watcher(request),
                                                       _peer(request))))
    except ClientDisconnected:
        return Response(status_code=499)


@v1.post("/chat/completions", response_model=p.ChatCompletionResponse,
         responses={**_ERRORS, **_STREAM_200})
async def chat_completions(body: p.ChatCompletionRequest, request: Request, serving: Serving):
    refuse_generation(request)
    try:
        return _respond(await _run(serving.chat(body, _watcher(request), _peer(request))))
    except ClientDisconnected:
        return Response(status_code=499)


@router.post("/tokenize", response_model=p.TokenizeResponse, responses=_PLAIN_ERRORS)
async def tokenize(body: p.TokenizeRequest, serving: Serving):
    return await _run(asyncio.to_thread(serving.tokenize, body))


@router.post("/detokenize", response_model=p.DetokenizeResponse, responses=_PLAIN_ERRORS)
async def detokenize(body: p.DetokenizeRequest, serving: Serving):
    return await _run(asyncio.to_thread(serving.detokenize, body))


async def tokenizer_info(serving: Serving):
    """``GET /tokenizer_info`` (only with ``enable_tokenizer_info_endpoint``)."""
    return await _run(asyncio.to_thread(serving.tokenizer_info))


@router.get("/health", response_class=Response,
            responses={200: {"description": "Healthy (empty body), or degraded: some "
                             "data-parallel replicas are dead or unresponsive (a JSON "
                             "body says which)"},
                       **_PLAIN_ERRORS})
async def health(request: Request):
    try:
        await request.app.state.engine.check_health()
    except (EngineError, EngineDeadError) as err:
        raise APIError(str(err), status=503, type="server_error") from err
    full = request.app.state.serving.admission.full_reason()
    if full is not None:  # new requests would get a 429 now
        raise APIError(f"the server is at capacity: {full}", status=503, type="server_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    replicas = getattr(request.app.state.engine.engine, "health", None)
    if replicas is not None:  # data parallelism: serving while some replicas are dead
        statuses = replicas()
        if any(s.status != "ok" for s in statuses):
            body = {"status": "degraded", "replicas": [s.to_json() for s in statuses]}
            return JSONResponse(body, status_code=200)
    return Response(status_code=200)


@router.get("/version", response_model=p.VersionResponse)
async def version():
    return p.VersionResponse(version=llmlab.__version__)


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text format"}})
async def prometheus_metrics(request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# -- helpers ------------------------------------------------------------------------------


def _validation_api_error(err) -> APIError:
    """FastAPI's validation error as one 400 naming the first bad field."""
    errors = err.errors()
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    if kind == "json_invalid":
        ctx = first.get("ctx", {}) or {}
        return APIError(f"the body is not valid JSON: {ctx.get('error', first.get('msg'))}")
    param = _field_path(first.get("loc", ()))
    where = f"{param}: " if param else "the body: "
    # A value that fits none of a union's types fails once per type: say it once.
    same = [e for e in errors if _field_path(e.get("loc", ())) == param]
    if len(same) > 1:
        message = f"{where}{_short(first.get('input'))} is none of the allowed types"
    else:
        message = f"{where}{first.get('msg', 'invalid request')}"
        if "input" in first and kind != "missing":
            message += f" (got {_short(first['input'])})"
    if len(errors) > len(same):
        message += f" (and {len(errors) - len(same)} more problem(s))"
    return APIError(message, param=param)


def _field_path(loc) -> str | None:
    """``body.messages.0.role`` -> ``messages.0.role``, without pydantic's union-member
    tags (``list[int]``, ``str``, ...), which are not fields."""
    parts = []
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int) or (str(part).isidentifier() and str(part) not in _TYPE_TAGS):
            parts.append(str(part))
    return ".".join(parts) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after",
              "function-plain"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Outside /v1, the paths the API key guards: the tokenizer endpoints always, the metrics
# and the API docs unless opened (build_app).
_KEYED_PATHS = ("/tokenize", "/detokenize")
_DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


def _route_path(scope) -> str:
    """The path the app routes on: without the ``root_path`` prefix when a proxy passed it
    on (as Starlette's router strips it), so ``/prefix/v1/...`` is guarded as ``/v1/...``."""
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


class _CatchAllMiddleware:
    """Any exception out of a route becomes a response (:func:`_unexpected`) instead of
    reaching the server, which would log it and close the connection. If the response
    had already started (a stream), it is ended cleanly: an SSE error event for a stream,
    then the end of the body."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = ended = False
        event_stream = False

        async def tracked(message) -> None:
            nonlocal started, ended, event_stream
            if message["type"] == "http.response.start":
                started = True
                content_type = dict(message.get("headers") or ()).get(b"content-type", b"")
                event_stream = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as err:  # noqa: BLE001 - answered, never re-raised
            error = _unexpected(err, scope.get("method", ""), scope.get("path", ""))
            if not started:
                await _error_response(error)(scope, receive, send)
            elif not ended:
                body = b""
                if event_stream:
                    payload = json.dumps(error.body(), ensure_ascii=True)
                    body = f"data: {payload}\n\n".encode()
                await send({"type": "http.response.body", "body": body, "more_body": False})


# The routes that queue engine work: refused before their body is read when the server
# cannot take even the smallest request.
_WORK_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings",
                         "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank",
                         "/v2/rerank", "/classify", "/v1/classify"})


class _FullServerMiddleware:
    """A 429 for a request to a work route while the server is full, answered before
    the body is read or parsed: under a flood, a refusal costs the event loop almost
    nothing, so it comes back at once however many wait."""

    def __init__(self, app, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST" \
                and _route_path(scope).rstrip("/") in _WORK_PATHS:
            full = self.admission.full_reason()
            if full is not None:
                # Read the body (unparsed, bounded by the body limit outside) so that the
                # client, still sending, reads the 429 rather than a reset connection.
                message = {"more_body": True}
                while message.get("more_body") and message.get("type") != "http.disconnect":
                    message = await receive()
                await _error_response(busy(full))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _RootPathMiddleware:
    """Serve under ``root_path`` (a proxy's prefix): requests may come with the prefix
    (routed without it) or without it (a proxy that strips it), and ``/openapi.json``
    names the prefix as its server, as uvicorn's ``--root-path`` does."""

    def __init__(self, app, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


class _APIKeyMiddleware:
    """Require ``Authorization: Bearer KEY`` on every ``/v1`` route and on ``paths`` (pure
    ASGI, so the key is checked before the body is read)."""

    def __init__(self, app, api_key: str, paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.paths = paths

    async def __call__(self, scope, receive, send) -> None:
        path = _route_path(scope)
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not (
            path == "/v1" or path.startswith("/v1/") or path.rstrip("/") in self.paths
        ):
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        err = APIError("missing or wrong API key (send Authorization: Bearer <key>)",
                       status=401, code="invalid_api_key")
        await JSONResponse(err.body(), status_code=401)(scope, receive, send)


class _BodyLimitMiddleware:
    """413 for a request body over ``max_bytes``: at once from ``Content-Length``, else as
    soon as the streamed body passes it (pure ASGI: nothing larger is ever buffered)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send) -> None:
        err = APIError(f"the request body is larger than {self.max_bytes} bytes", status=413)
        await _error_response(err)(scope, receive, send)


class _BodyTooLarge(BaseException):
    """Raised out of the app's body read; a BaseException so the app's own handlers (which
    catch Exception and answer 500) let it through to the middleware that answers 413."""


def _truthful_openapi(app) -> None:
    """Drop FastAPI's default 422 responses from the schema: this server answers 400."""
    original = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = original()
        for path in schema.get("paths", {}).values():
            for op in path.values():
                if isinstance(op, dict):
                    op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi

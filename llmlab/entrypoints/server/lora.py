"""LoRA adapters served by name (vLLM's ``--lora-modules`` and runtime loading).

``llmlab serve --enable-lora --lora-modules name=path ...`` (or vLLM's JSON form
``'{"name": ..., "path": ..., "base_model_name": ...}'``) serves each adapter under its
name: a request whose ``model`` names it runs with it, ``/v1/models`` lists it (``parent``:
the base model, ``root``: its name; vLLM lists the adapter's path there, which tells
clients about the server's filesystem, so paths are listed only when asked for with
``list_paths``). ``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and
``POST /v1/unload_lora_adapter`` (``{"lora_name"}``) add and remove adapters while serving,
with vLLM's answers: a plain-text success, a 400 for an adapter already loaded, one that
cannot run (the engine's check names the field) or a name that is not one (empty, over
:data:`~llmlab.lora.request.MAX_LORA_NAME_CHARS` characters, not valid Unicode), a 404 for
an unknown name or a path with no adapter (one answer, whatever is at the path).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from typing import Annotated, Any

import attrs
from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from llmlab.lora.adapter import AdapterNotFoundError
from llmlab.lora.request import LoRARequest, check_lora_name
from llmlab.entrypoints.server import protocol as p
from llmlab.entrypoints.server.errors import APIError

Str = Annotated[str, Field(strict=True)]


@attrs.frozen
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's ``LoRAModulePath``)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: Sequence[str] | None) -> list[LoRAModulePath]:
    """``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}`` per entry;
    ``ValueError`` naming ``--lora-modules`` for anything else."""
    modules = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except ValueError as err:
                raise ValueError(f"--lora-modules {value!r} is not valid JSON: {err}") from None
            if not isinstance(spec, dict):
                raise ValueError(f"--lora-modules {value!r} must be a JSON object")
            unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
            if not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
                raise ValueError(
                    f"--lora-modules {value!r} needs string 'name' and 'path' fields"
                )
            if unknown:
                raise ValueError(f"--lora-modules {value!r} has unknown field(s) {unknown}")
            modules.append(LoRAModulePath(spec["name"], spec["path"],
                                          spec.get("base_model_name")))
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(
                f"--lora-modules {value!r} must be name=path or a JSON object with name "
                "and path"
            )
        modules.append(LoRAModulePath(name, path))
    for module in modules:
        try:
            check_lora_name(module.name, "name")
        except ValueError as err:
            raise ValueError(f"--lora-modules: {err}") from None
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}")
    return modules


@attrs.define
class LoRAAdapters:
    """The adapters a server serves, by name, over the engine's adapter store.

    Attributes:
        store: the engine's :class:`~llmlab.lora.store.AdapterStore` (None: the engine
            was built without ``enable_lora``; every load is refused).
        base_model: the served model's name (each adapter's ``parent``).
        reserved: names a request's ``model`` already means (the served model's names).
        list_paths: ``/v1/models`` gives each adapter's path as its ``root`` (vLLM's
            answer; off: its name, so a client learns nothing of the filesystem).
    """

    store: Any
    base_model: str
    reserved: frozenset[str] = frozenset()
    list_paths: bool = False
    _by_name: dict[str, LoRARequest] = attrs.field(init=False, factory=dict)
    _next_id: int = attrs.field(init=False, default=1)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Load and check an adapter, then serve it as ``name``. Raises ``APIError``: 400
        for a name in use or an adapter that cannot run, 404 for a path with no adapter."""
        if self.store is None:
            raise APIError("loading a LoRA adapter needs a server started with --enable-lora",
                           param="lora_name")
        if not name or not path:
            raise APIError("lora_name and lora_path must both be given",
                           param="lora_name" if not name else "lora_path")
        _check_name(name)
        with self._lock:
            if name in self._by_name or name in self.reserved:
                raise APIError(f"The lora adapter '{name}' has already been loaded.",
                               param="lora_name")
            lora_id, self._next_id = self._next_id, self._next_id + 1
        try:
            lora = LoRARequest(name, lora_id, path, base_model_name=base_model_name)
            self.store.get(lora)
        except AdapterNotFoundError as err:
            raise APIError(str(err), status=404, param="lora_path",
                           code="lora_adapter_not_found") from None
        except (ValueError, TypeError) as err:
            raise APIError(str(err), param="lora_path") from None
        with self._lock:
            if name in self._by_name:
                self.store.remove(lora_id)
                raise APIError(f"The lora adapter '{name}' has already been loaded.",
                               param="lora_name")
            self._by_name[name] = lora
        return lora

    def unload(self, name: str) -> LoRARequest:
        """Stop serving ``name`` (requests already running finish with it); 404 when it is
        not served."""
        _check_name(name)
        with self._lock:
            lora = self._by_name.pop(name, None)
        if lora is None:
            raise APIError(f"The lora adapter '{name}' cannot be found.", status=404,
                           param="lora_name", code="lora_adapter_not_found")
        if self.store is not None:
            self.store.remove(lora.lora_int_id)
        return lora

    def cards(self, created: int, max_model_len: int) -> list[p.ModelCard]:
        return [
            p.ModelCard(id=lora.lora_name, created=created,
                        root=lora.lora_path if self.list_paths else lora.lora_name,
                        parent=self.base_model, max_model_len=max_model_len)
            for lora in list(self._by_name.values())
        ]


def _check_name(name: str) -> None:
    """A 400 naming ``lora_name`` for a name no adapter may have (every answer that
    echoes or lists it must stay encodable and short)."""
    try:
        check_lora_name(name)
    except ValueError as err:
        raise APIError(str(err), param="lora_name") from None


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: Str
    lora_path: Str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: Str
    lora_int_id: int | None = None


def _adapters(request: Request) -> LoRAAdapters:
    return request.app.state.serving.lora


Adapters = Annotated[LoRAAdapters, Depends(_adapters)]
# Success is plain text (vLLM's); the errors are JSON. Declared per status, so the OpenAPI
# schema names the media type each one really has (response_class=PlainTextResponse would
# document the JSON errors as text/plain too).
_RESPONSES = {
    200: {"description": "Success message",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
    400: {"model": p.ErrorResponse, "description": "Already loaded, or cannot run"},
    404: {"model": p.ErrorResponse, "description": "No such adapter"},
}

# Under /v1, so the API key guards them as it guards the other /v1 routes.
router = APIRouter(prefix="/v1")


@router.post("/load_lora_adapter", responses=_RESPONSES)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, adapters: Adapters):
    # Reading and checking the files runs off the event loop.
    await asyncio.to_thread(adapters.load, body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/unload_lora_adapter", responses=_RESPONSES)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, adapters: Adapters):
    adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def serve_lora_modules(engine: Any, served_names: Sequence[str],
                       modules: Sequence[LoRAModulePath | str], *,
                       list_paths: bool = False) -> LoRAAdapters:
    """The server's :class:`LoRAAdapters` over ``engine``'s adapter store, with
    ``modules`` loaded (``ValueError`` naming the one that cannot run). ``list_paths``:
    ``/v1/models`` shows adapter paths (off by default)."""
    store = getattr(engine, "lora", None)
    adapters = LoRAAdapters(store, served_names[0], frozenset(served_names), list_paths)
    strings = [m for m in modules if isinstance(m, str)]
    parsed = parse_lora_modules(strings) + [m for m in modules if not isinstance(m, str)]
    if parsed and store is None:
        raise ValueError("--lora-modules needs an engine with LoRA: add --enable-lora")
    if store is not None:
        store.base_model_names.update(served_names)  # what base_model_name may say
    for module in parsed:
        try:
            adapters.load(module.name, module.path, module.base_model_name)
        except APIError as err:
            raise ValueError(f"--lora-modules {module.name!r}: {err.message}") from None
    return adapters

"""The server's errors: :class:`APIError` (OpenAI's ``{"error": {...}}`` with an HTTP
status), :class:`ClientDisconnected`, and :func:`bad_request` for the engine's own checks."""

from __future__ import annotations

import re
from collections.abc import Sequence

from llmlab.entrypoints.server import protocol as p


class APIError(Exception):
    """An error to send as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: int | str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = status if code is None else code
        self.headers = headers or {}

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

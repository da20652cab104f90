"""The server's errors as OpenAI answers them (``{"error": {"message", "type", "param", "code"}}``), and the ASGI
middleware that keeps an escaped exception a JSON 500 on a live connection."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from edgeq.errors import DamagedCheckpointError

log = logging.getLogger("edgeq.serve")

# The ``code`` of an error when the raising site names none.
_DEFAULT_CODES = {400: "invalid_value", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
                  429: "rate_limit_exceeded", 500: "internal_error",
                  503: "server_shutting_down"}


class ApiError(Exception):
    """An HTTP error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.code = code or _DEFAULT_CODES.get(status, "error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def busy(engine) -> ApiError:
    """The 429 for a request that finds the queue full."""
    return ApiError(429, f"server busy: one generation running and {engine.queue_size} waiting; retry later",
                    "rate_limit_error")


class ServerStopping(Exception):
    """A generation the server stopped (or never started) because it is shutting down (SIGTERM, Ctrl-C)."""


def stopping() -> ApiError:
    """The 503 for a request the server will not finish because it is shutting down."""
    return ApiError(503, "server shutting down: this request was not completed; retry on a running server",
                    "server_error", code="server_shutting_down")


def generation_error(exc: BaseException) -> ApiError:
    """The answer to a generation that did not finish: 503 when the server stopped it (:class:`ServerStopping`); a
    500 for one that raised, a damaged checkpoint named as such, anything else internal."""
    if isinstance(exc, ServerStopping):
        return stopping()
    if isinstance(exc, DamagedCheckpointError):
        log.error("damaged checkpoint: %s", exc)
        return ApiError(500, str(exc), "server_error", code="damaged_checkpoint")
    log.error("generation failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


class Contain:
    """ASGI middleware: an exception that escapes a handler becomes a JSON 500 on the same keep-alive connection.

    Starlette's own catch-all answers too but then re-raises, so uvicorn logs it as a crash and closes the
    connection; here the traceback is logged once and the connection stays usable.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if scope["type"] != "http" or started:
                raise
            log.error("request failed", exc_info=exc)
            await ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()(
                scope, receive, send)

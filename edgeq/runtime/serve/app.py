"""The FastAPI app over one loaded model: its routes (:class:`~edgeq.runtime.serve.handlers.Handlers`), its error
answers (every error a JSON ``{"error": ...}`` body) and its worker (:class:`~edgeq.runtime.serve.engine.Engine`)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgeq.errors import EdgeqError
from edgeq.runtime.serve.engine import Engine
from edgeq.runtime.serve.errors import ApiError, Contain
from edgeq.runtime.serve.handlers import Handlers
from edgeq.runtime.sizes import parse_bytes


def served_name(lm, model_name: str | None) -> str:
    """The id clients ask for: ``model_name``, else the checkpoint directory's name (resolved: ``edgeq serve .``
    served the id ``""``)."""
    return model_name or Path(lm.path).resolve().name or str(lm.path)


def create_app(lm, *, queue_size: int = 8, max_body_bytes: int | str = 1 << 20, model_name: str | None = None,
               pool=None) -> FastAPI:
    """The FastAPI app for a loaded model (``edgeq.runtime.load``); a model without a tokenizer is refused here,
    before serving, rather than with an error on every request."""
    if lm.tokenizer is None:
        raise EdgeqError(f"{lm.path}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json); the server "
                         f"needs them to read prompts and write text: copy them from the source model")
    limit = parse_bytes(max_body_bytes, "max_body_bytes")
    engine = Engine(lm, queue_size, pool)  # pool: the thread the model was loaded on (engine.worker)
    handlers = Handlers(lm, served_name(lm, model_name), engine, limit)
    app = FastAPI(title="edgeq", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Contain)
    app.state.engine = engine
    app.router.on_shutdown.append(engine.shutdown)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_api_route("/health", handlers.health, methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    app.get("/v1/models")(handlers.models)
    app.get("/v1/models/{model_id:path}")(handlers.model)
    app.post("/v1/completions")(handlers.completions)
    app.post("/v1/chat/completions")(handlers.chat_completions)
    return app


async def _api_error(_request, exc: ApiError):
    return exc.response()


async def _http_error(request: Request, exc: StarletteHTTPException):
    """Starlette's own errors (unknown path 404, wrong method 405) in the same JSON shape."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()

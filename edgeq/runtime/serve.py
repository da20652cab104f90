"""An OpenAI-compatible HTTP server (FastAPI on uvicorn) over one loaded model.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream`` via server-sent events),
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``. Request fields: ``model`` (the served name or
omitted; another name gets 404 ``model_not_found``), ``max_tokens`` (chat also ``max_completion_tokens``),
``temperature`` 0..2, ``top_p`` (0, 1], ``stop`` (up to 4), ``seed`` (a signed 64-bit integer), ``logprobs``
(completions: an int 0..5; chat: a bool plus ``top_logprobs`` 0..20), ``stream_options.include_usage``, and edgeq's
``ignore_eos``. ``n`` must be 1. Fields edgeq cannot honour (``tools``, ``response_format``, penalties, ...: see
``UNSUPPORTED``) get 400 ``unsupported_parameter`` unless they carry their neutral value; unknown fields are ignored.

One generation runs at a time, on a dedicated worker thread (the model and its KV cache are single-sequence);
up to ``queue_size`` more requests wait; beyond that a request gets 429 at once. Bodies over ``max_body_bytes`` get
413; prompts that do not fit the context (``max_model_len`` / KV cache) get 400. Every error is a JSON body
``{"error": {"message", "type", "param", "code"}}`` with a string ``code``; a fault of the checkpoint found while
generating (:class:`DamagedCheckpointError`) is a 500 ``damaged_checkpoint``, any other failure a 500
``internal_error``, and neither closes the connection or stops the server. A client that disconnects, streaming or
not, cancels its generation at the next token (or before it starts, if it was waiting).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgeq.errors import DamagedCheckpointError, EdgeqError
from edgeq.runtime.generation import Delta, Generation, GenerationResult, SamplingParams, encode_prompt
from edgeq.runtime.sizes import parse_bytes

try:
    from jinja2 import TemplateError  # what a chat template raises for messages it refuses
except ImportError:  # without jinja2 there are no chat templates, so nothing to catch
    class TemplateError(Exception):
        pass

log = logging.getLogger("edgeq.serve")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1

# The ``code`` of an error when the raising site names none.
_DEFAULT_CODES = {400: "invalid_value", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
                  429: "rate_limit_exceeded", 500: "internal_error"}

# OpenAI / vLLM fields edgeq cannot honour, with the values that mean "not used" (accepted, nothing to do).
UNSUPPORTED: dict[str, tuple] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "repetition_penalty": (None, 1), "top_k": (None, 0, -1), "min_p": (None, 0),
    "best_of": (None, 1), "suffix": (None, ""), "echo": (None, False), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "web_search_options": (None,),
}


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


def _busy(engine: "Engine") -> ApiError:
    return ApiError(429, f"server busy: one generation running and {engine.queue_size} waiting; retry later",
                    "rate_limit_error")


def _generation_error(exc: BaseException) -> ApiError:
    """The 500 for a generation that raised: a damaged checkpoint is named as such, anything else is internal."""
    if isinstance(exc, DamagedCheckpointError):
        log.error("damaged checkpoint: %s", exc)
        return ApiError(500, str(exc), "server_error", code="damaged_checkpoint")
    log.error("generation failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


class _Contain:
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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by both endpoints; ``null`` means "the default", as in OpenAI's API."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    ignore_eos: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    max_tokens: int = Field(16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=5)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class Engine:
    """Runs jobs one at a time on one worker thread; at most ``queue_size`` wait behind the running one."""

    def __init__(self, lm, queue_size: int):
        self.lm = lm
        self.queue_size = queue_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgeq-generate")
        self._lock = threading.Lock()
        self.pending = 0  # running + waiting
        self.running = 0

    def submit(self, job: Callable[[], Any]) -> Future | None:
        with self._lock:
            if self.pending >= self.queue_size + 1:
                return None
            self.pending += 1
        return self._pool.submit(self._run, job)

    def _run(self, job):
        with self._lock:
            self.running = 1
        try:
            return job()
        finally:
            with self._lock:
                self.pending -= 1
                self.running = 0

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _not_json(constant: str):
    raise ValueError(f"{constant} is not valid JSON")


async def _read_json(request: Request, limit: int) -> dict:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body is {int(length)} bytes; this server accepts at most {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes this server accepts")
    try:
        data = json.loads(body, parse_constant=_not_json)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from e
    if not isinstance(data, dict):
        raise ApiError(400, "the JSON body must be an object", code="invalid_json")
    return data


_UNION_TAGS = {"str", "int", "float", "bool", "dict"}  # pydantic names the union member in an error's location


def _where(loc: tuple) -> str:
    """``("messages", 0, "role")`` -> ``messages[0].role``; union-member tags (``list[str]``) are left out."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p not in _UNION_TAGS and "[" not in p:
            out += f".{p}" if out else p
    return out


def _validation_code(kind: str) -> str:
    if kind == "missing":
        return "missing_required_parameter"
    return "invalid_type" if kind.endswith(("_type", "_parsing")) or kind == "int_from_float" else "invalid_value"


def _parse(model_cls, data: dict):
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = _where(first.get("loc", ())) or None
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        raise ApiError(400, message, param=where, code=_validation_code(first.get("type", ""))) from e


def _refuse_unsupported(data: dict) -> None:
    """400 naming every field of ``UNSUPPORTED`` the request sets to something other than its neutral value."""
    bad = [k for k, neutral in UNSUPPORTED.items() if k in data and data[k] not in neutral]
    if bad:
        given = ", ".join(f"{k}={json.dumps(data[k])[:40]}" for k in bad)
        neutral = ", ".join(f"{k}={json.dumps(UNSUPPORTED[k][1])}" for k in bad if len(UNSUPPORTED[k]) > 1)
        raise ApiError(400, f"{given}: not supported by this server; omit {'them' if len(bad) > 1 else 'it'}"
                            + (f" (or send {neutral})" if neutral else ""), param=bad[0], code="unsupported_parameter")


def _stops(stop) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(400, "stop: at most 4 non-empty strings", param="stop")
    return stops


def _created(lm) -> int:
    """When the checkpoint was written (its config.json's mtime), else now: the models list's ``created``."""
    for p in (lm.path / "config.json", lm.path):
        try:
            return int(p.stat().st_mtime)
        except OSError:
            continue
    return int(time.time())


async def _until_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set ``cancel`` when the client goes away (the body is already read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel.set()


def create_app(lm, *, queue_size: int = 8, max_body_bytes: int | str = 1 << 20, model_name: str | None = None) -> FastAPI:
    """The FastAPI app for a loaded model (``edgeq.runtime.load``); a model without a tokenizer is refused here,
    before serving, rather than with an error on every request."""
    if lm.tokenizer is None:
        raise EdgeqError(f"{lm.path}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json); the server "
                         f"needs them to read prompts and write text: copy them from the source model")
    limit = parse_bytes(max_body_bytes, "max_body_bytes")
    name = model_name or lm.path.name
    engine = Engine(lm, queue_size)
    context = min(lm.settings.max_model_len, lm.cache.capacity)
    card = {"id": name, "object": "model", "created": _created(lm), "owned_by": "edgeq",
            "max_model_len": lm.settings.max_model_len}
    app = FastAPI(title="edgeq", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Contain)
    app.state.engine = engine
    app.router.on_shutdown.append(engine.shutdown)

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()

    def _unknown_model(model: str) -> ApiError:
        return ApiError(404, f"model `{model}` does not exist; this server serves `{name}` (GET /v1/models)",
                        param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "running": engine.running, "waiting": max(0, engine.pending - engine.running),
                "queue_size": engine.queue_size, "max_model_len": lm.settings.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != name:
            raise _unknown_model(model_id)
        return card

    async def _request(request: Request, model_cls):
        """The body as ``model_cls``: size, JSON, served model (404), unsupported fields, then types and bounds."""
        data = await _read_json(request, limit)
        if isinstance(data.get("model"), str) and data["model"] not in ("", name):
            raise _unknown_model(data["model"])
        _refuse_unsupported(data)
        return _parse(model_cls, data)

    def _prepare(prompt_ids: list[int], req, max_tokens: int | None, logprobs: int | None) -> Generation:
        chat = isinstance(req, ChatRequest)
        n = len(prompt_ids)
        if n >= context:
            raise ApiError(400, f"prompt is {n} tokens; the context holds {context} including at least one generated "
                                f"token; shorten the prompt", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = context - n
        elif n + max_tokens > context:
            field = "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"
            raise ApiError(400, f"{field}={max_tokens}: the request needs {n + max_tokens} tokens (prompt {n} + "
                                f"{max_tokens}) but the context holds {context}; lower {field} or shorten the prompt",
                           param=field, code="context_length_exceeded")
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                    stop=_stops(req.stop), logprobs=logprobs, ignore_eos=req.ignore_eos)
            return Generation(lm, prompt_ids, params)
        except EdgeqError as e:
            raise ApiError(400, str(e)) from e

    def _encode(prompt, chat: bool) -> list[int]:
        field = "messages" if chat else "prompt"
        if chat and lm.tokenizer is not None and not getattr(lm.tokenizer, "chat_template", None):
            raise ApiError(400, f"model `{name}` has no chat template; send a plain prompt to POST /v1/completions",
                           param=field, code="no_chat_template")
        try:
            return encode_prompt(lm, prompt, chat)
        except (EdgeqError, TemplateError) as e:
            raise ApiError(400, f"{field}: {e}", param=field) from e

    def _token_text(token_id: int) -> str:
        return lm.tokenizer.decode([token_id])

    def _completion_logprobs(lps, offset: int) -> dict | None:
        if not lps:
            return None
        tokens = [_token_text(lp.token_id) for lp in lps]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{_token_text(i): v for i, v in lp.top} for lp in lps], "text_offset": offsets}

    def _chat_logprobs(lps) -> dict | None:
        if not lps:
            return None

        def entry(i, v):
            t = _token_text(i)
            return {"token": t, "logprob": v, "bytes": list(t.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in lps]}

    def _usage(r: GenerationResult) -> dict:
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.token_ids),
                "total_tokens": r.prompt_tokens + len(r.token_ids)}

    def _finish(r: GenerationResult) -> str:
        return "stop" if r.finish_reason == "stop" else "length"

    async def _run(request: Request, gen: Generation, stream: bool, chunk: Callable[[Delta], dict | None],
                   final: Callable[[GenerationResult], list[dict]], whole: Callable[[GenerationResult], dict]):
        """Queue ``gen`` on the worker. Until the response starts (all of it for ``stream=False``, the first delta
        for a stream) a client disconnect cancels the generation; a stream's is cancelled when sending fails.
        A failure before the response starts is an HTTP 500; later in a stream, an error event."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        gen.cancel = cancel.is_set

        def put(item):
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                cancel.set()

        def job():
            try:
                if not cancel.is_set():  # a client that left while waiting costs no prefill
                    for d in gen:
                        put(("delta", d))
                put(("done", gen.result))
            except Exception as e:  # answered by _generation_error
                put(("error", e))

        if engine.submit(job) is None:
            raise _busy(engine)
        watcher = asyncio.create_task(_until_disconnect(request, cancel))
        try:
            kind, value = await events.get()
            while not stream and kind == "delta":
                kind, value = await events.get()
        finally:
            watcher.cancel()
        if kind == "error":
            raise _generation_error(value)
        if not stream:
            return whole(value)

        async def sse():
            item = (kind, value)
            try:
                while True:
                    if item[0] == "delta":
                        c = chunk(item[1])
                        if c is not None:
                            yield _sse(c)
                    elif item[0] == "done":
                        for c in final(item[1]):
                            yield _sse(c)
                        yield "data: [DONE]\n\n"
                        return
                    else:
                        yield _sse(_generation_error(item[1]).body())
                        yield "data: [DONE]\n\n"
                        return
                    item = await events.get()
            finally:
                cancel.set()  # a client that went away stops its generation at the next token

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _request(request, CompletionRequest)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: one prompt per request (batching is not supported)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt or not all(0 <= t < lm.model.config.vocab_size for t in prompt):
                raise ApiError(400, f"prompt: token ids must be a non-empty list of ids in [0, "
                                    f"{lm.model.config.vocab_size})", param="prompt")
            ids = list(prompt)
        else:
            ids = _encode(prompt, chat=False)
        gen = _prepare(ids, req, req.max_tokens, req.logprobs)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        emitted = [0]

        def base(choices, usage=None):
            return {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices,
                    **({"usage": usage} if usage is not None else {})}

        def chunk(d: Delta):
            if not d.text and not d.logprobs:
                return None
            lp = _completion_logprobs(list(d.logprobs), emitted[0])
            emitted[0] += len(d.text)
            return base([{"index": 0, "text": d.text, "logprobs": lp, "finish_reason": None}])

        def final(r):
            out = [base([{"index": 0, "text": "", "logprobs": None, "finish_reason": _finish(r)}])]
            if include_usage:
                out.append(base([], _usage(r)))
            return out

        def whole(r):
            return base([{"index": 0, "text": r.text, "logprobs": _completion_logprobs(r.logprobs, 0),
                          "finish_reason": _finish(r)}], _usage(r))

        return await _run(request, gen, req.stream, chunk, final, whole)

    def _chat_messages(req: ChatRequest) -> list[dict]:
        """The messages for the chat template: text parts joined, ``developer`` as ``system``; other parts refused."""
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported (type "
                                            f"\"text\" with a string \"text\"), got type {json.dumps(part.get('type'))}",
                                       param="messages", code="unsupported_value")
                content = "".join(part["text"] for part in content)
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        return messages

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _request(request, ChatRequest)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
        ids = _encode(_chat_messages(req), chat=True)
        top = req.top_logprobs if req.top_logprobs is not None else 0
        gen = _prepare(ids, req, req.max_completion_tokens or req.max_tokens, top if req.logprobs else None)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        started = [False]

        def base(choices, usage=None):
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name, "choices": choices,
                    **({"usage": usage} if usage is not None else {})}

        def chunk(d: Delta):
            delta = {} if started[0] else {"role": "assistant"}
            started[0] = True
            if not d.text and not d.logprobs and "role" not in delta:
                return None
            delta["content"] = d.text
            return base([{"index": 0, "delta": delta, "logprobs": _chat_logprobs(list(d.logprobs)), "finish_reason": None}])

        def final(r):
            out = [base([{"index": 0, "delta": {} if started[0] else {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": _finish(r)}])]
            if include_usage:
                out.append(base([], _usage(r)))
            return out

        def whole(r):
            return {"id": rid, "object": "chat.completion", "created": created, "model": name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                                 "logprobs": _chat_logprobs(r.logprobs), "finish_reason": _finish(r)}],
                    "usage": _usage(r)}

        return await _run(request, gen, req.stream, chunk, final, whole)

    return app


def serve_command(path: str, host: str = "127.0.0.1", port: int = 8000, max_model_len: int | None = None,
                  kv_cache_bytes: str = "256MiB", queue_size: int = 8, max_body_bytes: str = "1MiB",
                  model_name: str | None = None, strict_layout: bool = False, threads: int | None = None,
                  as_json: bool = False, quiet: bool = False) -> None:
    """`edgeq serve PATH`: load the checkpoint, bind, say where, and serve the OpenAI-compatible API.

    The socket is bound before the startup line is printed (one line on stderr; with ``as_json`` one JSON line on
    stdout, :func:`startup_record`), so a client that has read the line can connect, and ``--port 0`` reports the
    port the OS chose. ``quiet`` and ``as_json`` keep uvicorn to warnings (no access log on stdout)."""
    import uvicorn  # noqa: PLC0415

    from edgeq.console import emit_line, say  # noqa: PLC0415
    from edgeq.runtime.generation import describe_paths  # noqa: PLC0415
    from edgeq.runtime.loader import load  # noqa: PLC0415

    if queue_size < 0:
        raise EdgeqError(f"queue_size={queue_size}: must be >= 0")
    lm = load(path, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes, strict_layout=strict_layout, threads=threads)
    app = create_app(lm, queue_size=queue_size, max_body_bytes=max_body_bytes, model_name=model_name)
    sock = _listen(host, port)
    record = startup_record(lm, host, sock.getsockname()[1], model_name or lm.path.name)
    s = lm.settings
    if as_json:
        emit_line(record)
    else:
        say(f"edgeq serve: {path} ({describe_paths(s)}, max_model_len {s.max_model_len}, KV cache "
            f"{s.max_cached_tokens} tokens) on {record['url']}", quiet)
    calm = quiet or as_json
    config = uvicorn.Config(app, host=host, port=record["port"], log_level="warning" if calm else "info",
                            access_log=not calm)
    uvicorn.Server(config).run(sockets=[sock])


def _listen(host: str, port: int):
    """A listening TCP socket on host:port (port 0: any free port); a port in use is an EdgeqError naming --port."""
    import socket  # noqa: PLC0415

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise EdgeqError(f"--host {host} --port {port}: cannot listen ({e.strerror}); choose another port "
                         f"(--port 0 picks a free one) or host") from e


def startup_record(lm, host: str, port: int, model_name: str) -> dict:
    """``edgeq serve --json``'s first stdout line: where the server listens and what it runs."""
    import os  # noqa: PLC0415

    s = lm.settings
    shown = f"[{host}]" if ":" in host else host
    return {"event": "listening", "url": f"http://{shown}:{port}", "host": host, "port": port, "pid": os.getpid(),
            "model": str(lm.path), "model_name": model_name, "scheme": s.scheme or "bf16",
            "decode_path": s.decode_path, "prefill_path": s.prefill_path, "prefill_crossover": s.prefill_crossover,
            "max_model_len": s.max_model_len, "max_cached_tokens": s.max_cached_tokens, "threads": s.threads}

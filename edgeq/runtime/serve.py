"""An OpenAI-compatible HTTP server (FastAPI on uvicorn) over one loaded model.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream`` via server-sent events),
``GET /v1/models``, ``GET /health``. Request fields: ``max_tokens`` (chat also ``max_completion_tokens``),
``temperature``, ``top_p``, ``stop``, ``seed``, ``logprobs`` (completions: an int 0..5; chat: a bool plus
``top_logprobs`` 0..20), ``stream_options.include_usage``, and edgeq's ``ignore_eos``. ``n`` must be 1.

One generation runs at a time, on a dedicated worker thread (the model and its KV cache are single-sequence);
up to ``queue_size`` more requests wait; beyond that a request gets 429 at once. Bodies over ``max_body_bytes`` get
413; prompts that do not fit the context (``max_model_len`` / KV cache) get 400. Every error is a JSON body
``{"error": {"message", "type", "param", "code"}}``; no request can stop the server. A streaming client that
disconnects cancels its generation at the next token.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgeq.errors import EdgeqError
from edgeq.runtime.generate import Delta, Generation, GenerationResult, SamplingParams, encode_prompt
from edgeq.runtime.sizes import parse_bytes


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False


class CompletionRequest(_Base):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Base):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
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


async def _read_json(request: Request, limit: int) -> dict:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body is {int(length)} bytes; the limit is {limit} (--max-body-bytes)")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes (--max-body-bytes)")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}") from e
    if not isinstance(data, dict):
        raise ApiError(400, "the JSON body must be an object")
    return data


def _parse(model_cls, data: dict):
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or None
        raise ApiError(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param=where) from e


def _stops(stop) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(400, "stop: at most 4 non-empty strings", param="stop")
    return stops


def create_app(lm, *, queue_size: int = 8, max_body_bytes: int | str = 1 << 20, model_name: str | None = None) -> FastAPI:
    """The FastAPI app for a loaded model (``edgeq.runtime.load``)."""
    limit = parse_bytes(max_body_bytes, "max_body_bytes")
    name = model_name or lm.path.name
    engine = Engine(lm, queue_size)
    context = min(lm.settings.max_model_len, lm.cache.capacity)
    app = FastAPI(title="edgeq", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.router.on_shutdown.append(engine.shutdown)

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return _error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "running": engine.running, "waiting": max(0, engine.pending - engine.running),
                "queue_size": engine.queue_size, "max_model_len": lm.settings.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "edgeq",
                                            "max_model_len": lm.settings.max_model_len}]}

    def _prepare(prompt_ids: list[int], req, max_tokens: int | None, logprobs: int | None) -> Generation:
        if len(prompt_ids) >= context:
            raise ApiError(400, f"prompt is {len(prompt_ids)} tokens; the context holds {context} "
                                f"(max_model_len={lm.settings.max_model_len}) including at least one generated token",
                           param="prompt")
        if max_tokens is None:
            max_tokens = context - len(prompt_ids)
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                    stop=_stops(req.stop), logprobs=logprobs, ignore_eos=req.ignore_eos)
            return Generation(lm, prompt_ids, params)
        except EdgeqError as e:
            raise ApiError(400, str(e)) from e

    def _encode(prompt, chat: bool) -> list[int]:
        try:
            return encode_prompt(lm, prompt, chat)
        except EdgeqError as e:
            raise ApiError(400, str(e), param="messages" if chat else "prompt") from e

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

    async def _run(gen: Generation, stream: bool, chunk: Callable[[Delta], dict | None], final: Callable[[GenerationResult], list[dict]], whole: Callable[[GenerationResult], dict]):
        if not stream:
            def collect():
                for _ in gen:
                    pass
                return gen.result

            fut = engine.submit(collect)
            if fut is None:
                raise ApiError(429, f"server busy: one generation running and {engine.queue_size} waiting; retry later", "rate_limit_error")
            return whole(await asyncio.wrap_future(fut))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        gen.cancel = cancel.is_set

        def put(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                cancel.set()

        def job():
            try:
                for d in gen:
                    put(("delta", d))
                put(("done", gen.result))
            except Exception as e:  # reported to the client as an error event
                put(("error", e))

        if engine.submit(job) is None:
            raise ApiError(429, f"server busy: one generation running and {engine.queue_size} waiting; retry later", "rate_limit_error")

        async def events():
            try:
                while True:
                    kind, value = await queue.get()
                    if kind == "delta":
                        c = chunk(value)
                        if c is not None:
                            yield _sse(c)
                    elif kind == "done":
                        for c in final(value):
                            yield _sse(c)
                        yield "data: [DONE]\n\n"
                        return
                    else:
                        yield _sse({"error": {"message": f"{type(value).__name__}: {value}", "type": "server_error", "param": None, "code": 500}})
                        yield "data: [DONE]\n\n"
                        return
            finally:
                cancel.set()  # a client that went away stops its generation at the next token

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _parse(CompletionRequest, await _read_json(request, limit))
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: one prompt per request (batching is not supported)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt or not all(0 <= t < lm.model.config.vocab_size for t in prompt):
                raise ApiError(400, "prompt: token ids must be a non-empty list within the vocabulary", param="prompt")
            ids = list(prompt)
        else:
            ids = _encode(prompt, chat=False)
        gen = _prepare(ids, req, req.max_tokens, req.logprobs)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool((req.stream_options or {}).get("include_usage"))
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

        return await _run(gen, req.stream, chunk, final, whole)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = _parse(ChatRequest, await _read_json(request, limit))
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
            messages.append({"role": m.role, "content": content or ""})
        ids = _encode(messages, chat=True)
        top = req.top_logprobs if req.top_logprobs is not None else 0
        gen = _prepare(ids, req, req.max_completion_tokens or req.max_tokens, top if req.logprobs else None)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool((req.stream_options or {}).get("include_usage"))
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

        return await _run(gen, req.stream, chunk, final, whole)

    return app


def serve_command(path: str, host: str = "127.0.0.1", port: int = 8000, max_model_len: int | None = None,
                  kv_cache_bytes: str = "256MiB", queue_size: int = 8, max_body_bytes: str = "1MiB",
                  model_name: str | None = None, strict_layout: bool = False, threads: int | None = None) -> None:
    """`edgeq serve PATH`: load the checkpoint and serve the OpenAI-compatible API (127.0.0.1:8000 by default)."""
    import sys  # noqa: PLC0415

    import uvicorn  # noqa: PLC0415

    from edgeq.runtime.loader import load  # noqa: PLC0415

    if queue_size < 0:
        raise EdgeqError(f"queue_size={queue_size}: must be >= 0")
    lm = load(path, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes, strict_layout=strict_layout, threads=threads)
    s = lm.settings
    print(f"edgeq serve: {path} ({s.scheme or 'bf16'}, decode {s.decode_path}, prefill {s.prefill_path} at M >= "
          f"{s.prefill_crossover}, max_model_len {s.max_model_len}, KV cache {s.max_cached_tokens} tokens) on "
          f"http://{host}:{port}", file=sys.stderr)
    app = create_app(lm, queue_size=queue_size, max_body_bytes=max_body_bytes, model_name=model_name)
    uvicorn.run(app, host=host, port=port, log_level="info")

"""The endpoints' work for one served model: models and health, reading a request (served model, unsupported
fields, types and bounds), fitting it into the context, encoding its prompt, and running it on the engine."""

from __future__ import annotations

import time

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from edgeq.errors import EdgeqError
from edgeq.runtime.generation import Generation, SamplingParams, encode_prompt
from edgeq.runtime.serve.engine import Engine, run
from edgeq.runtime.serve.errors import ApiError
from edgeq.runtime.serve.responses import ChatShape, CompletionShape
from edgeq.runtime.serve.schemas import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    completion_prompt,
    parse,
    read_json,
    refuse_unsupported,
    stops,
)

try:
    from jinja2 import TemplateError  # what a chat template raises for messages it refuses
except ImportError:  # without jinja2 there are no chat templates, so nothing to catch
    class TemplateError(Exception):
        pass


def _created(lm) -> int:
    """When the checkpoint was written (its config.json's mtime), else now: the models list's ``created``."""
    for p in (lm.path / "config.json", lm.path):
        try:
            return int(p.stat().st_mtime)
        except OSError:
            continue
    return int(time.time())


class Handlers:
    """The routes of :func:`~edgeq.runtime.serve.app.create_app`, as methods over the served model ``lm`` (named
    ``name``), its ``engine`` and the body size ``limit``. The context is the smaller of ``max_model_len`` and the KV
    cache's capacity."""

    def __init__(self, lm, name: str, engine: Engine, limit: int):
        self.lm, self.name, self.engine, self.limit = lm, name, engine, limit
        self.context = min(lm.settings.max_model_len, lm.cache.capacity)
        self.card = {"id": name, "object": "model", "created": _created(lm), "owned_by": "edgeq",
                     "max_model_len": lm.settings.max_model_len}

    async def health(self):
        engine = self.engine
        return {"status": "ok", "model": self.name, "running": engine.running,
                "waiting": max(0, engine.pending - engine.running), "queue_size": engine.queue_size,
                "max_model_len": self.lm.settings.max_model_len}

    async def models(self):
        return {"object": "list", "data": [self.card]}

    async def model(self, model_id: str):
        if model_id != self.name:
            raise self.unknown_model(model_id)
        return self.card

    async def completions(self, request: Request):
        req = await self.read(request, CompletionRequest)
        prompt = completion_prompt(req.prompt, self.lm.model.config.vocab_size)
        ids = prompt if isinstance(prompt, list) else await run_in_threadpool(self.encode, prompt, False)
        gen = self.prepare(ids, req, req.max_tokens, req.logprobs)
        shape = CompletionShape(self.name, req.include_usage)
        return await run(request, self.engine, gen, req.stream, shape)

    async def chat_completions(self, request: Request):
        req = await self.read(request, ChatRequest)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
        ids = await run_in_threadpool(self.encode, chat_messages(req), True)
        top = req.top_logprobs if req.top_logprobs is not None else 0
        gen = self.prepare(ids, req, req.max_completion_tokens or req.max_tokens, top if req.logprobs else None)
        shape = ChatShape(self.name, req.include_usage)
        return await run(request, self.engine, gen, req.stream, shape)

    # ------------------------------------------------------------------------------------------------- helpers

    def unknown_model(self, model: str) -> ApiError:
        return ApiError(404, f"model `{model}` does not exist; this server serves `{self.name}` (GET /v1/models)",
                        param="model", code="model_not_found")

    async def read(self, request: Request, model_cls):
        """The body as ``model_cls``: size, JSON, served model (404), unsupported fields, then types and bounds."""
        data = await read_json(request, self.limit)
        if isinstance(data.get("model"), str) and data["model"] not in ("", self.name):
            raise self.unknown_model(data["model"])
        refuse_unsupported(data)
        return parse(model_cls, data)

    def prepare(self, prompt_ids: list[int], req, max_tokens: int | None, logprobs: int | None) -> Generation:
        """The generation of ``req`` after ``prompt_ids``: 400 ``context_length_exceeded`` when prompt and
        ``max_tokens`` do not fit the context (None: as many tokens as fit), 400 for sampling parameters refused."""
        chat = isinstance(req, ChatRequest)
        n, context = len(prompt_ids), self.context
        if n == 0:
            raise ApiError(400, "prompt: empty (0 tokens); send at least one token", param="prompt")
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
                                    stop=stops(req.stop), logprobs=logprobs, ignore_eos=req.ignore_eos)
            return Generation(self.lm, prompt_ids, params)
        except EdgeqError as e:
            raise ApiError(400, str(e)) from e

    def encode(self, prompt, chat: bool) -> list[int]:
        """Token ids of a prompt (text, or chat messages through the model's chat template); 400 naming the field.
        Called off the event loop: a long prompt takes a while to tokenise, and /health must not wait for it."""
        lm, field = self.lm, "messages" if chat else "prompt"
        if chat and lm.tokenizer is not None and not getattr(lm.tokenizer, "chat_template", None):
            raise ApiError(400, f"model `{self.name}` has no chat template; send a plain prompt to POST "
                                f"/v1/completions", param=field, code="no_chat_template")
        try:
            return encode_prompt(lm, prompt, chat)
        except (EdgeqError, TemplateError) as e:
            raise ApiError(400, f"{field}: {e}", param=field) from e

"""Request bodies: reading them (size, JSON), the fields edgeq refuses, the pydantic models with their bounds, and
the checks a model cannot state (stop strings, a completion's prompt forms, a chat message's content parts). Every
refusal is an :class:`~edgeq.runtime.serve.errors.ApiError` naming the field."""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from edgeq.runtime.serve.errors import ApiError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1

# OpenAI / vLLM fields edgeq cannot honour, with the values that mean "not used" (accepted, nothing to do).
UNSUPPORTED: dict[str, tuple] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "repetition_penalty": (None, 1), "top_k": (None, 0, -1), "min_p": (None, 0),
    "best_of": (None, 1), "suffix": (None, ""), "echo": (None, False), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "web_search_options": (None,),
}


# strict: a field takes its own JSON type only ("5" is not an integer, true is not 1, "yes" is not a boolean), as in
# OpenAI's API; an integer is still a number.
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by both endpoints; ``null`` means "the default", as in OpenAI's API."""

    model_config = ConfigDict(extra="ignore", strict=True)
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

    @property
    def include_usage(self) -> bool:
        """``stream_options.include_usage``: a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    prompt: Any  # its forms are checked by completion_prompt, whose message names them all
    max_tokens: int = Field(16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=5)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def _not_json(constant: str):
    raise ValueError(f"{constant} is not valid JSON")


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object: 413 past ``limit`` bytes (declared or read), 400 ``invalid_json`` otherwise."""
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
    except RecursionError as e:  # json's decoder recurses per nesting level: '[' * 5000 is 5 KB
        raise ApiError(400, "malformed JSON body: nested too deeply; flatten it", code="invalid_json") from e
    if not isinstance(data, dict):
        raise ApiError(400, "the JSON body must be an object", code="invalid_json")
    try:  # "\ud800" is valid JSON but no text: the tokenizer and every reply that echoes it would fail on it
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"malformed JSON body: a string holds a lone UTF-16 surrogate "
                            f"({e.object[e.start:e.end].encode('unicode_escape').decode()}); send valid Unicode",
                       code="invalid_json") from e
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


def parse(model_cls, data: dict):
    """``data`` as ``model_cls``; the first validation error is a 400 naming its field."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = _where(first.get("loc", ())) or None
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        raise ApiError(400, message, param=where, code=_validation_code(first.get("type", ""))) from e


def refuse_unsupported(data: dict) -> None:
    """400 naming every field of ``UNSUPPORTED`` the request sets to something other than its neutral value."""
    bad = [k for k, neutral in UNSUPPORTED.items() if k in data and data[k] not in neutral]
    if bad:
        given = ", ".join(f"{k}={json.dumps(data[k])[:40]}" for k in bad)
        neutral = ", ".join(f"{k}={json.dumps(UNSUPPORTED[k][1])}" for k in bad if len(UNSUPPORTED[k]) > 1)
        raise ApiError(400, f"{given}: not supported by this server; omit {'them' if len(bad) > 1 else 'it'}"
                            + (f" (or send {neutral})" if neutral else ""), param=bad[0], code="unsupported_parameter")


def stops(stop) -> tuple[str, ...]:
    """``stop`` as a tuple of at most 4 non-empty strings."""
    found = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(found) > 4 or any(not s for s in found):
        raise ApiError(400, "stop: at most 4 non-empty strings", param="stop")
    return found


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def completion_prompt(prompt, vocab_size: int) -> str | list[int]:
    """A completion's prompt as text or token ids, in OpenAI's forms: a string, a list of strings, a list of ids or a
    list of lists of ids, the lists holding one prompt (several are refused: no batching); ids in [0, vocab_size)."""
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt) or
                                                (all(_is_ids(p) for p in prompt))):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: one prompt per request (batching is not supported)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if not _is_ids(prompt):
        raise ApiError(400, f"prompt: a string, a list of one string, or a list of token ids (integers); got "
                            f"{json.dumps(prompt)[:40]}", param="prompt", code="invalid_type")
    if not prompt or not all(0 <= t < vocab_size for t in prompt):
        raise ApiError(400, f"prompt: token ids must be a non-empty list of ids in [0, {vocab_size})", param="prompt")
    return list(prompt)


def chat_messages(req: ChatRequest) -> list[dict]:
    """The messages for the chat template: text parts joined, ``developer`` as ``system``; other parts refused."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if part.get("type") != "text":
                    raise ApiError(400, f"{where}: only text parts are supported (type \"text\"), got type "
                                        f"{json.dumps(part.get('type'))}", param=where, code="unsupported_value")
                if not isinstance(part.get("text"), str):
                    raise ApiError(400, f"{where}.text: must be a string, got {json.dumps(part.get('text'))[:40]}",
                                   param=f"{where}.text", code="invalid_type")
            content = "".join(part["text"] for part in content)
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return messages

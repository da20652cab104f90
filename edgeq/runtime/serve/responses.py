"""Response bodies in OpenAI's shapes: a completion or chat completion whole, or as stream chunks, with usage and
logprobs. A shape is made per request (its id and ``created``) and asked for ``chunk(delta)`` (None: nothing to
send), ``final(result)`` (the last chunks) and ``whole(result)`` (the non-streaming body)."""

from __future__ import annotations

import time
import uuid
from edgeq.runtime.generation import Delta, GenerationResult


def usage(r: GenerationResult) -> dict:
    """Token counts; the EOS that ended a generation counts as generated (OpenAI and vLLM count it) though it adds no
    text and no logprobs entry."""
    n = len(r.token_ids) + (r.eos_token is not None)
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": n, "total_tokens": r.prompt_tokens + n}


def finish(r: GenerationResult) -> str:
    return "stop" if r.finish_reason == "stop" else "length"


def completion_logprobs(lps, offset: int) -> dict | None:
    """Completions' logprobs: tokens (each token's piece of the text: they join to it), their logprobs, the top
    alternatives (keyed by how each reads in place) and each token's offset in the text, counted from ``offset`` (the
    pieces of the tokens before, so a stream's offsets are the whole response's)."""
    if not lps:
        return None
    offsets, pos = [], offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.piece)
    return {"tokens": [lp.piece for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [dict(zip(lp.top_tokens, (v for _, v in lp.top))) for lp in lps], "text_offset": offsets}


def chat_logprobs(lps) -> dict | None:
    """Chat's logprobs: per token how it reads, its logprob, its own bytes (a character split over tokens: its
    bytes split the same way) and its top alternatives (the same three each)."""
    if not lps:
        return None

    def entry(token, v, raw):
        return {"token": token, "logprob": v, "bytes": list(raw)}

    return {"content": [{**entry(lp.token, lp.logprob, lp.bytes),
                         "top_logprobs": [entry(t, v, b) for t, (_, v), b in zip(lp.top_tokens, lp.top, lp.top_bytes)]}
                        for lp in lps]}


class _Shape:
    """What both endpoints' shapes share: the id, the chunk envelope and the final chunks."""

    object = ""
    prefix = ""

    def __init__(self, model_name: str, include_usage: bool):
        self.rid, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())
        self.model_name, self.include_usage = model_name, include_usage

    def base(self, choices: list, usage_: dict | None = None) -> dict:
        """A chunk; with ``include_usage`` every chunk has ``usage``, null but in the last (OpenAI's stream)."""
        u = {"usage": usage_} if usage_ is not None or self.include_usage else {}
        return {"id": self.rid, "object": self.object, "created": self.created, "model": self.model_name,
                "choices": choices, **u}

    def last_choice(self, r: GenerationResult) -> dict:
        raise NotImplementedError

    def final(self, r: GenerationResult) -> list[dict]:
        """The chunk with the finish reason, then (with ``stream_options.include_usage``) the usage chunk."""
        out = [self.base([self.last_choice(r)])]
        if self.include_usage:
            out.append(self.base([], usage(r)))
        return out


class CompletionShape(_Shape):
    """``POST /v1/completions``: ``text_completion`` objects."""

    object, prefix = "text_completion", "cmpl"

    def __init__(self, model_name: str, include_usage: bool):
        super().__init__(model_name, include_usage)
        self.offset = 0  # the pieces of the tokens sent so far: the next chunk's logprob offsets start here

    def chunk(self, d: Delta) -> dict | None:
        if not d.text and not d.logprobs:
            return None
        lp = completion_logprobs(list(d.logprobs), self.offset)
        self.offset += sum(len(x.piece) for x in d.logprobs)
        return self.base([{"index": 0, "text": d.text, "logprobs": lp, "finish_reason": None}])

    def last_choice(self, r: GenerationResult) -> dict:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": finish(r)}

    def whole(self, r: GenerationResult) -> dict:
        return self.base([{"index": 0, "text": r.text, "logprobs": completion_logprobs(r.logprobs, 0),
                           "finish_reason": finish(r)}], usage(r))


class ChatShape(_Shape):
    """``POST /v1/chat/completions``: ``chat.completion.chunk`` objects, or one ``chat.completion``."""

    object, prefix = "chat.completion.chunk", "chatcmpl"

    def __init__(self, model_name: str, include_usage: bool):
        super().__init__(model_name, include_usage)
        self.started = False  # the first chunk carries the role

    def chunk(self, d: Delta) -> dict | None:
        delta = {} if self.started else {"role": "assistant"}
        self.started = True
        if not d.text and not d.logprobs and "role" not in delta:
            return None
        delta["content"] = d.text
        return self.base([{"index": 0, "delta": delta, "logprobs": chat_logprobs(list(d.logprobs)),
                           "finish_reason": None}])

    def last_choice(self, r: GenerationResult) -> dict:
        return {"index": 0, "delta": {} if self.started else {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": finish(r)}

    def whole(self, r: GenerationResult) -> dict:
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                             "logprobs": chat_logprobs(r.logprobs), "finish_reason": finish(r)}],
                "usage": usage(r)}

"""Response bodies in OpenAI's shapes: a completion or chat completion whole, or as stream chunks, with usage and
logprobs. A shape is made per request (its id and ``created``) and asked for ``chunk(delta)`` (None: nothing to
send), ``final(result)`` (the last chunks) and ``whole(result)`` (the non-streaming body)."""

from __future__ import annotations

import time
import uuid
from typing import Callable

from edgeq.runtime.generation import Delta, GenerationResult

TokenText = Callable[[int], str]  # a token id's text (the tokenizer's decode of that one id)


def usage(r: GenerationResult) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.token_ids),
            "total_tokens": r.prompt_tokens + len(r.token_ids)}


def finish(r: GenerationResult) -> str:
    return "stop" if r.finish_reason == "stop" else "length"


def completion_logprobs(token_text: TokenText, lps, offset: int) -> dict | None:
    """Completions' logprobs: tokens, their logprobs, top alternatives, each token's offset in the text (from
    ``offset``, the text already sent)."""
    if not lps:
        return None
    tokens = [token_text(lp.token_id) for lp in lps]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{token_text(i): v for i, v in lp.top} for lp in lps], "text_offset": offsets}


def chat_logprobs(token_text: TokenText, lps) -> dict | None:
    """Chat's logprobs: per token its text, logprob, UTF-8 bytes and top alternatives (the same three each)."""
    if not lps:
        return None

    def entry(i, v):
        t = token_text(i)
        return {"token": t, "logprob": v, "bytes": list(t.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in lps]}


class _Shape:
    """What both endpoints' shapes share: the id, the chunk envelope and the final chunks."""

    object = ""
    prefix = ""

    def __init__(self, model_name: str, token_text: TokenText, include_usage: bool):
        self.rid, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())
        self.model_name, self.token_text, self.include_usage = model_name, token_text, include_usage

    def base(self, choices: list, usage_: dict | None = None) -> dict:
        return {"id": self.rid, "object": self.object, "created": self.created, "model": self.model_name,
                "choices": choices, **({"usage": usage_} if usage_ is not None else {})}

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

    def __init__(self, model_name: str, token_text: TokenText, include_usage: bool):
        super().__init__(model_name, token_text, include_usage)
        self.emitted = 0  # characters sent so far: the next chunk's logprob offsets start here

    def chunk(self, d: Delta) -> dict | None:
        if not d.text and not d.logprobs:
            return None
        lp = completion_logprobs(self.token_text, list(d.logprobs), self.emitted)
        self.emitted += len(d.text)
        return self.base([{"index": 0, "text": d.text, "logprobs": lp, "finish_reason": None}])

    def last_choice(self, r: GenerationResult) -> dict:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": finish(r)}

    def whole(self, r: GenerationResult) -> dict:
        return self.base([{"index": 0, "text": r.text, "logprobs": completion_logprobs(self.token_text, r.logprobs, 0),
                           "finish_reason": finish(r)}], usage(r))


class ChatShape(_Shape):
    """``POST /v1/chat/completions``: ``chat.completion.chunk`` objects, or one ``chat.completion``."""

    object, prefix = "chat.completion.chunk", "chatcmpl"

    def __init__(self, model_name: str, token_text: TokenText, include_usage: bool):
        super().__init__(model_name, token_text, include_usage)
        self.started = False  # the first chunk carries the role

    def chunk(self, d: Delta) -> dict | None:
        delta = {} if self.started else {"role": "assistant"}
        self.started = True
        if not d.text and not d.logprobs and "role" not in delta:
            return None
        delta["content"] = d.text
        return self.base([{"index": 0, "delta": delta, "logprobs": chat_logprobs(self.token_text, list(d.logprobs)),
                           "finish_reason": None}])

    def last_choice(self, r: GenerationResult) -> dict:
        return {"index": 0, "delta": {} if self.started else {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": finish(r)}

    def whole(self, r: GenerationResult) -> dict:
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                             "logprobs": chat_logprobs(self.token_text, r.logprobs), "finish_reason": finish(r)}],
                "usage": usage(r)}

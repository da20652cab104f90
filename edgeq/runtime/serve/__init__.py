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
not, cancels its generation at the next token (or, if it was waiting, takes it out of the queue at once).

Modules: :mod:`.app` builds the app (:func:`create_app`), :mod:`.handlers` does each endpoint's work,
:mod:`.schemas` reads and validates request bodies, :mod:`.responses` writes OpenAI's response shapes,
:mod:`.engine` runs one generation at a time and streams it, :mod:`.errors` holds the JSON errors and the middleware
that contains escaped exceptions, :mod:`.command` runs the server (:func:`serve_command`: load, bind, announce,
serve). The ``edgeq serve`` command, its options and its output, is edgeq/cli/serve.py.
"""

from edgeq.runtime.serve.app import create_app
from edgeq.runtime.serve.command import serve_command, startup_record
from edgeq.runtime.serve.engine import Engine
from edgeq.runtime.serve.errors import ApiError
from edgeq.runtime.serve.schemas import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    UNSUPPORTED,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    StreamOptions,
)

__all__ = [
    "INT32_MAX", "INT64_MAX", "INT64_MIN", "UNSUPPORTED", "ApiError", "ChatMessage", "ChatRequest", "CompletionRequest",
    "Engine", "StreamOptions", "create_app", "serve_command", "startup_record",
]

"""``edgeq serve``: the OpenAI-compatible server (edgeq/runtime/serve/ does the work; docs/runtime.md "Serving")."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from edgeq.cli.options import MAX_MODEL_LEN_HELP, THREADS_HELP, size_option
from edgeq.console import emit_line, say
from edgeq.io.hub import REVISION_HELP, display_name, resolve_model


def serve(
    model: str = typer.Argument(..., help="An edgeq checkpoint (or a bf16 Hugging Face checkpoint): directory or hub id."),
    revision: Optional[str] = typer.Option(None, "--revision", help=REVISION_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port, reported at startup)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help=MAX_MODEL_LEN_HELP),
    kv_cache_bytes: str = size_option("256MiB", "--kv-cache-bytes", "KV cache budget, e.g. 512MiB."),
    queue_size: int = typer.Option(8, "--queue-size", help="Requests waiting beyond the running one; more get 429."),
    max_body_bytes: str = size_option("1MiB", "--max-body-bytes", "Largest request body; larger ones get 413."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="The model id in /v1/models and responses "
                                             "[default: the checkpoint directory's name]."),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP),
    strict_layout: bool = typer.Option(False, "--strict-layout", help="Refuse a checkpoint packed for another layout."),
    as_json: bool = typer.Option(False, "--json", help="Startup as one JSON line on stdout (url, port, model, paths); "
                                 "uvicorn logs warnings only."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No startup line or request log (warnings still print)."),
    verify: bool = typer.Option(False, "--verify", help="Check every shard's sha256 against the manifest before "
                                "serving (reads the whole checkpoint once; see docs/runtime.md)."),
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, /health)."""
    import edgeq.runtime.serve as server  # noqa: PLC0415 (torch, transformers: only when the command runs)

    path = str(resolve_model(model, revision))
    if verify:  # before the server binds: a damaged checkpoint never answers a request
        from edgeq.runtime.loader import verify_shards  # noqa: PLC0415

        verify_shards(Path(path))
    # through the package's name: tests/test_hub.py replaces serve_command to see what it is given
    stopped_by = server.serve_command(
        path, host=host, port=port, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes, queue_size=queue_size,
        max_body_bytes=max_body_bytes, model_name=model_name or display_name(model),  # a snapshot: named by its commit
        strict_layout=strict_layout, threads=threads, announce=_announcer(path, as_json, quiet), calm=quiet or as_json)
    if stopped_by:  # a requested stop is success (exit 0), not an interruption
        say(f"edgeq serve: stopped ({stopped_by})", quiet)


def _announcer(path: str, as_json: bool, quiet: bool):
    """The startup announcement, once the socket is bound: one JSON line on stdout (``--json``, the record of
    :func:`edgeq.runtime.serve.startup_record`) or one line on stderr (not with ``-q``)."""

    def announce(record: dict, lm) -> None:
        from edgeq.runtime.generation import describe_paths  # noqa: PLC0415

        s = lm.settings
        if as_json:
            emit_line(record)
        else:
            say(f"edgeq serve: {path} ({describe_paths(s)}, max_model_len {s.max_model_len}, KV cache "
                f"{s.max_cached_tokens} tokens) on {record['url']}", quiet)
    return announce

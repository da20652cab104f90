"""The server's run: load, bind, announce, serve; ``edgeq serve``'s options and output are edgeq/cli/serve.py."""

from __future__ import annotations

import signal
from typing import Callable

import uvicorn

from edgeq.errors import EdgeqError
from edgeq.io.writer import interrupts_held
from edgeq.runtime.serve.app import create_app, served_name
from edgeq.runtime.serve.engine import worker


def serve_command(path: str, host: str = "127.0.0.1", port: int = 8000, max_model_len: int | None = None,
                  kv_cache_bytes: str = "256MiB", queue_size: int = 8, max_body_bytes: str = "1MiB",
                  model_name: str | None = None, strict_layout: bool = False, threads: int | None = None,
                  announce: Callable[[dict, object], None] | None = None, calm: bool = False) -> str | None:
    """Load the checkpoint, bind, ``announce(record, lm)``, and serve the OpenAI-compatible API until stopped;
    returns the name of the signal that stopped it (``SIGTERM``, ``SIGINT``), if one did.

    The socket is bound before ``announce`` is called with :func:`startup_record`, so a client that has read the
    announcement can connect, and ``port=0`` reports the port the OS chose. ``calm`` keeps uvicorn to warnings (no
    access log on stdout). The first SIGTERM or Ctrl-C stops the engine (the running generation ends at its next
    token, waiting ones at once, each answered 503) and lets uvicorn close; a stop is not an error."""
    from edgeq.runtime.loader import load  # noqa: PLC0415

    if queue_size < 0:
        raise EdgeqError(f"queue_size={queue_size}: must be >= 0")
    pool = worker()  # load on the thread that will generate: one OpenMP team (engine.worker says why)
    try:
        lm = pool.submit(load, path, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                         strict_layout=strict_layout, threads=threads).result()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    app = create_app(lm, queue_size=queue_size, max_body_bytes=max_body_bytes, model_name=model_name, pool=pool)
    sock = _listen(host, port)
    record = startup_record(lm, host, sock.getsockname()[1], served_name(lm, model_name))
    if announce is not None:
        announce(record, lm)
    config = uvicorn.Config(app, host=host, port=record["port"], log_level="warning" if calm else "info",
                            access_log=not calm, timeout_graceful_shutdown=GRACE_SECONDS)
    return _run_until_stopped(_StoppingServer(config, app.state.engine), sock)


GRACE_SECONDS = 5  # after a stop, how long a client still reading its answer (a 503, an error event) may take


class _StoppingServer(uvicorn.Server):
    """uvicorn's server, which also stops the engine on the signal: uvicorn alone waits for every running and queued
    request to finish before it exits (minutes, with long generations queued)."""

    def __init__(self, config, engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        self.engine.stop()
        super().handle_exit(sig, frame)


def _run_until_stopped(server, sock) -> str | None:
    """Run ``server`` on ``sock``; the signal uvicorn re-raises after its graceful shutdown is held here instead of
    killing the process (SIGTERM) or surfacing as KeyboardInterrupt (SIGINT). uvicorn re-raises the signals it caught
    last first, so the one held is the one that stopped it."""
    with interrupts_held() as guard:
        server.run(sockets=[sock])
    return signal.Signals(guard.pending).name if guard.pending is not None else None


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

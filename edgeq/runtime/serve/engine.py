"""One generation at a time: the worker thread (:class:`Engine`) and :func:`run`, which queues a request's generation
there and answers it whole or as server-sent events, cancelling it when the client leaves."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from edgeq.runtime.generation import Generation
from edgeq.runtime.serve.errors import ServerStopping, busy, generation_error, stopping


def worker() -> ThreadPoolExecutor:
    """The one thread that runs the model. Load on it too (:func:`edgeq.runtime.serve.command.serve_command`): torch
    work from a second OS thread gives that thread its own OpenMP team, and with both teams alive decode slowed from
    27-28 to 17-18 tok/s (Qwen2.5-1.5B shape, 2 threads, Zen 4; docs/vllm.md)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgeq-generate")


class Engine:
    """Runs jobs one at a time on one worker thread; at most ``queue_size`` wait behind the running one.

    :meth:`stop` (the server's first SIGTERM or Ctrl-C) ends the running generation at its next token and every
    waiting one before it starts, each answered 503, so that shutdown does not wait for the queue to drain."""

    def __init__(self, lm, queue_size: int, pool: ThreadPoolExecutor | None = None):
        self.lm = lm
        self.queue_size = queue_size
        self._pool = pool or worker()
        self._lock = threading.Lock()
        self.pending = 0  # running + waiting
        self.running = 0
        self.stopping = threading.Event()

    def submit(self, job: Callable[[], Any]) -> Future | None:
        with self._lock:
            if self.pending >= self.queue_size + 1:
                return None
            self.pending += 1
        return self._pool.submit(self._run, job)

    def withdraw(self, future: Future) -> bool:
        """Take a waiting job out of the queue (its client left): True if it had not started, its slot freed at once
        (it stops counting in ``/health``'s ``waiting`` and in the 429 limit); False if it is running already."""
        if not future.cancel():
            return False
        with self._lock:
            self.pending -= 1
        return True

    def _run(self, job):
        with self._lock:
            self.running = 1
        try:
            return job()
        finally:
            with self._lock:
                self.pending -= 1
                self.running = 0

    def stop(self) -> None:
        self.stopping.set()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def until_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set ``cancel`` when the client goes away (the body is already read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel.set()


async def run(request: Request, engine: Engine, gen: Generation, stream: bool, shape):
    """Queue ``gen`` on the worker and answer with ``shape`` (:mod:`.responses`: ``chunk``, ``final``, ``whole``).

    Until the response starts (all of it for ``stream=False``, the first delta for a stream) a client disconnect
    cancels the generation; a stream's is cancelled when sending fails. A failure before the response starts is an
    HTTP 500; later in a stream, an error event. A full queue is a 429; a server shutting down answers 503.
    """
    if engine.stopping.is_set():
        raise stopping()
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()
    gen.cancel = lambda: cancel.is_set() or engine.stopping.is_set()
    future = engine.submit(_job(gen, events, cancel, loop, engine.stopping))
    if future is None:
        raise busy(engine)
    kind, value = await _first(request, events, cancel, stream, lambda: engine.withdraw(future))
    if kind == "gone":
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it, the log line says why
    if kind == "error":
        raise generation_error(value)
    if not stream:
        return shape.whole(value)
    return StreamingResponse(_events(shape, (kind, value), events, cancel), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _job(gen: Generation, events: asyncio.Queue, cancel: threading.Event, loop,
         halt: threading.Event) -> Callable[[], None]:
    """The worker's job: run ``gen``, posting ("delta", d) per delta, then ("done", result) or ("error", exc); a
    generation ``halt`` (the server's shutdown) cut short or kept from starting ends with ServerStopping."""

    def put(item):
        try:
            loop.call_soon_threadsafe(events.put_nowait, item)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            cancel.set()

    def job():
        try:
            ran = False
            if not cancel.is_set() and not halt.is_set():  # a client that left while waiting costs no prefill
                for d in gen:
                    put(("delta", d))
                ran = gen.result.finish_reason != "cancelled"
            put(("error", ServerStopping()) if halt.is_set() and not ran else ("done", gen.result))
        except Exception as e:  # answered by generation_error
            put(("error", e))

    return job


async def _first(request: Request, events: asyncio.Queue, cancel: threading.Event, stream: bool,
                 withdraw: Callable[[], bool]) -> tuple:
    """The first event a response needs (a stream: the first one; otherwise the end), watching for a disconnect:
    ("gone", None) if the client left while its job was still waiting (``withdraw`` took it out of the queue); a
    job already running stops at its next token and ends with its "done" event."""
    watcher = asyncio.create_task(until_disconnect(request, cancel))
    try:
        while True:
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():  # the client left
                getter.cancel()
                if withdraw():
                    return "gone", None
                break  # its job is running: it stops at the next token and ends with "done"
            kind, value = getter.result()
            if stream or kind != "delta":
                return kind, value
        kind, value = await events.get()
        while not stream and kind == "delta":
            kind, value = await events.get()
        return kind, value
    finally:
        watcher.cancel()


async def _events(shape, item: tuple, events: asyncio.Queue, cancel: threading.Event):
    """The server-sent events from ``item`` on: a chunk per delta (when it has one), the final chunks and
    ``[DONE]``, or an error event and ``[DONE]``."""
    try:
        while True:
            if item[0] == "delta":
                c = shape.chunk(item[1])
                if c is not None:
                    yield sse(c)
            elif item[0] == "done":
                for c in shape.final(item[1]):
                    yield sse(c)
                yield "data: [DONE]\n\n"
                return
            else:
                yield sse(generation_error(item[1]).body())
                yield "data: [DONE]\n\n"
                return
            item = await events.get()
    finally:
        cancel.set()  # a client that went away stops its generation at the next token

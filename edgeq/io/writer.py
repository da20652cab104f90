"""The rules every writer (``quantize``, ``repack``) follows for its output directory, in one place.

- :func:`check_output_path`: the output may not be an input, contain one, or lie inside one (symlinks resolved),
  with or without ``--force``: replacing ``OUT`` would delete the input, writing inside it would alter it.
- :func:`staging`: the output is built in a hidden sibling ``.OUT.edgeq-KIND-PID`` (KIND ``tmp`` for quantize,
  ``repack`` for repack); while it exists SIGTERM (what ``timeout``, ``docker stop`` and systemd send) raises
  KeyboardInterrupt exactly like SIGINT, so both take the same cleanup path (the CLI exits 2, "interrupted"). The
  previous handlers are restored afterwards. The rename into place (:func:`replace_dir`: every file fsynced before
  it, the parent directory after it) runs with SIGINT/SIGTERM held, so an interrupt cannot tear it; one that arrives
  meanwhile is reported and dropped, because the output is complete by then.
- :func:`remove_stale`: SIGKILL (and power loss) runs no cleanup, so every writer first looks for siblings of its
  own output named ``.OUT.edgeq-{tmp,repack,old}-PID`` whose PID is not a running process here, and removes them
  (an ``old`` one, the previous output set aside by a replacement that died half-way, is put back when ``OUT`` is
  missing), one stderr line each. A directory of a live process is left alone.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from edgeq.errors import EdgeqError

KINDS = ("tmp", "repack", "old")
_INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


def say(message: str) -> None:
    """One line on stderr, also under -q and --json (what a writer removed or restored, a warning about its output)."""
    from edgeq.console import err  # noqa: PLC0415 (everything edgeq prints goes through edgeq.console)

    err.print(message, markup=False, highlight=False, soft_wrap=True)


def check_output_path(out: str | Path, inputs: Iterable[str | Path]) -> None:
    """Refuse an output directory that is, contains, or lies inside any of ``inputs`` (after resolving symlinks)."""
    o = Path(out).resolve()
    for src in inputs:
        s = Path(src).resolve()
        relation = "is" if o == s else "contains" if o in s.parents else "is inside" if s in o.parents else None
        if relation:
            raise EdgeqError(f"{out}: the output directory {relation} the input {s}; writing there would destroy or "
                             "alter the input (also with --force); choose an output directory outside it")


def temp_dir(out: Path, kind: str) -> Path:
    """The hidden sibling of ``out`` this process writes (``tmp``, ``repack``) or sets the old ``out`` aside to."""
    return out.parent / f".{out.name}.edgeq-{kind}-{os.getpid()}"


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # not a concurrent writer: this process has not made it (a container restart reuses PIDs)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def remove_stale(out: Path) -> list[Path]:
    """Remove temporary siblings of ``out`` left by processes that no longer run; returns what was removed."""
    if not out.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(out.name)}\.edgeq-({'|'.join(KINDS)})-(\d+)")
    found = sorted((m[1] != "old", p, int(m[2])) for p in out.parent.iterdir()
                   if (m := pattern.fullmatch(p.name)) and p.is_dir() and not p.is_symlink())
    removed = []
    for _, p, pid in found:  # "old" first: it may be put back
        if _running(pid):
            continue
        if p.name.startswith(f".{out.name}.edgeq-old-") and not out.exists():
            p.rename(out)
            say(f"restored {out} from {p.name}: process {pid} had set it aside to replace it and died before finishing")
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
        who = "an earlier run with this PID" if pid == os.getpid() else f"process {pid}, which is no longer running"
        say(f"removed {p}: left by {who} (killed or lost power mid-write)")
    return removed


def prepare_output(out: Path, inputs: Iterable[str | Path]) -> None:
    """What every writer does first: the path rules, then the leftovers of earlier runs (before checking whether
    ``out`` exists or the disk has room: a restored ``old`` is the user's output, a removed ``tmp`` frees space).
    An output that exists and is not a directory (a file, a device, a FIFO) is refused, also with --force: replacing
    it would delete something that is not an earlier output (``-o /dev/null --force`` once did)."""
    check_output_path(out, inputs)
    out = Path(out)
    if out.exists() and not out.is_dir():
        kind = "a file" if out.is_file() else "not a directory"
        raise EdgeqError(f"{out}: exists and is {kind}; the output is a directory, and edgeq never replaces anything "
                         f"else (also with --force): choose another output path")
    if out.parent.exists() and not out.parent.is_dir():
        raise EdgeqError(f"{out.parent}: is not a directory; choose an output path inside a directory")
    remove_stale(out)


RECEIVED: list[int] = []  # every SIGINT/SIGTERM edgeq's handlers saw in this process (the CLI's entry point reads it)


def record_interrupt(signum, frame) -> None:
    """A SIGINT/SIGTERM handler: remember it, then raise KeyboardInterrupt as Python's own SIGINT handler does."""
    RECEIVED.append(signum)
    raise KeyboardInterrupt(signal.Signals(signum).name)


class _Guard:
    """While ``held``, SIGINT/SIGTERM are recorded in ``pending`` instead of raising (the commit must not be torn)."""

    held = False
    pending: int | None = None


@contextmanager
def _interrupts() -> Iterator[_Guard]:
    """SIGINT and SIGTERM raise KeyboardInterrupt (unless held) for the duration; main thread only (signal handlers
    can only be installed there; elsewhere the process's own handling applies). Previous handlers are restored."""
    guard = _Guard()
    if threading.current_thread() is not threading.main_thread():
        yield guard
        return

    def handler(signum, frame) -> None:
        if guard.held:
            guard.pending = signum
        else:
            record_interrupt(signum, frame)

    old = {s: signal.signal(s, handler) for s in _INTERRUPTS}
    try:
        yield guard
    finally:
        for s, previous in old.items():
            signal.signal(s, previous)


@contextmanager
def interrupts_held() -> Iterator[_Guard]:
    """SIGINT/SIGTERM are recorded in the guard's ``pending``, not raised, for the duration (main thread only)."""
    with _interrupts() as guard:
        guard.held = True
        yield guard


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """SIGINT/SIGTERM held for the duration; one that came raises KeyboardInterrupt after. For importing torch and
    transformers: an interrupt inside their imports leaves modules half-initialised, and then a later import fails
    with an unrelated error, or the signal is lost and the command runs to the end."""
    with interrupts_held() as guard:
        yield
    if guard.pending is not None:
        RECEIVED.append(guard.pending)
        raise KeyboardInterrupt(signal.Signals(guard.pending).name)


@contextmanager
def staging(out: Path, kind: str) -> Iterator[Path]:
    """Yield a fresh temporary sibling of ``out`` to write into; when the block ends normally, rename it into place
    (:func:`replace_dir`, fsynced) with interrupts held, so the commit is never torn. On any exception
    (KeyboardInterrupt from SIGINT or SIGTERM included) the directory is removed."""
    tmp = temp_dir(out, kind)
    shutil.rmtree(tmp, ignore_errors=True)  # this PID's own leftover (a container restart reuses PIDs)
    with _interrupts() as guard:
        try:  # mkdir inside: an interrupt right after it must remove the directory too
            tmp.mkdir(parents=True)
            yield tmp
            guard.held = True
            replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if guard.pending is not None:
        say(f"{signal.Signals(guard.pending).name} arrived during the final rename; {out} is complete")


def replace_dir(tmp: Path, out: Path) -> None:
    """Move a finished directory into place, durably.

    Every file under ``tmp`` and ``tmp`` itself are fsynced before the rename and the parent directory after it, so
    once this returns a power loss cannot bring back a missing or half-written ``out`` (rename alone orders nothing
    on disk: ext4/xfs may persist the new name before the data). An existing ``out`` is renamed aside to
    ``.OUT.edgeq-old-PID`` first and removed only after the new one is in place; a process killed in between
    leaves it there, and the next writer of ``out`` puts it back (:func:`remove_stale`)."""
    fsync_tree(tmp)
    old = None
    if out.exists() or out.is_symlink():
        old = temp_dir(out, "old")
        out.rename(old)
    tmp.rename(out)
    fsync_path(out.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()  # a symlink to a directory: the link goes, never its target (prepare_output refuses files)


def as_created(path: str | Path) -> None:
    """Give a file written through a private temporary (mkstemp, safetensors: mode 0600) the mode any new file gets
    under the umask (0644 under the usual 022), like the rest of the output."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``, then ``root``: their data and names reach the disk."""
    for p in sorted(Path(root).rglob("*"), key=lambda p: -len(p.parts)):
        if p.is_file() or p.is_dir():
            fsync_path(p)
    fsync_path(root)


def fsync_path(path: Path) -> None:
    """fsync a file (its data) or a directory (its entries: names created or renamed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

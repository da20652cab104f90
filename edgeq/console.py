"""Everything edgeq's commands print goes through here.

- results on stdout: :func:`emit` (a dataclass or dict, as JSON or through a human renderer), :func:`emit_line` (one
  compact JSON line, e.g. ``serve --json``'s startup record), :func:`line` (a plain text line), :func:`write` (raw
  streamed text, e.g. ``generate``);
- progress and notes on stderr: :func:`say` (silent under ``-q/--quiet`` and ``--json``), :data:`err`;
- failures on stderr: :func:`error`, one ``error: ...`` line for edgeq's own errors and click's usage errors alike.

``out`` and ``err`` are rich consoles (tables, colour on a terminal). When stdout/stderr is not a terminal (pipes,
CI logs) they are 200 columns wide so that tensor names are not cut.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from rich.console import Console
from rich.markup import escape

out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


def to_plain(value):
    """A dataclass as a dict (nested dataclasses too); anything else unchanged."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


def emit(value, as_json: bool, render=None) -> None:
    """Print a result: one indented JSON document on stdout, or through its human renderer (default: rich)."""
    if as_json:
        write(json.dumps(to_plain(value), indent=2, default=str) + "\n")
    elif render is not None:
        render(value)
    else:
        out.print(value)


def emit_line(value) -> None:
    """One compact JSON object on one stdout line (a record a reader can take with ``readline``)."""
    write(json.dumps(to_plain(value), default=str) + "\n")


def line(text: str) -> None:
    """One plain result line on stdout, printed as given (no rich markup, no highlighting)."""
    out.print(text, markup=False, highlight=False, soft_wrap=True)


def write(text: str) -> None:
    """Raw text on stdout, flushed at once (streamed tokens must show as they come)."""
    sys.stdout.write(text)
    sys.stdout.flush()


def say(message: str, quiet: bool = False) -> None:
    """A progress or status line on stderr, printed as given (no markup); nothing when ``quiet``."""
    if not quiet:
        err.print(message, markup=False, highlight=False, soft_wrap=True)


def error(message: str, prefix: str = "error") -> None:
    """The one-line failure format of every command: ``error: <what and how to fix it>`` (red on a terminal)."""
    err.print(f"[red]{prefix}:[/red] {escape(message)}", highlight=False, soft_wrap=True)

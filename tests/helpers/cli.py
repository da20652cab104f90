"""The real ``edgeq`` entry point, in this process, as a user's shell runs it."""

from __future__ import annotations

import sys

import pytest

from edgeq.cli import main as cli


def run_cli(args, capsys):
    """``edgeq *args`` through ``edgeq.cli.main.main`` (sys.argv as the console script sets it) -> (exit code,
    stdout, stderr). Callers assert on the exit code and the output, never on an exception type."""
    old = sys.argv
    sys.argv = ["edgeq", *map(str, args)]
    try:
        with pytest.raises(SystemExit) as e:
            cli.main()
            raise SystemExit(0)
    finally:
        sys.argv = old
    cap = capsys.readouterr()
    return e.value.code, cap.out, cap.err

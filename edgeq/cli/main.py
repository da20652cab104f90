"""The ``edgeq`` command: the Typer app, its commands (registered here, at import, in help order) and the entry point.

Each command lives in its own module of this package (``quantize.py`` holds ``quantize`` and ``recipes``): it
parses, calls the function of the package below that does the work, and prints the result through
:mod:`edgeq.console` (``--json`` everywhere; ``-q`` wherever progress is printed). Command modules import torch and
transformers only inside the command's body, so ``edgeq --help`` stays fast. :func:`main` turns an
:class:`EdgeqError` and a click usage error alike into one ``error: ...`` line on stderr and exit code 2; a broken
threshold is exit code 1.
"""

from __future__ import annotations

import errno
import signal
import sys
import threading
import warnings

import typer
from typer._click.exceptions import ClickException, NoArgsIsHelpError, NoSuchOption, UsageError  # typer vendors click

from edgeq.cli import bench, demo, fidelity, generate, inspect, native, quantize, repack, route, serve
from edgeq.cli.help import EdgeqGroup
from edgeq.console import error, out, say
from edgeq.errors import EdgeqError, ThresholdError
from edgeq.io.writer import RECEIVED, interrupts_deferred, record_interrupt

# rich_markup_mode=None: plain click help, so a help text's "[default: ...]" is shown, not read as rich markup.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, cls=EdgeqGroup,
                  rich_markup_mode=None, context_settings={"max_content_width": 120},
                  help="4-bit checkpoints for edge CPUs: quantize, inspect, run, and prove fidelity.")

# (name, function): `edgeq --help` lists them in this order
COMMANDS = (
    ("quantize", quantize.quantize), ("recipes", quantize.recipes), ("generate", generate.generate),
    ("serve", serve.serve), ("repack", repack.repack), ("demo", demo.demo), ("native", native.native),
    ("inspect", inspect.inspect), ("bench", bench.bench), ("route", route.route), ("fidelity", fidelity.fidelity),
)
for _name, _command in COMMANDS:
    app.command(_name)(_command)


def version_line() -> str:
    """``edgeq --version``: edgeq, torch, transformers and whether each native kernel is built, on one line."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    import torch  # noqa: PLC0415

    import edgeq.runtime.native.w4a8 as w4a8  # noqa: PLC0415
    import edgeq.runtime.native.w4a16 as w4a16  # noqa: PLC0415
    from edgeq.keys import VERSION  # noqa: PLC0415
    from edgeq.runtime.native.build import cache_dir  # noqa: PLC0415

    try:
        transformers = version("transformers")
    except PackageNotFoundError:
        transformers = "not installed"

    def built(kernel) -> str:  # the build's "ok" marker (build.build_or_load); nothing is built here
        done = (cache_dir() / kernel.SPEC.subdir / kernel.build_key()[:16] / "ok").exists()
        return "built" if done else "not built yet (`edgeq native`)"

    return (f"edgeq {VERSION}, torch {torch.__version__}, transformers {transformers}; native kernels: "
            f"w4a16 {built(w4a16)}, w4a8 {built(w4a8)}")


def _print_version(value: bool) -> None:
    if value:
        out.print(version_line(), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print the versions of edgeq, torch and transformers and whether the "
                                            "native kernels are built, and exit.")) -> None:
    """4-bit checkpoints for edge CPUs: quantize, inspect, run, and prove fidelity."""


def _usage_message(e: UsageError) -> str:
    """A click usage error as one line, pointing at the command's --help."""
    if isinstance(e, NoSuchOption) and e.possibilities:  # worded like click's "No such command ... Did you mean"
        message = f"{e.message}. Did you mean {', '.join(repr(p) for p in sorted(e.possibilities))}?"
    else:
        message = e.format_message().strip().replace("\n", " ").rstrip(".")
    return f"{message} (see '{e.ctx.command_path} --help')" if e.ctx is not None else message


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings shown to users: ``warning: <message>`` only, never the source path and line that raised it."""
    error(str(message), prefix="warning")


_OS_FIXES = {errno.EACCES: "check its permissions", errno.EPERM: "check its permissions",
             errno.EROFS: "the file system is read-only: choose a writable location",
             errno.ENOSPC: "free space or choose another location", errno.EDQUOT: "free space or choose another location",
             errno.EISDIR: "give a file, not a directory", errno.ENOTDIR: "a part of the path is not a directory",
             errno.EBUSY: "it is in use (a mount point?): choose another path"}


def os_error_line(e: OSError) -> str:
    """An OSError the system raised on a user's path (permissions, read-only or full disk, a directory where a file
    was expected) as one line naming the path and the fix."""
    where = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "") if e.filename else ""
    what = e.strerror or str(e)
    fix = _OS_FIXES.get(e.errno, "check the path")
    return f"{where}: {what}; {fix}" if where else f"{what}; {fix}"


# The commands that import torch and transformers: they are imported first, with interrupts deferred.
_LIBRARY_COMMANDS = {"quantize", "generate", "serve", "repack", "demo", "native", "inspect", "bench", "route",
                     "fidelity"}


def _load_libraries(args: list[str]) -> None:
    """torch and transformers imported with SIGINT/SIGTERM deferred (:func:`edgeq.io.writer.interrupts_deferred`):
    a Ctrl-C in the first second of `edgeq quantize` used to surface as an ImportError or RecursionError traceback from
    a half-imported numpy, or be lost (the conversion then ran to the end, exit 0)."""
    command = next((a for a in args if not a.startswith("-")), None)
    if command in _LIBRARY_COMMANDS and not {"--help", "-h"} & set(args):
        with interrupts_deferred():
            import torch  # noqa: F401, PLC0415
            import transformers  # noqa: F401, PLC0415


def main(argv: list[str] | None = None) -> None:
    """The ``edgeq`` entry point: every failure is one ``error: ...`` line on stderr, exit code 2 (1: a threshold)."""
    warnings.showwarning = _show_warning
    RECEIVED.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, record_interrupt) if main_thread else None  # remembered: the last except
    try:
        _run(argv)
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)


def _run(argv: list[str] | None) -> None:
    """:func:`main`'s work: the command, and every way it can fail turned into one line and an exit code."""
    try:
        _load_libraries(sys.argv[1:] if argv is None else [str(a) for a in argv])
        # Non-standalone typer returns the exit code of typer.Exit, and 130 for a KeyboardInterrupt it caught.
        code = app(args=argv, prog_name="edgeq", standalone_mode=False)
        if code == 130:
            raise KeyboardInterrupt
        sys.exit(code if isinstance(code, int) else 0)
    except EdgeqError as e:
        error(str(e))
        sys.exit(2)
    except OSError as e:  # a path the system refused: the writers have removed their temporary output already
        error(os_error_line(e))
        sys.exit(2)
    except ThresholdError as e:
        error(str(e), prefix="threshold broken")
        sys.exit(1)
    except KeyboardInterrupt:
        say("interrupted: nothing was written (partial output removed)")
        sys.exit(2)
    except NoArgsIsHelpError as e:  # bare `edgeq`: the help, on stderr
        e.show()
        sys.exit(2)
    except UsageError as e:
        error(_usage_message(e))
        sys.exit(2)
    except ClickException as e:
        error(e.format_message())
        sys.exit(2)
    except typer.Abort:  # typer's own Abort (typer.exceptions), not a click class
        sys.exit(2)
    except Exception:
        if RECEIVED:  # an interrupt inside a library turned into another exception on its way out
            say("interrupted: nothing was written (partial output removed)")
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()

"""How a command fails: one line on stderr and an exit code, whatever went wrong.

A library error (:class:`~maskln_cli.errors.MasklnError`) exits 2 with its message, Ctrl-C 130
and SIGTERM 143 (an output being written is discarded), a bug 2 with the way to see more; a
reader that closes stdout (``| head``) ends a report quietly, with the command's own exit code.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from maskln_cli.errors import MasklnError

EXIT_MISMATCH = 1
EXIT_ERROR = 2


class Terminated(BaseException):
    """SIGTERM, raised where the process is, so outputs are cleaned up as for Ctrl-C."""


def raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


Command = TypeVar("Command", bound=Callable[..., Any])


def reports_errors(command: Command | None = None, *, writes: bool = True) -> Any:
    """Turn library errors into one line on stderr and exit code 2; Ctrl-C/SIGTERM into 130/143.

    ``writes``: the command writes an output file, which Ctrl-C discards (and says so).
    """
    if command is None:
        return functools.partial(reports_errors, writes=writes)
    discarded = "; the output being written was discarded" if writes else ""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from maskln_cli.cli.report import messages

        try:
            with warnings.catch_warnings():
                # Library warnings are not for the command line's user: stderr carries one
                # line per error, and the conditions that warn are handled (or reported).
                warnings.simplefilter("ignore")
                return command(*args, **kwargs)
        except (typer.Exit, typer.Abort):  # a command's own exit code
            raise
        except MasklnError as failure:
            message = str(failure)
        except KeyboardInterrupt:
            _report(messages, f"interrupted{discarded}")
            raise typer.Exit(130) from None
        except Terminated:
            _report(messages, f"terminated{discarded}")
            raise typer.Exit(143) from None
        except MemoryError:
            message = "out of memory; try a smaller --chunk-rows"
        except OSError as failure:  # files are wrapped by tensorfile: this is stdout or stderr
            message = f"cannot write output: {failure.strerror or failure}"
        except Exception as failure:  # a bug: still one line, and the way to see more
            if os.environ.get("MASKLN_DEBUG"):
                raise
            message = (
                f"internal error: {type(failure).__name__}: {failure} (please report it; set"
                " MASKLN_DEBUG=1 for a traceback)"
            )
        _report(messages, message)
        detach_broken_stdout()
        raise typer.Exit(EXIT_ERROR)

    return wrapper  # type: ignore[return-value]


def _report(messages: Any, message: str) -> None:
    with contextlib.suppress(OSError):  # stderr itself may be gone
        messages.error(message)


def detach_broken_stdout() -> None:
    """After a failed write to stdout, stop Python retrying the flush (and warning) at exit."""
    if sys.stdout is None:
        return
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())


@contextlib.contextmanager
def quiet_when_stdout_closes(code: int) -> Any:
    """A report's reader closed the pipe (``| head``): stop writing, say nothing, and exit with
    the command's own code (the verdict's), as git and grep do."""
    from maskln_cli.errors import StdoutClosed

    try:
        yield
    except StdoutClosed:
        detach_broken_stdout()
        raise typer.Exit(code) from None


def end_with_report(
    code: int,
    json_output: bool,
    print_json: Callable[[], None],
    render: Callable[[], None],
) -> None:
    """A command's last step: its result as JSON (``--json``) or as its report, then exit with
    ``code``, the verdict's (0: none); a reader that closes stdout ends it with the same code."""
    with quiet_when_stdout_closes(code):
        if json_output:
            print_json()
        else:
            render()
    if code:
        raise typer.Exit(code)

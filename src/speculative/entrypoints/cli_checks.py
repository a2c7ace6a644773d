"""How the `speculative` command checks option values and reports errors.

Every error is one line on stderr: what was wrong, which option, file or line, and what
is allowed. Exit status 2 for bad usage (an option, file, prompt or model the command
cannot use), 1 for a failure while running, 3 when `serve` finds its port in use (as
uvicorn), 130 on Ctrl-C, 143 on SIGTERM (ended as on Ctrl-C: nothing half-written), 141
when the reader of stdout goes away (`| head`) or stdout is closed; a traceback only with
--verbose.
"""

from __future__ import annotations

import argparse
import errno
import io
import math
import os
import signal
import sys
import threading
import traceback

FAILURE, USAGE, PORT_BUSY, INTERRUPTED, BROKEN_PIPE, TERMINATED = 1, 2, 3, 130, 141, 143
EXIT_STATUSES = ("Exit status: 0 done, 1 failed while running, 2 bad usage, 3 the port to serve on is in use, 130 "
                 "interrupted (Ctrl-C), 143 terminated (SIGTERM), 141 stdout closed (the reader of a pipe went away, "
                 "as with | head).")
# Errors that mean "the input cannot be used" rather than "something failed while running".
USAGE_ERRORS = (ValueError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
                PermissionError)


class BusyPort(Exception):
    """The address `serve` was to listen on is taken: exit status 3."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(USAGE, f"error: {message} (see `{self.prog} --help`)\n")


def integer(low: int, high: int | None = None):
    """An argparse type: an integer >= low (and <= high when given)."""
    allowed = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value
    return parse


def number(low: float, strict: bool = False, high: float | None = None):
    """An argparse type: a finite number >= low (> low when strict), and <= high when given."""
    allowed = f"a finite number {'>' if strict else '>='} {low:g}" + ("" if high is None else f" and <= {high:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value
    return parse


def integer_list(text: str) -> tuple[int, ...]:
    """An argparse type: positive integers separated by commas, e.g. 1,2,4,8."""
    try:
        values = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        values = ()
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"must be positive integers separated by commas, e.g. 1,2,4,8; got {text!r}")
    return values


def argument_text(text: str, option: str) -> str:
    """Text given on the command line, refused when empty or not UTF-8 (Python keeps
    undecodable bytes of argv as lone surrogates, which no tokenizer takes)."""
    if not text:
        raise ValueError(f"{option} is empty; give some text")
    for index, char in enumerate(text):
        if 0xDC80 <= ord(char) <= 0xDCFF:
            raise ValueError(f"{option} holds byte 0x{ord(char) - 0xDC00:02x} at character {index}, which is not "
                             "UTF-8; pass UTF-8 text, or a UTF-8 file with --prompt-file")
    return text


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__


class Terminated(KeyboardInterrupt):
    """SIGTERM as an exception: a command then ends as on Ctrl-C (what it writes is written
    whole: a batch job's last record, a cache entry), with a line that says so, not killed
    mid-write in silence (`serve` handles SIGTERM itself, as a drain)."""


def _terminate(signum, frame):
    raise Terminated


def run_command(run, args) -> int:
    """Run one command; turn whatever it raises into one line and an exit status."""
    verbose = getattr(args, "verbose", False)
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        sys.stdout = ClosedStdout()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        code = run(args)
        sys.stdout.flush()  # a reader that went away shows up here, not at interpreter exit
        return code
    except BrokenPipeError:
        silence_stdout()
        return BROKEN_PIPE
    except BusyPort as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return PORT_BUSY
    except KeyboardInterrupt as error:
        if verbose:
            traceback.print_exc()
        terminated = isinstance(error, Terminated)
        print("terminated (SIGTERM)" if terminated else "interrupted", file=sys.stderr)
        return TERMINATED if terminated else INTERRUPTED
    except Exception as error:  # every error reaches the user as one line
        return failed(error, verbose)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def failed(error: Exception, verbose: bool) -> int:
    if verbose:
        traceback.print_exc()
    if isinstance(error, USAGE_ERRORS):
        print(f"error: {one_line(error)}", file=sys.stderr)
        return USAGE
    hint = "" if verbose else " (run with --verbose for the traceback)"
    print(f"error: {type(error).__name__}: {one_line(error)}{hint}", file=sys.stderr)
    return FAILURE


class ClosedStdout(io.TextIOBase):
    """sys.stdout of a process started with stdout closed, where Python leaves None: writing
    raises BrokenPipeError, as writing to a pipe whose reader went away does."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise BrokenPipeError(errno.EPIPE, "standard output is closed")


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush finds no broken pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass

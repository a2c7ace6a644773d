"""How the `speculative` command checks option values and reports errors.

Every error is one line on stderr: what was wrong, which option, file or line, and what
is allowed. Exit status 2 for bad usage (an option, file, prompt or model the command
cannot use), 1 for a failure while running, 130 on Ctrl-C, 141 when the reader of stdout
goes away (`| head`); a traceback only with --verbose.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

FAILURE, USAGE, INTERRUPTED, BROKEN_PIPE = 1, 2, 130, 141
# Errors that mean "the input cannot be used" rather than "something failed while running".
USAGE_ERRORS = (ValueError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(USAGE, f"error: {message} (see `{self.prog} --help`)\n")


def integer(low: int):
    """An argparse type: an integer >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value
    return parse


def number(low: float, strict: bool = False):
    """An argparse type: a finite number >= low (> low when strict)."""
    allowed = f"a finite number {'>' if strict else '>='} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
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


def run_command(run, args) -> int:
    """Run one command; turn whatever it raises into one line and an exit status."""
    verbose = getattr(args, "verbose", False)
    try:
        code = run(args)
        sys.stdout.flush()  # a reader that went away shows up here, not at interpreter exit
        return code
    except BrokenPipeError:
        silence_stdout()
        return BROKEN_PIPE
    except KeyboardInterrupt:
        if verbose:
            traceback.print_exc()
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as error:  # every error reaches the user as one line
        if verbose:
            traceback.print_exc()
        if isinstance(error, USAGE_ERRORS):
            print(f"error: {one_line(error)}", file=sys.stderr)
            return USAGE
        hint = "" if verbose else " (run with --verbose for the traceback)"
        print(f"error: {type(error).__name__}: {one_line(error)}{hint}", file=sys.stderr)
        return FAILURE


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush finds no broken pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass

"""argparse types the command-line tools share (pure Python: no MPI, so drivers that only
launch jobs can use them)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`, or a message saying what was expected."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def fraction(low: float = 0.0, high: float = 1.0, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a number from `low` (excluded where low_open) to `high`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (low < value <= high if low_open else low <= value <= high):
            raise argparse.ArgumentTypeError(f"expected a number {'above' if low_open else 'from'} {low:g} "
                                             f"{'and at most' if low_open else 'to'} {high:g}, got {text!r}")
        return value
    parse.__name__ = f"number in {'(' if low_open else '['}{low:g}, {high:g}]"
    return parse


def checked(check: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type: the text as given, once `check(text)` took it; its ValueError's
    message where not (a rate, a size: what the tool passes on as text)."""
    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    parse.__name__ = getattr(check, "__name__", "value")
    return parse


def unwritable(path: Path, directory: bool = False, parents: bool = False) -> str:
    """Why a file (a `directory`) cannot be written at `path`, or "": a file's directory
    must be a writable directory, or where the writer makes it (`parents`; a directory is
    made so always) its nearest existing ancestor; the path itself no directory (no file)."""
    if path.is_dir() if not directory else (path.exists() and not path.is_dir()):
        return "is a directory; name the file to write" if not directory else "is a file, not a directory"
    if not (directory or parents) and not path.parent.exists():
        return f"is in {path.parent}, which does not exist"
    ancestor = path if directory and path.is_dir() else path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is not a directory"
    if not os.access(ancestor, os.W_OK):
        return f"{ancestor} is not writable"
    return ""


def output(directory: bool = False, parents: bool = False) -> Callable[[str], str]:
    """An argparse type: a path a file (a `directory`) can be written at, checked before the
    tool's work ("-": standard output), so minutes of measuring are not lost to a typo;
    `parents`: the tool makes a file's missing directories."""
    def parse(text: str) -> str:
        why = "" if text == "-" and not directory else unwritable(Path(text), directory, parents)
        if why:
            raise argparse.ArgumentTypeError(f"{text} {why}")
        return text
    parse.__name__ = "directory to write" if directory else "file to write"
    return parse


def comma_names(text: str) -> list[str]:
    """The names in comma-separated `text`, stripped, empty ones left out."""
    return [name.strip() for name in text.split(",") if name.strip()]


def names(text: str) -> list[str]:
    """An argparse type: comma-separated names, at least one (',' named none, and a tool
    printed an empty table with exit status 0)."""
    given = comma_names(text)
    if not given:
        raise argparse.ArgumentTypeError(f"expected one name or more, comma-separated, got {text!r}")
    return given


class UsageError(SystemExit):
    """Bad input to a command, the user's mistake and not the program's, found before
    anything runs: exit status 2, as argparse's errors have; its text is the one line
    refuse() prints, "PROG: what was wrong and what is expected"."""

    def __init__(self, prog: str, message: str):
        super().__init__(2)
        self.line = f"{prog}: {message}"

    def __str__(self) -> str:
        return self.line


def refuse(prog: str, message: str) -> NoReturn:
    """Say what was wrong in one line on stderr and exit with status 2 (UsageError)."""
    error = UsageError(prog, message)
    print(error, file=sys.stderr, flush=True)
    raise error


def failure_status(error: Exception) -> int:
    """A tool's exit status for `error`: 2 where the input was wrong (a ValueError, a path
    that is not there or not what was expected: a wrapper's RESTARTS loop does not retry
    those), 1 for a failure while working (disk full, a read error)."""
    wrong_path = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)
    return 1 if isinstance(error, OSError) and not isinstance(error, wrong_path) else 2

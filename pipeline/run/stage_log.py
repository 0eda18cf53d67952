"""While a stage runs, third-party output goes to its log file and mxspec's own lines stay on the terminal.

Quark prints INFO lines, transformers and huggingface_hub draw loading bars, and C extensions write
to the file descriptors directly, so the redirection is of descriptors 1 and 2, not of `sys.stdout`:
they point at OUT/.mxspec/logs/<stage>.log for the stage's duration, and the console (mxspec's
progress bars and status lines) writes to a copy of the terminal's descriptor. The log keeps the last
run of each stage. `MXSPEC_VERBOSE=1` (`mxspec --verbose`) leaves everything on the terminal.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

__all__ = ["VERBOSE_ENV", "verbose", "third_party_output_to"]

VERBOSE_ENV = "MXSPEC_VERBOSE"
_TERMINAL_FDS = (1, 2)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


@contextmanager
def third_party_output_to(log: Path, console: Console) -> Iterator[None]:
    """Descriptors 1 and 2 into `log` for the block; `console` keeps writing where it wrote before."""
    if verbose():
        yield
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    _flush()
    saved = {fd: os.dup(fd) for fd in _TERMINAL_FDS}
    console_file = console.file
    console_fd = _fileno(console_file)
    terminal = None
    if console_fd in saved:  # the console writes to a descriptor about to be redirected: give it a copy
        terminal = os.fdopen(os.dup(saved[console_fd]), "w", buffering=1, encoding="utf-8", errors="replace")
        console.file = terminal
    try:
        with open(log, "w", encoding="utf-8") as sink:
            for fd in _TERMINAL_FDS:
                os.dup2(sink.fileno(), fd)
            try:
                yield
            finally:
                _flush()
                for fd, copy in saved.items():
                    os.dup2(copy, fd)
    finally:
        for copy in saved.values():
            os.close(copy)
        if terminal is not None:
            console.file = console_file
            terminal.close()


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.StringIO and other streams without a descriptor
        return None


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass

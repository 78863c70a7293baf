"""Shared CLI plumbing: consoles, JSON output, turning known errors into one line and an exit code."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from .._console import console, err_console
from .._errors import EngineError, UserError, is_disk_full

__all__ = ["cli_errors", "console", "err_console", "print_json", "writable_run_dir"]


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """UserError/EngineError -> 'error: ...' on stderr and exit 2; no traceback."""
    try:
        yield
    except (UserError, EngineError) as error:
        _print_error(str(error))
        raise typer.Exit(2) from None
    except OSError as error:
        if not is_disk_full(error):
            raise
        _print_error(f"no space left on the disk for {error.filename}: every file written before is kept; free "
                     f"space and run the command again (with --resume for a run)")
        raise typer.Exit(2) from None


def _print_error(message: str) -> None:
    from rich.markup import escape

    err_console.print(f"[red]error:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True)


def writable_run_dir(path: Path) -> Path:
    """The run directory, absolute and created; refuses a path that is a file, cannot be made or is read-only."""
    target = path.expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise UserError(f"--run-dir {path}: exists and is not a directory")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"--run-dir {path}: cannot create it ({error.strerror})") from None
    if not os.access(target, os.W_OK | os.X_OK):
        raise UserError(f"--run-dir {path}: not writable by this user")
    return target

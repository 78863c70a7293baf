"""Shared CLI plumbing: consoles, JSON output, turning known errors into one line and an exit code."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from .._errors import EngineError, UserError

# Piped output (make, CI logs) gets wide tables instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 150)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """UserError/EngineError -> 'error: ...' on stderr and exit 2; no traceback."""
    try:
        yield
    except (UserError, EngineError) as error:
        err_console.print(f"[red]error:[/] {escape(str(error))}", highlight=False, markup=True)
        raise typer.Exit(2) from None

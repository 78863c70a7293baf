"""Shared CLI plumbing: consoles, JSON output, turning known errors into one line and an exit code."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import typer
from rich.markup import escape

from .._console import console, err_console
from .._errors import EngineError, UserError

__all__ = ["cli_errors", "console", "err_console", "print_json"]


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

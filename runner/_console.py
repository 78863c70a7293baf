"""The consoles every command and executor prints to: results on stdout, progress and logs on stderr."""

from __future__ import annotations

import sys

from rich.console import Console

# Piped output (make, CI logs) gets wide lines instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 150)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)

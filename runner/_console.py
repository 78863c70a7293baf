"""The consoles every command and executor prints to: results on stdout, progress and logs on stderr.

Each is made, and rich imported, on first use; a command run with --json prints its JSON straight to
stdout and gets the silent progress() and status(), so it does not import rich at all (~20 ms of its start)."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from rich.console import Console
    from rich.progress import Progress


class _OnFirstUse:
    """A rich Console, made when something first asks it for anything. Rich's own objects (a Progress) are
    given the console itself: they use it as a context manager, which no proxy can stand in for."""

    def __init__(self, *, stderr: bool):
        self._made_for_stderr = stderr
        self._made: Console | None = None

    def _console(self) -> Console:
        if self._made is None:
            from rich.console import Console

            stream = sys.stderr if self._made_for_stderr else sys.stdout
            # Piped output (make, CI logs) gets wide lines instead of rich's 80-column default.
            self._made = Console(stderr=self._made_for_stderr, width=None if stream.isatty() else 150)
        return self._made

    def __getattr__(self, name: str) -> Any:
        return getattr(self._console(), name)


_stderr = _OnFirstUse(stderr=True)
console: Console = _OnFirstUse(stderr=False)  # type: ignore[assignment]
err_console: Console = _stderr  # type: ignore[assignment]


class _Silent:
    """What a quiet command's progress lines are: rich Progress's calls, doing nothing."""

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, **fields: Any) -> int:
        return 0

    def update(self, task: int, **fields: Any) -> None:
        return None


def progress(*, quiet: bool) -> Progress:
    """Progress lines on stderr (spinner, description, time elapsed); silent when `quiet`."""
    if quiet:
        return _Silent()  # type: ignore[return-value]
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                    console=_stderr._console())


def status(message: str, *, quiet: bool) -> AbstractContextManager[object]:
    """A spinner with `message` on stderr while the block runs; nothing when `quiet`."""
    return contextlib.nullcontext() if quiet else err_console.status(message)

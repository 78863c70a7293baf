"""The `runner` console script: the CLI, started with the cyclic garbage collector off.

A command's start-up (typer, msgspec, yaml, rich, the command's modules) makes ~100k objects that live as
long as the process; with the collector on, each full collection scans all made so far, ~35 ms of a
command's ~0.15 s start. `runner.cli.main` freezes them out of the collector's sight and turns it back on
before the command runs."""

from __future__ import annotations

import gc


def main() -> None:
    gc.disable()
    from .cli import main as run_command

    run_command()

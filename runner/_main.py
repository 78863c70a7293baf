"""The `runner` console script: the CLI, started with the cyclic garbage collector off.

A command's start-up (typer, msgspec, yaml, the command's modules) makes objects that live as long as the
process; with the collector on, its young and middle collections scan them as they are made, ~9 ms of a
probe command's ~0.15 s. `runner.cli.main` freezes them out of the collector's sight and turns it back on
before the command runs."""

from __future__ import annotations

import gc


def main() -> None:
    gc.disable()
    from .cli import main as run_command

    run_command()

"""The `runner` command line: one module per command, registered here."""

from __future__ import annotations

import gc
import importlib
import signal
import sys

import typer

from runner_contracts.processes import end_without_teardown

# Command name -> "module:attribute" in this package (a typer app is a command group), in help order. A
# command imports only its own module: what the others import costs every command ~25 ms.
COMMANDS = {
    "stacks": "stacks:app", "policy": "policy:app", "tasks": "tasks:app", "images": "images:app",
    "plan": "plan:app", "bundle": "bundle:app", "qualify": "qualify:qualify", "compare": "compare:compare",
    "pin": "pin:pin", "validate": "validate:validate", "report": "report:report", "status": "status:status",
    "cancel": "status:cancel",
}


def build_app(only: str | None = None) -> typer.Typer:
    """The `runner` app with every command, or with just `only` when it names one."""
    cli = typer.Typer(
        name="runner",
        help="Qualify RL and fine-tuning stacks before committing GPU weeks to one.\n\n"
             "Each stack runs in its own pinned environment on one frozen plan; runner audits the evidence "
             "(sampled tokens, loss masks, logprobs, resume after a kill) and reports gates and statistics.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    cli.callback()(lambda: None)  # a group even with one command registered, so `runner qualify ...` parses
    for name, target in COMMANDS.items():
        if only in COMMANDS and name != only:
            continue
        module, attribute = target.split(":")
        command = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
        if isinstance(command, typer.Typer):
            cli.add_typer(command, name=name)
        else:
            cli.command(name)(command)
    return cli


def __getattr__(name: str) -> typer.Typer:
    if name == "app":  # the whole app, for tests and embedding
        return build_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _terminate(signum, frame) -> None:
    # SIGTERM unwinds like Ctrl-C, so running stages are killed and their evidence marked.
    raise SystemExit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _terminate)
    app = build_app(sys.argv[1] if len(sys.argv) > 1 else None)
    # What start-up made lives as long as the command: out of the collector's sight, which runner._main
    # turned off for the start-up.
    gc.freeze()
    gc.enable()
    try:
        app()
    except SystemExit as exit:
        code = exit.code
    else:
        code = 0
    if isinstance(code, str):
        sys.stderr.write(code + "\n")
    # Finalizing the imported modules one by one takes ~70 ms a command; every file runner writes is closed
    # and renamed into place by then.
    end_without_teardown(code if isinstance(code, int) else int(code is not None))

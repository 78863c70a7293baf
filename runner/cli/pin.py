"""`runner pin`: resolve a stack's lock and write its pin record, or check that nothing drifted."""

from __future__ import annotations

import msgspec
import typer
from rich.table import Table

from .._pins import check_pins, hash_lock, pin_path, resolve_lock, write_pin_set
from .._errors import UserError
from .._stacks import all_stacks, get_stack
from ._common import cli_errors, console, err_console, print_json


def pin(
    stack: str = typer.Option(None, "--stack", help="Stack to pin or check (default with --check: every stack)."),
    check: bool = typer.Option(False, "--check", help="Only compare stack.toml, requirements.in, the lock and "
                                                      "pins.json; exit 1 naming what drifted. Runs nothing."),
    no_resolve: bool = typer.Option(False, "--no-resolve", help="Record the current lock as is (no resolver run; "
                                                                "pins without a sha256 get one)."),
    upgrade: bool = typer.Option(False, "--upgrade", help="Resolve afresh: the current lock's versions are kept "
                                                          "as constraints otherwise."),
    gpu: bool = typer.Option(False, "--gpu", help="Pin the stack's GPU environment instead ([gpu] in stack.toml: "
                                                  "its own requirements and lock, record in pins-gpu.json)."),
    upstream: str = typer.Option(None, "--upstream", help="Write a second pin set for another release of the "
                                                          "stack's upstream, e.g. trl==1.15.0 (stacks/<stack>/pins/"
                                                          "<version>/); compare them as --stacks trl@1.15.0,trl@1.16.0."),
    json_output: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Pin a stack: resolve stacks/<stack>/requirements.in into its lock (pip's resolver, sha256 hashes)
    and write stacks/<stack>/pins.json (upstream, version, git revision, Python, lock sha256).

    With --gpu, the stack's GPU environment instead (e.g. lightning-verl: requirements-gpu.in ->
    requirements-gpu.lock and pins-gpu.json). `runner images build` adds image digests to the same record;
    the probe gate of every engine compares the running environment with the lock and fails on drift.
    """
    with cli_errors():
        if check:
            manifests = [get_stack(stack)] if stack else list(all_stacks().values())
            drift = {f"{variant.name}{' (gpu)' if variant.variant == 'gpu' else ''}": check_pins(variant)
                     for manifest in manifests for variant in [*manifest.variants(), *manifest.pin_sets()]}
            if json_output:
                print_json({"drift": drift, "passed": not any(drift.values())})
            else:
                table = Table(title="pins")
                table.add_column("stack")
                table.add_column("drift")
                for name, problems in drift.items():
                    table.add_row(name, "\n".join(problems) or "[green]none[/]")
                console.print(table)
            raise typer.Exit(1 if any(drift.values()) else 0)
        if not stack:
            raise typer.BadParameter("name the stack to pin with --stack (or use --check)")
        manifest = get_stack(stack)
        if gpu:
            if manifest.gpu is None:
                raise UserError(f"stack {stack} has no GPU environment ([gpu] table in its stack.toml)")
            manifest = manifest.for_gpu()
        if upstream:
            with err_console.status(f"resolving {upstream} for the {stack} stack"):
                record = write_pin_set(manifest, upstream, log=lambda message: err_console.print(f"[dim]{message}[/]"))
            manifest = manifest.at_version(record.version)
        elif no_resolve:
            with err_console.status(f"hashing the {stack} lock"):
                record = hash_lock(manifest, log=lambda message: err_console.print(f"[dim]{message}[/]"))
        else:
            with err_console.status(f"resolving the {stack} lock"):
                record = resolve_lock(manifest, log=lambda message: err_console.print(f"[dim]{message}[/]"),
                                      upgrade=upgrade)
    if json_output:
        print_json(msgspec.to_builtins(record))
    else:
        console.print(f"{manifest.lock} ({len(manifest.locked_packages())} pins, sha256 {record.lock_sha256[:12]}) "
                      f"and {pin_path(manifest)} written", highlight=False)

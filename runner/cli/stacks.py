"""`runner stacks list`: the registered stacks, read from their manifests."""

from __future__ import annotations

import typer
from rich.table import Table

from .._engines.local import ENV_MARKER, LocalEngine, find_python
from .._errors import EngineError
from .._stacks import all_stacks
from ._common import cli_errors, console, print_json

app = typer.Typer(help="Inspect the stacks runner knows (folders under stacks/ with a stack.toml).",
                  no_args_is_help=True)


@app.command("list")
def list_stacks(json_output: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List stacks with their kind, upstream pin, Python, lock hash and whether their environment is built.

    Trainer stacks (trl) train and host their environment in-process; environment stacks (nemo-gym,
    openenv, verifiers, lightning-verl) serve rollouts to the trainer stack named in their manifest. A stack
    with a GPU environment (lightning-verl: verl) trains itself on GPU plans; its GPU lock is listed too.
    Harness stacks (inspect) are evaluation harnesses a plan's `harnesses` runs in the evaluate stage."""
    with cli_errors():
        engine = LocalEngine()
        rows = []
        for manifest in all_stacks().values():
            try:
                _, python_version = find_python(manifest.python)
                built = (engine.env_path(manifest, python_version) / ENV_MARKER).is_file()
            except EngineError:
                built = False
            rows.append({
                "name": manifest.name, "upstream": f"{manifest.upstream.name}=={manifest.upstream.version}",
                "python": manifest.python, "lock_sha256": manifest.lock_sha256, "environment_built": built,
                "gpu_lock_sha256": manifest.for_gpu().lock_sha256 if manifest.gpu else None,
                "kind": manifest.kind, "trainer": manifest.trainer,
                "stages": list(manifest.stages), "capabilities": list(manifest.capabilities),
                "description": manifest.description,
            })
    if json_output:
        print_json(rows)
        return
    table = Table(title="stacks")
    for column in ("name", "kind", "upstream", "python", "lock", "env", "description"):
        table.add_column(column)
    for row in rows:
        kind = {"environment": f"environment (trainer: {row['trainer']})",
                "harness": "harness (evaluates the served checkpoints)",
                "domain": "domain (trains and scores natively)"}.get(row["kind"], "trainer")
        if row["gpu_lock_sha256"]:
            kind += "; trains itself on GPU plans"
        lock = row["lock_sha256"][:12] + (f"\ngpu: {row['gpu_lock_sha256'][:12]}" if row["gpu_lock_sha256"] else "")
        table.add_row(row["name"], kind, row["upstream"], row["python"], lock,
                      "built" if row["environment_built"] else "-", row["description"])
    console.print(table)

"""`runner bundle`: a qualified run's checkpoint with its evidence, model card and checksums, and the check
of a bundle someone handed over."""

from __future__ import annotations

from pathlib import Path

import typer
import typer.core

from .._errors import UserError
from ._common import cli_errors, console, err_console, print_json


class _CreateByDefault(typer.core.TyperGroup):
    """`runner bundle RUN_DIR ...` creates; `runner bundle verify DIR` verifies."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args.insert(0, "create")
        return super().resolve_command(ctx, args)


app = typer.Typer(cls=_CreateByDefault, no_args_is_help=True,
                  help="Bundle a qualified run for hand-over (`runner bundle RUN_DIR --out DIR`), or check one "
                       "(`runner bundle verify DIR`).")


@app.command("create", hidden=True)
def create(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="An arm's run directory (runs/... or compare/arms/S)."),
    out: Path = typer.Option(..., "--out", help="A new (or empty) folder for the bundle."),
    allow_failed: bool = typer.Option(False, "--allow-failed", help="Bundle a run whose gates did not all pass; "
                                                                    "the model card says so."),
    push_to_hub: str = typer.Option(None, "--push-to-hub", help="Then upload it to this hub repository (private) "
                                                                "with huggingface_hub's client and its token."),
    json_output: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Write the trained checkpoint as save_pretrained lays it out, the run's plan and evidence
    (evidence/), a model card (README.md with the Hugging Face metadata header: base model, task
    families, held-out and retention accuracy, the release verdict) and SHA256SUMS."""
    from .._bundle import create as create_bundle, push

    with cli_errors():
        with err_console.status(f"bundling {run_dir}"):
            result = create_bundle(run_dir, out, allow_failed=allow_failed)
        if push_to_hub:
            result["pushed"] = push(out, push_to_hub)
    if json_output:
        print_json(result)
        return
    state = "[green]qualified[/]" if result["qualified"] else "[yellow]not qualified (--allow-failed)[/]"
    console.print(f"{out}: {result['files']} files, weights sha256 {result['weights_sha256'][:12]}, {state}",
                  highlight=False)


@app.command("verify")
def verify(bundle: Path = typer.Argument(..., metavar="DIR", help="A bundle folder."),
           json_output: bool = typer.Option(False, "--json", help="Print the problems as JSON.")) -> None:
    """Check every file against SHA256SUMS, that no file was added, and that the weights are a checkpoint
    the bundle's train evidence records. Exit 0 when intact, 1 otherwise."""
    from .._bundle import verify as verify_bundle

    with cli_errors():
        if not bundle.is_dir():
            raise UserError(f"{bundle}: no such folder")
        problems = verify_bundle(bundle)
    if json_output:
        print_json({"bundle": str(bundle), "problems": problems})
    else:
        for problem in problems:
            err_console.print(f"[red]problem:[/] {problem}", highlight=False)
        console.print(f"[green]{bundle}: intact[/]" if not problems else f"[red]{bundle}: {len(problems)} problem(s)[/]",
                      highlight=False)
    raise typer.Exit(1 if problems else 0)

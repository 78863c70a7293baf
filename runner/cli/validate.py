"""`runner validate FILE...`: check contract files (schema + per-record consistency)."""

from __future__ import annotations

from pathlib import Path

import typer

from .._validate import validate_file
from ._common import console, err_console, print_json


def validate(
    files: list[Path] = typer.Argument(..., metavar="FILE...", help="trajectories.jsonl, training.jsonl, evidence.json, plan.json, ..."),
    json_output: bool = typer.Option(False, "--json", help="Print results as JSON."),
) -> None:
    """Validate contract files line by line in constant memory.

    Checks the schema (types, required fields, non-negative ids, logprobs <= 0, known segment sources,
    contract version) and each record's consistency (one finite logprob per policy token, finite
    rewards, unique episode ids per stage, matching row lengths). Every error names file:line and the
    field (the first 20 per file). A JSONL file of 4 MB or more is checked in byte ranges on one worker
    process per CPU (up to 8). Exit code 1 if any file has errors.
    """
    reports = [validate_file(path) for path in files]
    if json_output:
        print_json([{"path": r.path, "contract": r.contract, "records": r.records, "ok": r.ok,
                     "errors": [{"line": e.line, "field": e.field, "message": e.message} for e in r.errors],
                     "more_errors": r.truncated_errors} for r in reports])
    else:
        for report in reports:
            if report.ok:
                console.print(f"[green]ok[/] {report.path}: {report.records} {report.contract} record(s)", highlight=False)
            for error in report.errors:
                err_console.print(f"[red]error[/] {error}", highlight=False, markup=True, soft_wrap=True)
            if report.truncated_errors:
                err_console.print(f"{report.path}: more errors not shown", highlight=False)
    raise typer.Exit(0 if all(r.ok for r in reports) else 1)

"""`runner report RUN_DIR`: (re)write report.md and summary.json from a run's evidence."""

from __future__ import annotations

from pathlib import Path

import typer

from .._report import gate_table, load_run, write_report
from ._common import cli_errors, console, print_json


def report(
    run_dir: Path = typer.Argument(..., help="A run directory written by `runner qualify`."),
    json_output: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Rebuild the report of a run from its plan.json and per-stage evidence.json files."""
    with cli_errors():
        data = write_report(run_dir)
        plan, evidence = load_run(run_dir)
    if json_output:
        print_json(data)
        return
    console.print(gate_table(evidence, f"{data['stack']} on {plan.name} (plan {(plan.plan_id or '')[:12]})"))
    console.print(f"report: {run_dir / 'report.md'}", highlight=False)

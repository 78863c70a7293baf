"""`runner status` and `runner cancel`: the Slurm jobs of a run directory, and the evidence they wrote."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from .._executors.slurm import cancel_run, status as run_status
from ._common import cli_errors, console, print_json


def status(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A run or comparison directory submitted with --executor slurm."),
    json_output: bool = typer.Option(False, "--json", help="Print the states as JSON."),
) -> None:
    """Job states (squeue; scontrol and sacct, or the job-completion log, once a job ended), the stages each
    arm has finished, and why a failed one failed. Exit code 0 when every job completed, 1 while jobs run
    or after one failed."""
    with cli_errors():
        current = run_status(run_dir)
    if json_output:
        print_json(current)
    else:
        table = Table(title=f"{current['kind']}: {run_dir}")
        for column in ("job", "id", "state", "restarts", "stages", "error"):
            table.add_column(column)
        for row in current["jobs"]:
            stages = " ".join(f"{stage}:{status}" for stage, status in (row.get("stages") or {}).items())
            state = row["state"] + (f" ({row['reason']})" if row["reason"] else "")
            table.add_row(row["name"], str(row["job_id"]), state, str(row["restarts"]), stages, row.get("error") or "")
        console.print(table)
    done = current["finished"] and all(row["state"] == "COMPLETED" for row in current["jobs"])
    raise typer.Exit(0 if done else 1)


def cancel(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A run or comparison directory submitted with --executor slurm."),
) -> None:
    """Cancel the run's jobs that have not ended (scancel). Evidence already written stays; a cancelled
    stage is marked interrupted, and `--resume` continues it later."""
    with cli_errors():
        cancelled = cancel_run(run_dir)
    console.print(f"cancelled {', '.join(cancelled)}" if cancelled else "no job of this run was still pending or running",
                  highlight=False)

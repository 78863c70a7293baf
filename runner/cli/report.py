"""`runner report RUN_DIR`: (re)write a run's or a comparison's reports from the evidence."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .._compare import write_comparison
from .._domain_report import write_side_by_side
from .._executors.slurm import arm_order
from .._report import gate_table, load_run, write_report
from ._common import cli_errors, console, print_json


def report(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A run directory written by `runner qualify`, or a comparison "
                                            "directory written by `runner compare` (it has arms/)."),
    beside: list[Path] = typer.Option([], "--beside", help="Domain runs only: other runs of the same domain stack "
                                                           "(two model sizes, two pins) to set side by side with this "
                                                           "one in <RUN_DIR>/side-by-side.html. Repeatable."),
    json_output: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Rebuild the report of a run from its plan.json and per-stage evidence.json files; for a comparison,
    every arm's report and comparison.json, comparison.md and report.html. With --beside, a domain run's native
    metrics, gates and training curves next to other domain runs' on one page."""
    if beside:
        with cli_errors():
            path, rows = write_side_by_side(run_dir, beside)
        if json_output:
            print_json(rows)
        else:
            console.print(f"side by side: {path}", highlight=False)
        return
    if (run_dir / "arms").is_dir():
        with cli_errors():
            stacks = sorted(path.parent.name for path in (run_dir / "arms").glob("*/plan.json"))
            ran = arm_order(run_dir)  # keep the order the arms ran in
            if ran is None and (run_dir / "comparison.json").is_file():
                ran = [arm["stack"] for arm in json.loads((run_dir / "comparison.json").read_text())["arms"]]
            if ran:
                stacks = [s for s in ran if s in stacks] + [s for s in stacks if s not in ran]
            for stack in stacks:
                write_report(run_dir / "arms" / stack)
            result = write_comparison(run_dir, stacks)
        if json_output:
            print_json(result)
        else:
            console.print(f"comparison of {', '.join(stacks)}: {run_dir / 'comparison.md'}", highlight=False)
        return
    with cli_errors():
        data = write_report(run_dir)
        plan, evidence = load_run(run_dir)
    if json_output:
        print_json(data)
        return
    console.print(gate_table(evidence, f"{data['stack']} on {plan.name} (plan {(plan.plan_id or '')[:12]})"))
    console.print(f"report: {run_dir / 'report.md'}", highlight=False)

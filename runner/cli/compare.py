"""`runner compare`: several stacks, one frozen plan, run one after another, reported side by side."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import typer
from rich.table import Table

from .._compare import table_rows, write_comparison
from .._engine import LocalEngine
from .._engines import make_engine
from .._errors import EngineError, UserError
from .._executor import submit_comparison
from .._slurm import load_profile
from .._plan import load_plan
from .._policy import resolve_policy
from .._qualify import RECIPE_STAGES
from .._stacks import get_stack
from ._common import cli_errors, console, err_console, print_json
from .qualify import check_executor, check_run_dir, follow_with_progress, report_submitted, run_arm_with_progress


def compare(
    stacks: str = typer.Option(..., "--stacks", help="Comma-separated stacks, e.g. trl,openenv,verifiers,nemo-gym."),
    plan_path: Path = typer.Option(..., "--plan", help="Plan file (YAML) every arm runs, e.g. "
                                                        "qualification/plans/calc-tool-cpu.yaml."),
    engine: str = typer.Option("local", "--engine", help="Where the stacks run: local (per-stack virtualenvs), "
                                                          "docker or podman (each stack's image)."),
    run_dir: Path = typer.Option(None, "--run-dir", help="Comparison directory (default: runs/<time>-compare-<plan>); "
                                                         "arms go to <run-dir>/arms/<stack>."),
    executor: str = typer.Option("local", "--executor", help="Who runs the arms: local (this host, one after "
                                                             "another) or slurm (one job per arm, chained)."),
    cluster: Path = typer.Option(None, "--cluster", help="Cluster profile (TOML) for --executor slurm."),
    dry_run: bool = typer.Option(False, "--dry-run", help="--executor slurm: write the scripts and the frozen plan, "
                                                          "submit nothing."),
    follow_jobs: bool = typer.Option(True, "--follow/--no-follow", help="--executor slurm: wait for every job and "
                                                                        "print the comparison (default)."),
    json_output: bool = typer.Option(False, "--json", help="Print comparison.json to stdout."),
) -> None:
    """Qualify several stacks on the same frozen plan, one after another, and compare them.

    Every arm starts from the same policy bytes with the same plan, budget and seeds; environment stacks
    (nemo-gym, openenv, verifiers) are driven by the same pinned TRL trainer through a policy server, so the
    comparison isolates the environment stack. Writes comparison.json, comparison.md and report.html:
    gate matrix, trace fidelity, recovery (resume, injected environment crash), isolation, time to the first
    reproducible update, throughput, held-out and retention success with confidence intervals.
    Exit code 0 only if every arm passed every gate.
    """
    with cli_errors():
        names = [name.strip() for name in stacks.split(",") if name.strip()]
        if len(names) < 2 or len(set(names)) != len(names):
            raise UserError(f"--stacks {stacks!r}: name two or more different stacks")
        manifests = [get_stack(name) for name in names]
        plan = load_plan(plan_path)
        log = (lambda message: err_console.print(f"[dim]{message}[/]")) if not json_output else (lambda m: None)
        check_executor(executor, engine, cluster, dry_run)
        runner_engine = make_engine(engine, log=log) if executor == "local" else None
        with err_console.status("preparing the policy"):
            frozen = resolve_policy(plan, LocalEngine(log=log))
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        target = (run_dir or Path("runs") / f"{stamp}-compare-{re.sub(r'[^A-Za-z0-9_.-]', '_', frozen.name)}").resolve()
        if executor == "slurm":
            for name in names:
                check_run_dir(target / "arms" / name, frozen)
            jobs = submit_comparison(names, frozen, target, engine, load_profile(cluster), dry_run=dry_run)
            if dry_run or not follow_jobs:
                report_submitted(jobs, target, dry_run=dry_run, json_output=json_output)
                raise typer.Exit(0)
            follow_with_progress(target, quiet=json_output)
            if not (target / "comparison.json").is_file():
                raise EngineError(f"the report job wrote no comparison.json; `runner status {target}` shows why")
            result = json.loads((target / "comparison.json").read_text())
        else:
            for manifest in manifests:
                stages = [s for s in manifest.stages if s in RECIPE_STAGES[frozen.recipe]]
                run_arm_with_progress(manifest, runner_engine, frozen, target / "arms" / manifest.name, stages,
                                      quiet=json_output)
            result = write_comparison(target, names)
        result["run_dir"] = str(target)
    if json_output:
        print_json(result)
    else:
        table = Table(title=f"{frozen.name} (plan {frozen.plan_id[:12]})", show_lines=True)
        table.add_column("")
        for name in names:
            table.add_column(name)
        for label, cells in table_rows(result["arms"]):
            table.add_row(label, *cells)
        console.print(table)
        verdict = "[green]every arm passed every gate[/]" if result["passed"] else "[red]not every arm qualified[/]"
        console.print(f"{verdict}\ncomparison: {target / 'comparison.md'}, {target / 'comparison.json'}, "
                      f"{target / 'report.html'}", highlight=False)
    raise typer.Exit(0 if result["passed"] else 1)

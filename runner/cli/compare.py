"""`runner compare`: several stacks, one frozen plan, run one after another, reported side by side."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import typer
from rich.table import Table

from .._compare import pin_lines, table_rows
from .._console import status
from .._engines.local import LocalEngine
from .._errors import UserError
from .._executors import Submitted, make_executor
from .._plan import load_plan
from .._plan_checks import arm_problem
from .._policy import resolve_policy
from .._stacks import get_stack
from .._stages import RECIPE_STAGES
from ._common import cli_errors, console, err_console, print_json, writable_run_dir
from .qualify import logger, parse_stages, report_submitted


def compare(
    stacks: str = typer.Option(..., "--stacks", help="Comma-separated stacks, e.g. trl,openenv,verifiers,nemo-gym."),
    plan_path: Path = typer.Option(..., "--plan", help="Plan file (YAML) every arm runs, e.g. "
                                                        "qualification/plans/calc-tool-cpu.yaml."),
    engine: str = typer.Option("local", "--engine", help="Where the stacks run: local (per-stack virtualenvs), "
                                                          "docker or podman (each stack's image)."),
    stages: str = typer.Option(None, "--stages", help="Comma-separated subset every arm runs, e.g. "
                                                      "probe,service,rollout to screen stacks before training. "
                                                      "Default: every stage."),
    run_dir: Path = typer.Option(None, "--run-dir", help="Comparison directory (default: runs/<time>-compare-<plan>); "
                                                         "arms go to <run-dir>/arms/<stack>."),
    resume: bool = typer.Option(False, "--resume", help="Continue the comparison in --run-dir (one that was "
                                                        "killed or stopped): every arm keeps the stages that passed, "
                                                        "sets aside the interrupted one and runs it again."),
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
        if resume and (run_dir is None or not run_dir.is_dir()):
            raise UserError("--resume needs --run-dir: the comparison to continue" if run_dir is None else
                            f"--resume: {run_dir} is not a comparison's run directory; nothing to continue")
        plan = load_plan(plan_path, logger(json_output))
        if problem := arm_problem(plan, names):
            raise UserError(problem)
        target = writable_run_dir(run_dir) if run_dir else None
        runner = make_executor(executor, engine=engine, cluster=cluster, dry_run=dry_run, follow=follow_jobs,
                               quiet=json_output, log=logger(json_output))
        selected = {m.name: parse_stages(stages, tuple(s for s in m.stages if s in RECIPE_STAGES[plan.recipe]),
                                         m.name) for m in manifests}
        with status("preparing the policy", quiet=json_output):
            frozen = resolve_policy(plan, LocalEngine(log=logger(json_output)))
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        target = target or writable_run_dir(Path("runs") / f"{stamp}-compare-{re.sub(r'[^A-Za-z0-9_.-]', '_', frozen.name)}")
        result = runner.compare(manifests, frozen, target, selected, all_stages=not stages, resume=resume)
        if isinstance(result, Submitted):
            report_submitted(result, json_output=json_output)
            raise typer.Exit(0)
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
        for line in pin_lines(result.get("pin_changes", [])):
            console.print(line.removeprefix("## "), highlight=False, markup=False)
        verdict = "[green]every arm passed every gate[/]" if result["passed"] else "[red]not every arm qualified[/]"
        console.print(f"{verdict}\ncomparison: {target / 'comparison.md'}, {target / 'comparison.json'}, "
                      f"{target / 'report.html'}", highlight=False)
    raise typer.Exit(0 if result["passed"] else 1)

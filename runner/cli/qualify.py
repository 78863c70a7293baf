"""`runner qualify`: one stack, one frozen plan, every stage and gate, evidence in a run directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from runner_contracts import Evidence, Plan, read_record

from .._engine import LocalEngine
from .._engines import Engine, check_engine, make_engine
from .._executor import ENDED, EXECUTORS, follow, submit_qualification
from .._slurm import SubmittedJob, load_profile
from .._errors import UserError
from .._plan import load_plan
from .._policy import resolve_policy
from .._qualify import RECIPE_STAGES, STAGES, default_run_dir, prepare_arm, run_arm
from .._report import gate_table, load_run, write_report
from .._stacks import StackManifest, get_stack
from ._common import cli_errors, console, err_console, print_json

def _parse_stages(text: str | None, available: tuple[str, ...]) -> list[str]:
    """Stages to run, in order: the requested ones, or every stage the stack and the recipe have."""
    if not text:
        return [stage for stage in STAGES if stage in available]
    wanted = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise UserError(f"--stages: unknown stage(s) {', '.join(unknown)}; stages are {', '.join(STAGES)}")
    missing = [s for s in wanted if s not in available]
    if missing:
        raise UserError(f"--stages: the stack does not provide {', '.join(missing)}")
    return [stage for stage in STAGES if stage in wanted]


def check_executor(executor: str, engine: str, cluster: Path | None, dry_run: bool, image: str | None = None) -> None:
    if executor not in EXECUTORS:
        raise UserError(f"--executor {executor!r}: executors are {', '.join(EXECUTORS)}")
    check_engine(engine)
    if executor == "local" and (cluster or dry_run):
        raise UserError("--cluster and --dry-run belong to --executor slurm")
    if executor == "slurm" and image:
        raise UserError("--image belongs to --executor local: a Slurm job builds or finds the stack's image on "
                        "its node (Apptainer: <RUNNER_SIF_DIR>/<stack>.sif)")


def report_submitted(jobs: list[SubmittedJob], target: Path, *, dry_run: bool, json_output: bool) -> None:
    if json_output:
        print_json({"run_dir": str(target), "dry_run": dry_run,
                    "jobs": [{"name": j.name, "job_id": j.job_id, "script": j.script} for j in jobs]})
        return
    for job in jobs:
        what = "written (not submitted)" if dry_run else f"submitted as job {job.job_id}"
        console.print(f"{job.name}: {job.script} {what}", highlight=False)
    console.print(f"run directory: {target}" + ("" if dry_run else f"\nfollow it with: runner status {target}"),
                  highlight=False)


def follow_with_progress(target: Path, *, quiet: bool) -> dict[str, Any]:
    """Follows the run's Slurm jobs with one line per job (state, reason, stages done)."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console,
                  disable=quiet) as progress:
        lines: dict[str, Any] = {}

        def update(current: dict[str, Any]) -> None:
            for row in current["jobs"]:
                if row["name"] not in lines:
                    lines[row["name"]] = progress.add_task("", total=1)
                stages = row.get("stages") or {}
                done = ", ".join(f"{stage} {status}" for stage, status in stages.items())
                reason = f" ({row['reason']})" if row["reason"] else ""
                progress.update(lines[row["name"]], description=f"{row['name']} job {row['job_id']}: "
                                                                f"{row['state']}{reason}{'; ' + done if done else ''}",
                                completed=1 if row["state"] in ENDED else 0)

        return follow(target, update)


def check_run_dir(target: Path, plan: Plan) -> None:
    """Refuses a run directory that already holds another plan's arm."""
    if target.exists() and (target / "plan.json").is_file():
        existing = read_record(target / "plan.json", Plan)
        if existing.plan_id != plan.plan_id:
            raise UserError(f"run directory {target}: holds plan {(existing.plan_id or '')[:12]}, not "
                            f"{(plan.plan_id or '')[:12]}; arms with different plans are never mixed")


def run_arm_with_progress(manifest: StackManifest, engine: Engine, plan: Plan, target: Path,
                          selected: list[str], *, quiet: bool, resume: bool = False,
                          ) -> tuple[list[Evidence], dict[str, Any]]:
    """Prepares and runs one arm with a progress line per stage; writes its report."""
    check_run_dir(target, plan)
    target.mkdir(parents=True, exist_ok=True)
    with err_console.status(f"preparing the {manifest.name} environment(s)"):
        arm = prepare_arm(manifest, engine, plan, target)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=err_console, disable=quiet) as progress:
        tasks = {stage: progress.add_task(f"{manifest.name} {stage}: waiting", total=1) for stage in selected}

        def on_stage(stage: str, status: str) -> None:
            progress.update(tasks[stage], description=f"{manifest.name} {stage}: "
                                                      f"{'running' if status == 'start' else status}",
                            completed=0 if status == "start" else 1)

        arm.on_event = lambda stage, message: progress.update(tasks[stage], description=f"{manifest.name} {stage}: {message}")
        evidence = run_arm(arm, selected, on_stage, resume=resume)
    data = write_report(target)
    data["run_dir"] = str(target)
    return evidence, data


def qualify(
    stack: str = typer.Option(..., "--stack", help="Stack to qualify (see `runner stacks list`)."),
    plan_path: Path = typer.Option(..., "--plan", help="Plan file (YAML), e.g. qualification/plans/calc-tool-cpu.yaml."),
    engine: str = typer.Option("local", "--engine", help="Where the stack runs: local (per-stack virtualenv), "
                                                          "docker or podman (the stack's image, built if missing)."),
    image: str = typer.Option(None, "--image", help="Run this existing image of the stack instead of building one "
                                                    "(container engines); the probe gate refuses it if it drifted "
                                                    "from the stack's lock."),
    stages: str = typer.Option(None, "--stages", help="Comma-separated subset, e.g. probe,service. Default: all."),
    run_dir: Path = typer.Option(None, "--run-dir", help="Run directory (default: runs/<time>-<stack>-<plan>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --run-dir: keep the stages that passed, "
                                                        "set aside an interrupted one and run it again (a training "
                                                        "stage resumes from its last complete checkpoint)."),
    executor: str = typer.Option("local", "--executor", help="Who runs the arm: local (this host) or slurm (an "
                                                             "sbatch job; see --cluster)."),
    cluster: Path = typer.Option(None, "--cluster", help="Cluster profile (TOML) for --executor slurm, e.g. "
                                                          "clusters/example-h100.toml."),
    dry_run: bool = typer.Option(False, "--dry-run", help="--executor slurm: write the script and the frozen plan "
                                                          "into the run directory, submit nothing."),
    follow_jobs: bool = typer.Option(True, "--follow/--no-follow", help="--executor slurm: wait for the job and "
                                                                        "print the result (default), or return "
                                                                        "after submitting."),
    json_output: bool = typer.Option(False, "--json", help="Print the run summary as JSON."),
) -> None:
    """Qualify one stack on one plan: probe, service, rollout, update, resume, train, evaluate.

    Each stage runs the stack's adapter in its own environment and writes evidence.json; the host then
    audits the files (trained tokens == sampled tokens, masks, logprobs, resume replay, held-out and
    retention statistics). The first stage that does not pass stops the arm. Exit code 0 only if every
    gate passed, 1 if a gate failed, 2 on bad input.
    """
    with cli_errors():
        manifest = get_stack(stack)
        plan = load_plan(plan_path)
        selected = _parse_stages(stages, tuple(s for s in manifest.stages if s in RECIPE_STAGES[plan.recipe]))
        log = (lambda message: err_console.print(f"[dim]{message}[/]")) if not json_output else (lambda m: None)
        check_executor(executor, engine, cluster, dry_run, image)
        if resume and run_dir is None:
            raise UserError("--resume needs --run-dir: the run to continue")
        runner_engine = make_engine(engine, log=log, images={stack: image} if image else None) \
            if executor == "local" else None
        with err_console.status("preparing the policy"):
            frozen = resolve_policy(plan, LocalEngine(log=log))
        target = (run_dir or default_run_dir(stack, frozen)).resolve()
        if executor == "slurm":
            check_run_dir(target, frozen)
            jobs = submit_qualification(stack, frozen, target, engine, load_profile(cluster),
                                        stages=selected if stages else None, dry_run=dry_run)
            if dry_run or not follow_jobs:
                report_submitted(jobs, target, dry_run=dry_run, json_output=json_output)
                raise typer.Exit(0)
            follow_with_progress(target, quiet=json_output)
            _, evidence = load_run(target)
            data = write_report(target)
            data["run_dir"] = str(target)
        else:
            evidence, data = run_arm_with_progress(manifest, runner_engine, frozen, target, selected,
                                                   quiet=json_output, resume=resume)
    if json_output:
        print_json(data)
    else:
        console.print(gate_table(evidence, f"{stack} on {frozen.name} (plan {frozen.plan_id[:12]})"))
        for stage, split in data.get("evaluation", {}).items():
            console.print(f"{stage}: base {split['base']} -> trained {split['trained']}: [bold]{split['verdict']}[/] "
                          f"({split['test']}, p={split['p_value']:.3g})", highlight=False)
        verdict = "[green]qualified: every gate passed[/]" if data["passed"] else "[red]not qualified[/]"
        console.print(f"{verdict}\nrun directory: {target}\nreport: {target / 'report.md'} and {target / 'report.html'}",
                      highlight=False)
    raise typer.Exit(0 if data["passed"] else 1)

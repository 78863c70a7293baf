"""`runner qualify`: one stack, one frozen plan, every stage and gate, evidence in a run directory."""

from __future__ import annotations

from pathlib import Path

import typer

from runner_contracts import AnyPlan, DomainPlan

from .._console import status
from .._engines.local import LocalEngine
from .._errors import UserError
from .._executors import Submitted, make_executor
from .._plan import load_plan
from .._plan_checks import arm_problem
from .._policy import resolve_policy
from .._domain_report import native_table
from .._report import gate_table, load_run
from .._stacks import StackManifest, get_stack
from .._stages import RECIPE_STAGES, STAGES, default_run_dir
from ._common import cli_errors, console, err_console, print_json, writable_run_dir


def parse_stages(text: str | None, available: tuple[str, ...], stack: str) -> list[str]:
    """Stages to run, in order: the requested ones, or every stage the stack and the recipe have."""
    if not text:
        return [stage for stage in STAGES if stage in available]
    wanted = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise UserError(f"--stages: unknown stage(s) {', '.join(unknown)}; stages are {', '.join(STAGES)}")
    missing = [s for s in wanted if s not in available]
    if missing:
        raise UserError(f"--stages: the {stack} stack does not provide {', '.join(missing)}")
    return [stage for stage in STAGES if stage in wanted]


def domain_problem(plan: AnyPlan, manifest: StackManifest) -> str | None:
    """Why a plan and a stack do not go together across the domain line, or None."""
    if not isinstance(plan, DomainPlan):
        return (f"the {manifest.name} stack is a domain stack: it runs domain plans (name, domain, data, model, "
                f"budget, headline), e.g. stacks/{manifest.name}/plans/cpu.yaml")
    if manifest.kind != "domain":
        return (f"{plan.name} is a domain plan (domain: {plan.domain}); the {manifest.name} stack runs language-model "
                f"plans; qualify the {plan.domain} stack with it")
    if plan.domain != manifest.name.partition("@")[0]:
        return f"{plan.name} is a plan for the {plan.domain} stack, not {manifest.name}"
    return None


def report_submitted(submitted: Submitted, *, json_output: bool) -> None:
    """What a command prints when it returns with its jobs submitted (or, in a dry run, written)."""
    target, jobs, dry_run = submitted.run_dir, submitted.jobs, submitted.dry_run
    if json_output:
        print_json({"run_dir": str(target), "dry_run": dry_run,
                    "jobs": [{"name": j.name, "job_id": j.job_id, "script": j.script} for j in jobs]})
        return
    for job in jobs:
        what = "written (not submitted)" if dry_run else f"submitted as job {job.job_id}"
        console.print(f"{job.name}: {job.script} {what}", highlight=False)
    console.print(f"run directory: {target}" + ("" if dry_run else f"\nfollow it with: runner status {target}"),
                  highlight=False)


def logger(json_output: bool):
    return (lambda message: err_console.print(f"[dim]{message}[/]")) if not json_output else (lambda m: None)


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

    The plan's recipe picks the stages: grpo all but distill; sft no rollout (demonstrations, not samples);
    distill no rollout, and a distill stage where a teacher's samples are judged and the kept ones become
    the student's demonstrations (with a matched SFT baseline beside it).

    Each stage runs the stack's adapter in its own environment and writes evidence.json; the host then
    audits the files (trained tokens == sampled tokens, masks, logprobs, resume replay, held-out and
    retention statistics). The first stage that does not pass stops the arm. Exit code 0 only if every
    gate passed, 1 if a gate failed, 2 on bad input.
    """
    with cli_errors():
        manifest = get_stack(stack)
        plan = load_plan(plan_path, logger(json_output))
        if problem := domain_problem(plan, manifest) if manifest.kind == "domain" or isinstance(plan, DomainPlan) \
                else arm_problem(plan, [stack]):
            raise UserError(problem)
        if resume and run_dir is not None and not run_dir.is_dir():
            raise UserError(f"--resume: {run_dir} is not a run directory; nothing to continue")
        target = writable_run_dir(run_dir) if run_dir else None
        recipe_stages = STAGES if isinstance(plan, DomainPlan) else RECIPE_STAGES[plan.recipe]
        selected = parse_stages(stages, tuple(s for s in manifest.stages if s in recipe_stages), stack)
        if resume and run_dir is None:
            raise UserError("--resume needs --run-dir: the run to continue")
        runner = make_executor(executor, engine=engine, images={stack: image} if image else None, cluster=cluster,
                               dry_run=dry_run, follow=follow_jobs, quiet=json_output, log=logger(json_output))
        with status("preparing the policy", quiet=json_output):
            frozen = resolve_policy(plan, LocalEngine(log=logger(json_output)))
        target = target or writable_run_dir(default_run_dir(stack, frozen))
        data = runner.qualify(manifest, frozen, target, selected, all_stages=not stages, resume=resume)
        if isinstance(data, Submitted):
            report_submitted(data, json_output=json_output)
            raise typer.Exit(0)
        _, evidence = load_run(target)
    if json_output:
        print_json(data)
    else:
        console.print(gate_table(evidence, f"{stack} on {frozen.name} (plan {frozen.plan_id[:12]})"))
        if data.get("native"):
            console.print(native_table(data))
        for stage, split in data.get("evaluation", {}).items():
            detectable = split.get("detectable_difference")
            console.print(f"{stage}: base {split['base']} -> trained {split['trained']}: [bold]{split['verdict']}[/] "
                          f"({split['test']}, p={split['p_value']:.3g}"
                          + (f"; detects a difference of {detectable:.0%} or more at 80% power" if detectable else "")
                          + ")", highlight=False)
            if versus := split.get("baseline"):
                console.print(f"  distilled vs the matched SFT baseline: {versus['base']} -> {versus['trained']}: "
                              f"[bold]{versus['verdict']}[/] ({versus['test']}, p={versus['p_value']:.3g})",
                              highlight=False)
        if data.get("release"):
            release = data["release"]
            colour = "green" if release["verdict"] == "release" else "yellow"
            console.print(f"release: [{colour}]{release['verdict']}[/]" + "".join(f"\n  failed: {c}" for c in release["failed"]),
                          highlight=False)
        if data.get("native_asset"):
            console.print(f"native asset: {data['native_asset']}", highlight=False)
        verdict = "[green]qualified: every gate passed[/]" if data["passed"] else "[red]not qualified[/]"
        console.print(f"{verdict}\nrun directory: {target}\nreport: {target / 'report.md'} and {target / 'report.html'}",
                      highlight=False)
    raise typer.Exit(0 if data["passed"] else 1)

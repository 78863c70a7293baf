"""`runner plan`: is a plan sound, and what can its evaluation tell apart, before spending a run on it."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import typer

from qualification.stats import detectable_difference, items_needed

from .._errors import UserError
from .._plan import load_plan
from ._common import cli_errors, console, print_json

app = typer.Typer(help="Questions about a plan before it runs.", no_args_is_help=True)


@app.command("check")
def check(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="Plan file, e.g. qualification/plans/calc-tool-cpu.yaml."),
    json_output: bool = typer.Option(False, "--json", help="Print the plan, as validated, as JSON."),
) -> None:
    """Validate a plan the way qualify and compare do, before anything is built: its fields and types, every
    name in it (task families, splits, the reward scorer and its version, the tiny policy's recipe), the
    cross-field limits (the resume kill inside the resume run, update steps within the budget), and a
    checkpoint given by path. Exit 0 if it holds; otherwise one line naming file, line and field, exit 2."""
    with cli_errors():
        plan = load_plan(plan_path)
    if json_output:
        print_json(msgspec.to_builtins(plan))
        return
    task = plan.task
    splits = ", ".join(f"{role} {spec.family or task.family}/{spec.split} x{spec.n}"
                       for role, spec in (("train", task.train), ("heldout", task.heldout), ("retention", task.retention)))
    policy = plan.policy.path if plan.policy.kind == "path" else f"tiny {plan.policy.tiny or {}}"
    console.print(f"{plan_path}: plan {plan.name} holds: {plan.recipe} on {task.family} ({splits}); policy {policy}; "
                  f"{plan.budget.steps} steps x {plan.budget.prompts_per_step} prompts x "
                  f"{plan.budget.generations_per_prompt} generations; seeds {plan.seeds}", highlight=False)


@app.command("power")
def power(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="Plan file, e.g. "
                                                                "qualification/plans/calc-tool-cpu.yaml."),
    effect: float = typer.Option(0.1, "--effect", help="The difference in held-out success rate to detect, e.g. 0.05."),
    discordance: float = typer.Option(0.25, "--discordance", help="Share of items on which base and trained (or two "
                                                                   "arms) differ; a finished run's evaluate stage shows it."),
    power_: float = typer.Option(0.8, "--power", help="Probability of detecting the effect when it is there."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """How many held-out items (times seeds, which pool) a paired exact McNemar test at the plan's confidence
    needs to detect --effect, and what the plan's own held-out split can detect."""
    with cli_errors():
        plan = load_plan(plan_path)
        confidence = plan.gates.confidence
        try:
            needed = items_needed(effect, discordance, confidence, power_)
        except ValueError as error:
            raise UserError(str(error)) from None
        n = plan.task.heldout.n * len(plan.seeds)
        detectable = detectable_difference(n, round(discordance * n), confidence, power_)
    seeds = math.ceil(needed / plan.task.heldout.n)
    data = {"plan": plan.name, "confidence": confidence, "power": power_, "effect": effect, "discordance": discordance,
            "items_needed": needed, "seeds_needed_at_plan_n": seeds, "plan_items": n,
            "plan_detectable_difference": detectable}
    if json_output:
        print_json(data)
        return
    console.print(f"{plan.name}: to detect a {effect:.0%} difference in held-out success at {confidence:.0%} "
                  f"confidence with {power_:.0%} power, when {discordance:.0%} of items differ, a paired test needs "
                  f"{needed} items (the plan's {plan.task.heldout.n} held-out items x {seeds} seeds). The plan as "
                  f"written ({plan.task.heldout.n} items x {len(plan.seeds)} seed(s)) detects {detectable:.0%} or more.",
                  highlight=False)

"""What a plan must satisfy beyond its record types, checked before anything is built: every name resolves
(families, splits, the scorer and its version, the tiny policy's recipe), cross-field limits hold, and a
checkpoint given by path can be served and trained. Each problem is (field path, message)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec

from qualification.tasks import FamilyError, get_family
from runner_contracts import TINY_TOOL_FORMATS, Plan, PolicySpec, TinyRecipe

from ._errors import UserError
from ._files import explain
from ._policy import checkpoint_problems
from ._stacks import all_stacks, get_stack


def plan_problems(plan: Plan) -> Iterator[tuple[str, str]]:
    yield from _task_problems(plan)
    yield from _native_problems(plan)
    yield from _policy_problems(plan.policy, "policy", frozen=plan.plan_id is not None)
    yield from _distill_problems(plan)
    yield from _harness_problems(plan)
    gates, budget = plan.gates, plan.budget
    if gates.resume_kill_after_step >= gates.resume_steps:
        yield ("gates.resume_kill_after_step", f"{gates.resume_kill_after_step} is not inside the resume run of "
               f"gates.resume_steps={gates.resume_steps} steps; the kill comes after a step before the last")
    for field in ("update_steps", "resume_steps"):
        if getattr(gates, field) > budget.steps:
            yield (f"gates.{field}", f"{getattr(gates, field)} steps do not fit the budget of "
                   f"budget.steps={budget.steps}")
    if plan.task.train.n < budget.prompts_per_step:
        yield ("task.train.n", f"{plan.task.train.n} training items cannot fill one step of "
               f"budget.prompts_per_step={budget.prompts_per_step} prompts")
    if plan.release and plan.release.min_pass_hat_k is not None and plan.evaluation is None:
        yield "release.min_pass_hat_k", "needs sampled attempts: add evaluation: {attempts: K} to the plan"
    if not plan.seeds:
        yield "seeds", "name at least one seed"
    elif len(set(plan.seeds)) != len(plan.seeds):
        yield "seeds", f"{plan.seeds} repeats a seed; repeated seeds must differ"


def _task_problems(plan: Plan) -> Iterator[tuple[str, str]]:
    task = plan.task
    try:
        family = get_family(task.family)
    except FamilyError as error:
        yield "task.family", str(error)
        return
    if (plan.reward.scorer, plan.reward.version) != (family.name, family.scorer_version):
        field = "reward.scorer" if plan.reward.scorer != family.name else "reward.version"
        yield (field, f"{plan.reward.scorer} v{plan.reward.version} is not the reference scorer of task family "
               f"{family.name} ({family.name} v{family.scorer_version})")
    for role in ("train", "heldout", "retention"):
        spec = getattr(task, role)
        try:
            split_family = get_family(spec.family or task.family)
        except FamilyError as error:
            yield f"task.{role}.family", str(error)
            continue
        try:
            offered = split_family.frozen_splits  # a native task reads its dataset here
        except FamilyError as error:
            yield ("task.native.dataset" if task.native is not None else f"task.{role}.family"), str(error)
            return
        if spec.split not in offered:
            yield (f"task.{role}.split", f"task family {split_family.name} has no split {spec.split!r}; it offers "
                   f"{', '.join(sorted(split_family.frozen_splits))}")
            continue
        try:
            split_family.generate(spec.split, spec.n, spec.seed)
        except Exception as error:  # a family's own generator: whatever it raises is the plan's problem
            yield (f"task.{role}.n", f"task family {split_family.name} cannot give {spec.n} items of split "
                   f"{spec.split!r} with seed {spec.seed}: {error}")


NATIVE_CAPABILITY = "native-assets"


def _native_problems(plan: Plan) -> Iterator[tuple[str, str]]:
    native = plan.task.native
    if native is None:
        return
    try:
        manifest = get_stack(native.stack)
    except UserError as error:
        yield "task.native.stack", str(error)
        return
    if NATIVE_CAPABILITY not in manifest.capabilities:
        able = sorted(name for name, stack in all_stacks().items() if NATIVE_CAPABILITY in stack.capabilities)
        yield ("task.native.stack", f"the {native.stack} stack does not run a team's native asset; "
               f"stacks that do: {', '.join(able)}")
    if (plan.task.retention.family or plan.task.family) == plan.task.family:
        yield ("task.retention.family", f"a native task has no retention split: name a retention probe of its "
               "own (retention: {family: german-arith, split: retention, ...})")
    try:
        get_family(plan.task.family).service_cases()
    except FamilyError as error:
        yield "task.native.cases", str(error)
    recipe = plan.policy.tiny or {}
    if plan.task.family in (recipe.get("families") or ()):
        yield ("policy.tiny.families", f"{plan.task.family} is a native asset's task, which has no "
               "demonstrations to warm-start on")


def arm_problem(plan: Plan, stacks: list[str]) -> str | None:
    """Why a plan cannot run these arms: a harness stack is no arm, a native asset runs only in its own stack,
    and distillation only in stacks that can sample a teacher."""
    harnesses = [name for name in stacks if get_stack(name.split("@", 1)[0]).kind == "harness"]
    if harnesses:
        return (f"{', '.join(harnesses)}: an evaluation harness, not an arm; name it in the plan's harnesses "
                f"(harnesses: [{{stack: {harnesses[0]}, task: path/to/task.py}}]) and qualify a trainer or "
                "environment stack")
    native = plan.task.native
    others = [name for name in stacks if native is not None and name.split("@", 1)[0] != native.stack]
    if others:
        return (f"the plan runs a native {native.stack} asset ({native.env}), which only the {native.stack} arm "
                f"can run; {', '.join(others)} cannot (arms are comparable only on the same asset)")
    unable = [name for name in stacks if plan.recipe == "distill"
              and "distill" not in get_stack(name.split("@", 1)[0]).capabilities]
    if unable:
        able = sorted(name for name, stack in all_stacks().items() if "distill" in stack.capabilities)
        return (f"recipe distill needs a stack that samples the teacher and fine-tunes the student ({', '.join(able)}); "
                f"{', '.join(unable)} cannot")
    return None


def _distill_problems(plan: Plan) -> Iterator[tuple[str, str]]:
    if plan.recipe == "distill" and plan.distill is None:
        yield "distill", "recipe distill needs a distill block: {teacher: {kind: tiny|path, ...}, samples_per_item: K}"
    elif plan.recipe != "distill" and plan.distill is not None:
        yield "distill", f"given with recipe {plan.recipe!r}; it is read only by recipe: distill"
    elif plan.distill is not None:
        yield from _policy_problems(plan.distill.teacher, "distill.teacher", frozen=plan.plan_id is not None)


def _policy_problems(spec: PolicySpec, where: str, *, frozen: bool) -> Iterator[tuple[str, str]]:
    """What is wrong with a policy (the plan's, or a distillation teacher) before anything is built."""
    if spec.kind == "path":
        if not spec.path:
            yield f"{where}.path", f"required when {where}.kind is 'path'"
        elif problems := checkpoint_problems(Path(spec.path), spec.tool_format):
            yield f"{where}.path", "the checkpoint cannot be used: " + "; ".join(problems)
        return  # a tiny recipe left beside kind: path is not used
    for field in ("path", "sha256"):
        if getattr(spec, field) is not None and not frozen:  # a frozen plan (plan.json) names its build
            yield f"{where}.{field}", f"given with {where}.kind 'tiny', which builds its own weights; use kind: path"
    try:
        recipe = msgspec.convert(spec.tiny or {}, TinyRecipe)
    except msgspec.ValidationError as error:
        field, message = explain(error, TinyRecipe)
        yield f"{where}.tiny.{field}" if field else f"{where}.tiny", message
        return
    if spec.tool_format != TINY_TOOL_FORMATS[recipe.model_family]:
        yield (f"{where}.tool_format", f"{spec.tool_format!r}, but the tiny {recipe.model_family} policy writes "
               f"{TINY_TOOL_FORMATS[recipe.model_family]} tool calls: set tool_format: "
               f"{TINY_TOOL_FORMATS[recipe.model_family]} (or policy.tiny.model_family to the one that writes "
               f"{spec.tool_format})")
    for index, name in enumerate(recipe.families):
        try:
            get_family(name)
        except FamilyError as error:
            yield f"{where}.tiny.families[{index}]", str(error)


def _harness_problems(plan: Plan) -> Iterator[tuple[str, str]]:
    stacks = all_stacks()
    harnesses = sorted(name for name, manifest in stacks.items() if manifest.kind == "harness")
    for index, harness in enumerate(plan.harnesses):
        where = f"harnesses[{index}]"
        manifest = stacks.get(harness.stack)
        if manifest is None or manifest.kind != "harness":
            yield (f"{where}.stack", f"{harness.stack!r} is not an evaluation harness stack; harness stacks: "
                   f"{', '.join(harnesses) or '(none)'}")
        elif not Path(harness.task).is_file():
            yield f"{where}.task", f"{harness.task} does not exist (a task file, relative to the plan file)"

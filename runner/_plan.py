"""Plans: YAML in, a validated Plan record out, with errors located by file, line and field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec

from runner_contracts import AnyPlan, DomainPlan, Plan

from . import _task_packages as task_packages
from ._engines.jobs import tree_hash
from ._errors import UserError
from ._files import convert_yaml, parse_yaml, yaml_line
from ._plan_checks import plan_problems
from ._stacks import all_stacks


def load_plan(path: Path, log: Callable[[str], None] = lambda message: None) -> AnyPlan:
    """Reads and validates a plan file (YAML or JSON): its types, then, with its task packages built and
    active in this process, every name and cross-field limit in it (runner._plan_checks). A plan with a
    `domain` field is a domain stack's (runner_contracts.domain)."""
    data, root = parse_yaml(path, "plan", "a plan is a mapping with name, task, policy, reward, sampling, budget "
                                          "(a domain stack's: name, domain, data, model, budget, headline)")
    if "domain" in data:
        return _domain_plan(path, data, root)
    task = data.get("task")
    if isinstance(task, dict) and isinstance(task.get("packages"), list):  # a bare path is {path: ...}
        task["packages"] = [{"path": p} if isinstance(p, str) else p for p in task["packages"]]
    policy = data.get("policy")
    if isinstance(policy, dict) and isinstance(policy.get("path"), str):  # relative to the plan file
        policy["path"] = str((path.parent / Path(policy["path"]).expanduser()).resolve())
    for harness in data.get("harnesses") or []:  # a harness's task file, relative to the plan file
        if isinstance(harness, dict) and isinstance(harness.get("task"), str):
            harness["task"] = str((path.parent / Path(harness["task"]).expanduser()).resolve())
    plan = convert_yaml(data, root, Plan, path, "(plan)")
    plan = task_packages.resolve(plan, path)
    plan = _hash_harness_tasks(plan)
    task_packages.activate(plan, log)
    if problem := next(plan_problems(plan), None):
        field, reason = problem
        raise UserError(f"{path}:{yaml_line(root, field)}: field {field}: {reason}")
    return plan


def _domain_plan(path: Path, data: dict, root) -> DomainPlan:
    plan = convert_yaml(data, root, DomainPlan, path, "(plan)")
    manifest = all_stacks().get(plan.domain)
    if manifest is None or manifest.kind != "domain":
        known = sorted(name for name, m in all_stacks().items() if m.kind == "domain")
        raise UserError(f"{path}:{yaml_line(root, 'domain')}: field domain: {plan.domain!r} is not a domain stack; "
                        f"domain stacks: {', '.join(known)}")
    if plan.gates.resume_kill_after_step >= plan.gates.resume_steps:
        raise UserError(f"{path}:{yaml_line(root, 'gates.resume_kill_after_step')}: field gates.resume_kill_after_step: "
                        f"must be below gates.resume_steps ({plan.gates.resume_steps}) so that a step is left to resume")
    return plan


def _hash_harness_tasks(plan: Plan) -> Plan:
    """Each harness task's folder hashed into the plan (a task file that is missing is the checks' to name)."""
    harnesses = [msgspec.structs.replace(h, sha256=tree_hash([Path(h.task).parent])) if Path(h.task).is_file() else h
                 for h in plan.harnesses]
    return msgspec.structs.replace(plan, harnesses=harnesses) if harnesses else plan

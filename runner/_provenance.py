"""Provenance written into every evidence file: the runner's git commit (and whether its tree had
uncommitted changes), the command line, the host's Python and our packages' versions, the plan's task
families with their source and scorer version, and the sha256 of the policy's chat template."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import platform
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from qualification.tasks import FamilyError, get_family, source_of
from runner_contracts import AnyPlan, DomainPlan, Provenance

from ._paths import PROJECT_ROOT

HOST_PACKAGES = ("runner", "runner-contracts", "runner-qualification", "msgspec", "typer", "pyyaml", "docker",
                 "spython")


@functools.cache  # once per process: a comparison's arms share the checkout
def _git_source() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the runner's checkout; (None, None) outside a git checkout."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True, check=False)

    try:
        commit = git("rev-parse", "HEAD")
    except OSError:
        return None, None
    if commit.returncode != 0:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None


def provenance_in_background(plan: AnyPlan) -> Future[Provenance]:
    """provenance(plan) on a thread of its own: an arm starts it first thing, so its ~40 ms (git, each host
    package's version read from its metadata) run while the first stage's job does."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="provenance")
    try:
        return pool.submit(provenance, plan)
    finally:
        pool.shutdown(wait=False)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def chat_template_sha256(policy_dir: Path) -> str | None:
    """sha256 of the chat template the policy's tokenizer applies (chat_template.jinja, else the
    tokenizer_config.json field), None if it has none."""
    jinja = policy_dir / "chat_template.jinja"
    if jinja.is_file():
        return hashlib.sha256(jinja.read_bytes()).hexdigest()
    config = policy_dir / "tokenizer_config.json"
    try:
        template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None
    return hashlib.sha256(json.dumps(template).encode()).hexdigest() if template else None


def _family_line(name: str) -> str:
    try:
        return f"{source_of(name).describe()}, scorer v{get_family(name).scorer_version}"
    except FamilyError as error:
        return f"not found: {error}"


def provenance(plan: AnyPlan) -> Provenance:
    commit, dirty = _git_source()
    if isinstance(plan, DomainPlan):  # no task families, no chat template: the data is the stack's own recipe
        return Provenance(runner_version=_version("runner") or "unknown", git_commit=commit, git_dirty=dirty,
                          command=list(sys.argv), python=platform.python_version(),
                          platform=f"{platform.system()} {platform.machine()}",
                          host_packages={name: version for name in HOST_PACKAGES if (version := _version(name))})
    families = {plan.task.family} | {spec.family for spec in (plan.task.train, plan.task.heldout, plan.task.retention)
                                     if spec.family}
    return Provenance(
        runner_version=_version("runner") or "unknown", git_commit=commit, git_dirty=dirty, command=list(sys.argv),
        python=platform.python_version(), platform=f"{platform.system()} {platform.machine()}",
        host_packages={name: version for name in HOST_PACKAGES if (version := _version(name))},
        task_families={name: _family_line(name) for name in sorted(families)},
        chat_template_sha256=chat_template_sha256(Path(plan.policy.path)) if plan.policy.path else None)

"""Policies: the tiny CPU policy (built inside the trl stack's environment, cached by content) or a
checkpoint directory given by path. The host only hashes files; it never loads weights."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from qualification.tasks import sources
from runner_contracts import (TOOL_CALL_MARKERS, AnyPlan, DomainPlan, Plan, PolicySpec, StageRequest, canonical_json,
                              freeze_plan)

from ._engines.jobs import file_lock, last_error_lines, tree_hash
from ._engines.local import LocalEngine
from ._errors import EngineError, UserError
from ._file_hashes import cached_sha256
from ._paths import cache_dir, local_packages
from ._stacks import StackManifest, all_stacks

WEIGHTS = "model.safetensors"
BUILD_TIMEOUT_S = 3600


def policy_builder() -> StackManifest:
    for manifest in all_stacks().values():
        if "build-policy" in manifest.capabilities:
            return manifest
    raise UserError("no stack declares the build-policy capability (the trl stack does)")


def _recipe_key(recipe: dict[str, Any], manifest: StackManifest, plan: Plan) -> str:
    digest = hashlib.sha256(canonical_json(recipe))
    digest.update(manifest.lock_sha256.encode())
    # The bytes depend on the builder's code and the task generators, not on contracts, gates or stages.
    tasks = local_packages()["runner-qualification"] / "src" / "qualification" / "tasks"
    digest.update(tree_hash([*manifest.policy_sources, tasks]).encode())
    ours = {name for name, source in sources().items() if source.distribution == "runner-qualification"}
    if set(recipe.get("families") or ()) - ours:  # warm-started on a task package's demonstrations
        for package in plan.task.packages:
            digest.update((package.sha256 or "").encode())
    return digest.hexdigest()[:16]


def build_tiny(engine: LocalEngine, recipe: dict[str, Any], plan: Plan, *, rebuild: bool = False) -> Path:
    """The cached tiny policy for `recipe`, building it first if needed (or always, with rebuild).
    Same recipe, same bytes."""
    manifest = policy_builder()
    key = _recipe_key(recipe, manifest, plan)
    final = cache_dir() / "policies" / f"tiny-{key}"
    if (final / WEIGHTS).is_file() and not rebuild:
        return _readable(final)
    with file_lock(final.with_name(final.name + ".lock")):  # a second runner waits for this build, then uses it
        if (final / WEIGHTS).is_file() and not rebuild:
            return _readable(final)
        return _build_tiny(engine, manifest, recipe, plan, key, final)


def _build_tiny(engine: LocalEngine, manifest: StackManifest, recipe: dict[str, Any], plan: Plan, key: str,
                final: Path) -> Path:
    """Builds into a scratch folder and renames it into place: `final` exists only complete."""
    env = engine.prepare(manifest)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tiny-{key}-", dir=final.parent))
    try:
        request = StageRequest(run_id=f"policy-{key}", stack=manifest.name, stage="build-policy", plan=plan,
                               out_dir=str(work), options={"recipe": recipe})
        outcome = engine.run(env, request, timeout_s=BUILD_TIMEOUT_S)
        if not outcome.ok or not (work / "policy" / WEIGHTS).is_file():
            raise EngineError(f"building the tiny policy failed; logs in {work}\n{last_error_lines(outcome.stderr)}")
        shutil.copy(work / "stderr.log", work / "policy" / "build.log")
        shutil.rmtree(final, ignore_errors=True)
        (work / "policy").rename(final)
    except BaseException:
        if (final / WEIGHTS).is_file():
            shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    return _readable(final)


def _readable(folder: Path) -> Path:
    """World-readable files: container engines read the policy as a non-root user (safetensors writes 0600)."""
    for path in folder.iterdir():
        if path.is_file() and not path.stat().st_mode & 0o004:
            path.chmod(path.stat().st_mode | 0o044)
    return folder


def resolve_policy(plan: AnyPlan, engine: LocalEngine) -> AnyPlan:
    """The plan with policy.path and policy.sha256 filled in (and a distillation teacher's), plan_id set: the
    frozen plan. A domain plan has no policy: its model is the stack's own."""
    if isinstance(plan, DomainPlan):
        return freeze_plan(msgspec.structs.replace(plan, plan_id=None))
    plan = msgspec.structs.replace(plan, policy=_resolved(plan.policy, "policy", plan, engine))
    if plan.distill is not None:
        teacher = _resolved(plan.distill.teacher, "distill.teacher", plan, engine)
        plan = msgspec.structs.replace(plan, distill=msgspec.structs.replace(plan.distill, teacher=teacher))
    return freeze_plan(msgspec.structs.replace(plan, plan_id=None))


def _resolved(spec: PolicySpec, where: str, plan: Plan, engine: LocalEngine) -> PolicySpec:
    if spec.kind == "tiny":
        path = build_tiny(engine, dict(spec.tiny or {}), plan)
    else:
        if not spec.path:
            raise UserError(f"plan field {where}.path: required when {where}.kind is 'path'")
        path = Path(spec.path).expanduser().resolve()
        problems = checkpoint_problems(path, spec.tool_format)
        if problems:
            raise UserError(f"plan field {where}.path: the checkpoint cannot be used:\n  " + "\n  ".join(problems))
    digest = cached_sha256(path / WEIGHTS)
    if spec.kind == "path" and spec.sha256 and spec.sha256 != digest:
        raise UserError(f"plan field {where}.sha256: {path / WEIGHTS} has sha256 {digest}, the plan pins {spec.sha256}")
    return msgspec.structs.replace(spec, path=str(path), sha256=digest, revision=spec.revision or digest[:12])


def checkpoint_problems(path: Path, tool_format: str = "hermes") -> list[str]:
    """What keeps a checkpoint folder from being served and trained by every arm, one line per problem,
    each naming the file: the config, the weights, a tokenizer, a chat template, and a template that
    renders tool calls the way the plan's policy.tool_format says the checkpoint writes them."""
    if not path.is_dir():
        return [f"{path}: no such folder"]
    problems = []
    try:
        config = json.loads((path / "config.json").read_text())
        if "vocab_size" not in config:
            problems.append(f"{path / 'config.json'}: no vocab_size")
    except FileNotFoundError:
        problems.append(f"{path / 'config.json'}: missing")
    except json.JSONDecodeError as error:
        problems.append(f"{path / 'config.json'}: not valid JSON ({error.msg}, line {error.lineno})")
    if not (path / WEIGHTS).is_file():
        sharded = " (sharded weights are not supported yet)" if (path / f"{WEIGHTS}.index.json").is_file() else ""
        problems.append(f"{path / WEIGHTS}: missing{sharded}")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        problems.append(f"{path / 'tokenizer.json'}: missing (nor a tokenizer.model)")
    template = None
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    else:
        try:
            template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
        except (FileNotFoundError, json.JSONDecodeError):
            template = None
        if isinstance(template, list):  # named templates: the default one is what chat requests use
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not template:
        problems.append(f"{path / 'tokenizer_config.json'}: no chat_template (nor a chat_template.jinja)")
    elif TOOL_CALL_MARKERS[tool_format] not in template:
        found = [name for name, marker in TOOL_CALL_MARKERS.items() if marker in template]
        problems.append(f"{path}: the chat template does not render {tool_format} tool calls (no "
                        f"{TOOL_CALL_MARKERS[tool_format]} in it)" + (f"; it looks like {' or '.join(found)}: set "
                        "policy.tool_format" if found else ""))
    return problems


def vocab_size(policy_dir: Path) -> int:
    config = json.loads((policy_dir / "config.json").read_text())
    return int(config["vocab_size"])


def default_plan_for_policy() -> Plan:
    """A minimal plan for building a policy outside a qualification (the adapter needs one)."""
    from runner_contracts import BudgetSpec, RewardSpec, SamplingSpec, SplitSpec, TaskSpec

    split = SplitSpec(split="train", n=1, seed=0)
    return Plan(name="policy-build", task=TaskSpec(family="calc-tool", train=split, heldout=split, retention=split),
                policy=PolicySpec(kind="tiny"), reward=RewardSpec(scorer="calc-tool", version=1),
                sampling=SamplingSpec(), budget=BudgetSpec(steps=1, prompts_per_step=1, generations_per_prompt=2))

"""The probe stage: the stack's environment reports itself (Python, packages, capabilities, what a job can
reach); the host checks it against the stack's manifest, lock and pin record. An environment arm probes
its trainer's environment too, a GPU plan the stack's GPU environment."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from qualification.gates import lock_gate
from runner_contracts import AnyPlan, DomainPlan, EnvironmentInfo, GateResult, StageResult

from .._engines.jobs import StackEnvironment
from .._engines.local import LocalEngine
from .._pins import check_pins, upstream_revision
from .._stacks import StackManifest, all_stacks, normalise
from .._task_packages import task_dependencies
from .arm import Arm, StageOutput, run_adapter


def _probe(arm: Arm, manifest: StackManifest, env: StackEnvironment, out: Path, *, in_stack_env: bool,
           prefix: str = "probe", on_gpu: bool = False) -> tuple[EnvironmentInfo, StageResult, list[GateResult]]:
    _, result = run_adapter(arm, "probe", out, in_stack_env=in_stack_env, on_gpu=on_gpu)
    assert result is not None
    environment, gates = environment_gates(arm, manifest, env, result, prefix)
    return environment, result, gates


def environment_gates(arm: Arm, manifest: StackManifest, env: StackEnvironment, result: StageResult,
                      prefix: str) -> tuple[EnvironmentInfo, list[GateResult]]:
    """What a probe job reported about `env`, completed by the host, and the gates on it: the lock, Python,
    upstream and capabilities as the manifest says, the pins, and no other stack's upstream installed."""
    assert result.environment is not None
    reported = result.environment
    installed = {normalise(name): version for name, version in reported.packages.items()}
    environment = msgspec.structs.replace(
        reported, engine=arm.engine.name, image=env.image, image_digest=env.image_digest,
        lock_sha256=env.lock_sha256, packages=installed,
        deviations=[*manifest.deviations, *reported.deviations],  # declared, then measured in the environment
        upstream=reported.upstream and msgspec.structs.replace(
            reported.upstream, git_revision=upstream_revision(manifest)[0]))
    missing_caps = sorted(set(manifest.capabilities) - set(result.capabilities) - {"build-policy"})
    upstream_version = installed.get(normalise(manifest.upstream.name))
    foreign = {normalise(m.upstream.name) for m in all_stacks().values()
               if m.name != manifest.name.partition("@")[0]  # a pin set (trl@1.15.0) is its stack's
               and not normalise(m.upstream.name).startswith("runner-")}
    untrained = manifest.kind != "trainer" and "torch" not in manifest.locked_packages()
    if untrained:
        foreign.add("torch")  # an environment or harness stack that does not pin torch must not have one
    leaked = sorted(name for name in installed if name in foreign)
    task_packages = _task_packages(arm.plan)
    gates = [
        msgspec.structs.replace(lock_gate(installed, manifest.locked_packages(), task_packages),
                                name=f"{prefix}:lock-match"),
        GateResult(name=f"{prefix}:python", passed=reported.python.startswith(manifest.python + "."),
                   measured=reported.python, threshold=manifest.python),
        GateResult(name=f"{prefix}:upstream", passed=upstream_version == manifest.upstream.version,
                   measured=upstream_version, threshold=manifest.upstream.version,
                   detail=f"{manifest.upstream.name} as pinned in stack.toml"),
        GateResult(name=f"{prefix}:capabilities", passed=not missing_caps, measured=result.capabilities,
                   threshold=list(manifest.capabilities),
                   detail=(f"missing: {missing_caps}" + "".join(
                       f"; {cap}: {why}" for cap, why in ((result.metrics or {}).get("missing_apis") or {}).items())
                       if missing_caps else "adapter reports every declared capability")),
        GateResult(name=f"{prefix}:no-foreign-packages", passed=not leaked, measured=leaked, threshold=[],
                   detail=(f"found {', '.join(leaked)}" if leaked else
                           f"no other stack's upstream{' and no torch' if untrained else ''} installed")),
    ]
    # Everything above but the pins gate rests on what the job reported from inside its environment.
    gates = [msgspec.structs.replace(gate, reported_by="adapter") for gate in gates]
    gates.insert(4, _pins_gate(manifest, env, prefix))
    return environment, gates


def _task_packages(plan: AnyPlan) -> tuple[str, ...]:
    """Distributions the plan installs into jobs beside the lock: task packages, their dependencies, a native
    asset (a domain plan installs none)."""
    if isinstance(plan, DomainPlan):
        return ()
    native = plan.task.native
    return (*(normalise(p.name or "") for p in plan.task.packages), *task_dependencies(plan),
            *([normalise(native.name or "")] if native is not None else []))


def _pins_gate(manifest: StackManifest, env: StackEnvironment, prefix: str) -> GateResult:
    """The environment was built from the stack's current lock, and the pin record agrees with it."""
    drift = check_pins(manifest)
    if env.lock_sha256 != manifest.lock_sha256:
        drift.insert(0, f"{env.image or env.path} was built from lock {env.lock_sha256[:12]}, the stack's lock is "
                        f"{manifest.lock_sha256[:12]}")
    return GateResult(name=f"{prefix}:pins", passed=not drift, measured=len(drift), threshold=0,
                      detail="; ".join(drift) if drift else
                      f"built from the pinned lock {manifest.lock_sha256[:12]}"
                      + (f"; image {env.image} ({env.image_digest})" if env.image else ""))


def stage_probe(arm: Arm) -> StageOutput:
    out = arm.stage_dir("probe")
    if arm.service_env is None:
        arm.environment, result, gates = _probe(arm, arm.manifest, arm.env, out, in_stack_env=False)
        output = StageOutput(metrics={"python": arm.environment.python, "capabilities": result.capabilities,
                                      **result.metrics}, gates=gates)
    else:
        # Both environments are probed while the rollout service starts (it is the slowest of the three and
        # the trainer's probe does not use it). The service is started here, on the arm's own thread: a job
        # ends with the thread that started it.
        def probe_both():
            return (_probe(arm, arm.manifest, arm.service_env, out, in_stack_env=True),
                    _probe(arm, arm.env.manifest, arm.env, out / "trainer", in_stack_env=False, prefix="trainer"))

        with ThreadPoolExecutor(1, thread_name_prefix="probe") as pool:
            probes = pool.submit(probe_both)
            try:
                arm.rollout_service_url()
            finally:
                (arm.environment, result, gates), (trainer_env, trainer_result, trainer_gates) = probes.result()
        output = StageOutput(gates=gates + trainer_gates, metrics={
            "python": arm.environment.python, "capabilities": result.capabilities, **result.metrics,
            "trainer": _probed(arm.env.manifest.name, trainer_env, trainer_result)})
    if arm.gpu_env is not None:
        gpu_env, gpu_result, gpu_gates = _probe(arm, arm.gpu_env.manifest, arm.gpu_env, out / "gpu",
                                                in_stack_env=True, prefix="gpu", on_gpu=True)
        output.gates += gpu_gates
        output.metrics["gpu_environment"] = _probed(arm.manifest.name, gpu_env, gpu_result)
    if isinstance(arm.engine, LocalEngine):  # a container engine's isolation is its container
        output.metrics["sandbox"] = arm.engine.sandbox.describe()  # "none (...)" is the warning
    # The environment, its packages and what a job could reach are measured inside the job.
    output.metrics["reported_by_adapter"] = sorted({"environment", *result.metrics} - {"sandbox"})
    return output


def _probed(stack: str, environment: EnvironmentInfo, result: StageResult) -> dict[str, Any]:
    return {"stack": stack, "python": environment.python, "upstream": msgspec.to_builtins(environment.upstream),
            "lock_sha256": environment.lock_sha256, **result.metrics}


"""The rollout stage: one batch of episodes, audited like a training batch; for an environment arm a
second batch in which the host SIGKILLs the environment's processes halfway through (recovery)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec

from qualification.gates import call_gates
from runner_contracts import ENVIRONMENT_FILE, PARTIAL_SUFFIX, GateResult, PolicyCall, Trajectory, write_atomic

from .arm import Arm, StageOutput, now, read_any, run_adapter
from .audits import audit_trace, sampling_audit, throughput

FAULT_FILE = "fault.json"  # the host's own record of the crash it caused
RELEASE_FILE = "fault-release"  # created once the crash is done: the policy server's held calls go on


def stage_rollout(arm: Arm) -> StageOutput:
    out = arm.stage_dir("rollout")
    _, result = run_adapter(arm, "rollout", out)
    gates, metrics = audit_trace(arm, out, signal=True, revisions={})
    call_checks, call_metrics = sampling_audit(arm, "rollout", out, result)
    gates += call_checks
    metrics.update(call_metrics)
    metrics.update(throughput(arm, result, metrics))
    if arm.service_env is not None:
        recovery_gates, metrics["recovery"] = _injected_crash(arm, out / "injected-crash")
        gates += recovery_gates
    else:
        metrics["recovery"] = {"applicable": False, "detail": "environment runs in the trainer's process"}
    return StageOutput(metrics=metrics, gates=gates)


class EnvironmentCrash:
    """The host's fault: once `after` episodes have called the policy server (the trainer's call log, read
    as it grows), it reads which processes the rollout service names as its environment (its
    environment.json) and SIGKILLs them by pid, through the engine, which kills only processes of that
    service. Polled as the job's kill_when. The trainer's policy server holds the calls of every later episode
    until the crash is done (`hold_options`), so the crash lands mid-batch however fast the batch samples."""

    def __init__(self, arm: Arm, job_dir: Path, after: int):
        self.arm, self.after = arm, after
        self.release = job_dir / RELEASE_FILE
        self.calls = job_dir / ("calls.jsonl" + PARTIAL_SUFFIX)
        self.episodes: set[str] = set()
        self.offset = 0
        self.record: dict[str, Any] | None = None

    def hold_options(self) -> dict[str, Any]:
        return {"hold_calls": {"after_episodes": self.after, "release_file": str(self.release.resolve())}}

    def poll(self) -> bool:
        """Never asks the engine to kill the job."""
        if self.record is None:
            self._read_new_calls()
            if len(self.episodes) >= self.after:
                self.inject()
        return False

    def _read_new_calls(self) -> None:
        try:
            with open(self.calls, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except OSError:
            return
        whole = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(whole)
        for line in whole.splitlines():
            episode = msgspec.json.decode(line).get("episode_id") if line.strip() else None
            if episode:
                self.episodes.add(episode)

    def inject(self) -> None:
        record: dict[str, Any] = {"at": now(), "after_episodes_called_policy": len(self.episodes)}
        try:
            record["environment_pids"] = environment_pids(self.arm)
            record["killed"] = self.arm.service.kill_processes(record["environment_pids"])
        except Exception as error:  # noqa: BLE001 - a fault that could not be injected is evidence
            record.update(killed=[], error=f"{type(error).__name__}: {error}")
        self.record = record
        self.release.touch()


def environment_pids(arm: Arm) -> list[int]:
    """What the rollout service says its environment's processes are (ENVIRONMENT_FILE in its folder)."""
    assert arm.service is not None
    record = msgspec.json.decode((arm.service.out_dir / ENVIRONMENT_FILE).read_bytes())
    return [int(pid) for pid in record["pids"]]


def _injected_crash(arm: Arm, out: Path) -> tuple[list[GateResult], dict[str, Any]]:
    """A second rollout batch in which the host SIGKILLs the environment halfway through: the environment
    comes back under new processes, and every episode comes back, retried or marked failed; none is lost.
    Every figure comes from the host's own record and the job's files, none from the adapter's result."""
    requested = arm.plan.budget.prompts_per_step * arm.plan.budget.generations_per_prompt
    arm.on_event("rollout", "injected environment crash")
    arm.rollout_service_url()  # started before the job, so the host holds the service it will crash
    crash = EnvironmentCrash(arm, out, after=requested // 2)
    _, result = run_adapter(arm, "rollout", out, kill_when=crash.poll, options=crash.hold_options())
    fault = crash.record or {"killed": [], "error": f"the job ended before {requested // 2} episodes called the "
                                                     f"policy server"}
    try:
        time.sleep(0.3)  # the service rewrites its environment.json within 0.1 s of a change
        fault["environment_pids_after"] = environment_pids(arm)
    except Exception as error:  # noqa: BLE001
        fault["environment_pids_after"], fault["after_error"] = [], f"{type(error).__name__}: {error}"
    write_atomic(out / FAULT_FILE, msgspec.json.encode(fault))
    trajectories = read_any(out, "trajectories.jsonl", Trajectory)
    _, accounting = call_gates(read_any(out, "calls.jsonl", PolicyCall), trajectories)
    returned = {t.episode_id for t in trajectories}
    killed, after = fault["killed"], fault["environment_pids_after"]
    figures = {"requested": requested, "returned": len(returned), "lost": requested - len(returned),
               "killed_pids": killed, "environment_pids_after": after,
               "retried_episodes": accounting["retried_episodes"], "failed_episodes": accounting["failed_episodes"],
               "call_hold": result.metrics.get("call_hold") if result else None}
    reported = fault.get("environment_pids", [])
    foreign = sorted(set(reported) - set(killed))
    hit = figures["retried_episodes"] + figures["failed_episodes"]
    restarted = bool(killed) and bool(after) and not set(after) & set(killed) and hit > 0
    gates = [
        GateResult(name="recovery:fault-injected", passed=bool(killed) and not foreign, measured=len(killed),
                   threshold=f"{len(reported)} (every process the service named)",
                   detail=(f"the host SIGKILLed the environment's processes {killed} after "
                           f"{fault.get('after_episodes_called_policy')} of {requested} episodes had called the policy"
                           if killed and not foreign else fault.get("error") or
                           f"the service named {reported or 'no process'} as its environment; "
                           f"{foreign or 'none'} of them not its own running processes")),
        GateResult(name="recovery:environment-restarted", passed=restarted, measured=hit, threshold=">= 1 episode hit",
                   detail=(f"{hit} episode(s) met the dead environment; it runs again under new processes {after}"
                           if restarted else "no episode met a dead environment: the processes killed were not "
                           "what the episodes used" if not hit else "no environment process after the batch"
                           if not after else "the environment after the batch is the one killed")),
        GateResult(name="recovery:no-episode-lost", passed=figures["lost"] == 0, measured=figures["lost"], threshold=0,
                   detail=f"{figures['retried_episodes']} retried, {figures['failed_episodes']} marked failed, "
                          f"{figures['lost']} lost of {requested}"),
    ]
    return gates, figures

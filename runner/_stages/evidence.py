"""Evidence files: what a stage wrote (artifacts with hashes and record counts, partial files marked), the
evidence.json of a finished, skipped or interrupted stage, and setting an interrupted stage aside so a
resumed run keeps every file it left."""

from __future__ import annotations

import contextlib
from pathlib import Path

from runner_contracts import (
    PARTIAL_SUFFIX,
    Artifact,
    EnvironmentInfo,
    ErrorInfo,
    Evidence,
    Provenance,
    RecordError,
    read_record,
    sha256_file,
)

from .._provenance import provenance_in_background
from .._secrets import write_record_redacted
from .arm import Arm, StageOutput, now


def _provenance(arm: Arm) -> Provenance:
    if arm.provenance is None:
        arm.provenance = provenance_in_background(arm.plan)
    return arm.provenance.result()


def artifacts(arm: Arm, folder: Path) -> list[Artifact]:
    found = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or "checkpoints" in path.parts or path.name.startswith("."):
            continue
        partial = path.name.endswith(PARTIAL_SUFFIX)
        records = None
        if path.name.endswith(".jsonl") or (partial and ".jsonl" in path.name):
            with open(path, "rb") as handle:
                records = sum(1 for line in handle if line.endswith(b"\n"))
        found.append(Artifact(path=str(path.relative_to(arm.run_dir)), sha256=sha256_file(path),
                              bytes=path.stat().st_size, records=records, partial=partial))
    return found


def write_stage_evidence(arm: Arm, stage: str, output: StageOutput, started: str) -> Evidence:
    """evidence.json of a stage that ran: error if it raised one, passed only if it has gates and all passed."""
    if output.error is not None:
        status = "error"
    else:
        status = "passed" if output.gates and all(g.passed for g in output.gates) else "failed"
    folder = arm.stage_dir(stage)
    evidence = Evidence(
        run_id=arm.run_id, stack=arm.manifest.name, stage=stage, plan_id=arm.plan.plan_id or "", status=status,
        started_at=started, finished_at=now(), environment=arm.environment,
        metrics={**output.metrics, "adapter_jobs_s": round(arm.stage_jobs_s, 3)},
        artifacts=artifacts(arm, folder), checkpoints=output.checkpoints, gates=output.gates, error=output.error,
        provenance=_provenance(arm))
    write_record_redacted(folder / "evidence.json", evidence)
    return evidence


def write_skipped(arm: Arm, stage: str) -> Evidence:
    evidence = Evidence(run_id=arm.run_id, stack=arm.manifest.name, stage=stage, plan_id=arm.plan.plan_id or "",
                        status="skipped", started_at=now(), finished_at=now(),
                        error=ErrorInfo(kind="skipped", message="an earlier stage did not pass"),
                        provenance=_provenance(arm))
    write_record_redacted(arm.stage_dir(stage) / "evidence.json", evidence)
    return evidence


def mark_interrupted(arm: Arm, stage: str, folder: Path, message: str, *, started: str | None = None,
                     environment: EnvironmentInfo | None = None) -> None:
    """Evidence for a stage the run stopped in: status error, kind interrupted, the files it left."""
    write_record_redacted(folder / "evidence.json", Evidence(
        run_id=arm.run_id, stack=arm.manifest.name, stage=stage, plan_id=arm.plan.plan_id or "", status="error",
        started_at=started or now(), finished_at=now(), environment=environment, artifacts=artifacts(arm, folder),
        error=ErrorInfo(kind="interrupted", message=message), provenance=_provenance(arm)))


def earlier_evidence(arm: Arm, stage: str) -> Evidence | None:
    """The stage's evidence already in the run directory (None if missing or unreadable)."""
    with contextlib.suppress(RecordError, FileNotFoundError):
        return read_record(arm.stage_dir(stage) / "evidence.json", Evidence)
    return None


DISK_FULL_MARK = "DISK-FULL"  # left in a stage folder whose evidence could not be written for lack of space


def set_aside(arm: Arm, stage: str) -> Path:
    """Moves an interrupted stage's folder to <stage>.attempt-<n> and marks it: nothing it wrote is lost."""
    folder = arm.stage_dir(stage)
    number = 1 + sum(1 for _ in folder.parent.glob(f"{stage}.attempt-*"))
    target = folder.with_name(f"{stage}.attempt-{number}")
    folder.rename(target)
    if not (target / "evidence.json").is_file():
        why = "the disk filled up" if (target / DISK_FULL_MARK).exists() else "the run stopped"
        mark_interrupted(arm, stage, target, f"{why} during this stage; set aside by a resumed run as {target.name}")
    return target

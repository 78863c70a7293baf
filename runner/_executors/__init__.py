"""Executors: who runs the arms. local (this host, one arm after another) or slurm (one sbatch job per arm,
chained, then a report job). Both meet the `Executor` protocol, so commands never ask which one runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from runner_contracts import Plan

from .._engines import check_engine
from .._errors import UserError
from .._stacks import StackManifest

if TYPE_CHECKING:
    from .sbatch import SubmittedJob  # Slurm's: ~6 ms to import, for the local executor's every command

EXECUTORS = ("local", "slurm")


@dataclass(frozen=True)
class Submitted:
    """Jobs handed to a scheduler and not followed (a dry run writes the scripts only)."""

    run_dir: Path
    jobs: list[SubmittedJob]
    dry_run: bool


class Executor(Protocol):
    """Runs one arm or a comparison to its end and returns its report (report.json / comparison.json data),
    or returns at once with the jobs it submitted."""

    name: str

    def qualify(self, manifest: StackManifest, plan: Plan, run_dir: Path, stages: list[str], *,
                all_stages: bool, resume: bool) -> dict[str, Any] | Submitted: ...

    def compare(self, manifests: list[StackManifest], plan: Plan, compare_dir: Path,
                stages: dict[str, list[str]], *, all_stages: bool, resume: bool) -> dict[str, Any] | Submitted: ...


def make_executor(name: str, *, engine: str, images: dict[str, str] | None = None, cluster: Path | None = None,
                  dry_run: bool = False, follow: bool = True, quiet: bool = False,
                  log: Callable[[str], None] = lambda message: None) -> Executor:
    """The executor called `name`, refusing options that belong to the other one. `images` maps a stack to
    an existing image the local executor's container engine runs as is."""
    if name not in EXECUTORS:
        raise UserError(f"--executor {name!r}: executors are {', '.join(EXECUTORS)}")
    check_engine(engine, next(iter((images or {}).values()), None))
    if name == "local":
        if cluster or dry_run:
            raise UserError("--cluster and --dry-run belong to --executor slurm")
        from .local import LocalExecutor

        return LocalExecutor(engine, images=images, quiet=quiet, log=log)
    if images:
        raise UserError("--image belongs to --executor local: a Slurm job builds or finds the stack's image on "
                        "its node (Apptainer: <RUNNER_SIF_DIR>/<stack>.sif)")
    from .sbatch import load_profile
    from .slurm import SlurmExecutor

    return SlurmExecutor(engine, load_profile(cluster), dry_run=dry_run, follow=follow, quiet=quiet)


__all__ = ["EXECUTORS", "Executor", "Submitted", "make_executor"]

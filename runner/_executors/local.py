"""The local executor: arms run on this host, one after another, in the chosen engine, with a progress
line per stage."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner_contracts import Plan

from .._console import progress, status
from .._engines import make_engine
from .._report import write_report
from .._stacks import StackManifest
from .._stages import prepare_arm, run_arm
from .._stages.arm import check_run_dir


class LocalExecutor:
    """Runs arms here; the engine (and so its images, when it builds them) is made once for all arms."""

    name = "local"

    def __init__(self, engine: str, *, images: dict[str, str] | None = None, quiet: bool = False,
                 log: Callable[[str], None] = lambda message: None):
        self.engine = make_engine(engine, log=log, images=images)
        self.quiet = quiet

    def qualify(self, manifest: StackManifest, plan: Plan, run_dir: Path, stages: list[str], *,
                all_stages: bool, resume: bool) -> dict[str, Any]:
        return {**self.run_arm(manifest, plan, run_dir, stages, resume=resume), "run_dir": str(run_dir)}

    def compare(self, manifests: list[StackManifest], plan: Plan, compare_dir: Path,
                stages: dict[str, list[str]], *, all_stages: bool, resume: bool) -> dict[str, Any]:
        """Runs the arms one after another; with `resume`, each keeps the stages that passed in an earlier,
        interrupted comparison in `compare_dir` and sets aside the stage it was interrupted in."""
        for manifest in manifests:
            check_run_dir(compare_dir / "arms" / manifest.name, plan)
        for manifest in manifests:
            self.run_arm(manifest, plan, compare_dir / "arms" / manifest.name, stages[manifest.name], resume=resume)
        from .._compare import write_comparison  # a comparison's only

        return write_comparison(compare_dir, [manifest.name for manifest in manifests])

    def run_arm(self, manifest: StackManifest, plan: Plan, target: Path, selected: list[str], *,
                resume: bool = False) -> dict[str, Any]:
        """Prepares and runs one arm with a progress line per stage; writes its report and returns it."""
        check_run_dir(target, plan)
        target.mkdir(parents=True, exist_ok=True)
        with status(f"preparing the {manifest.name} environment(s)", quiet=self.quiet):
            arm = prepare_arm(manifest, self.engine, plan, target)
        with progress(quiet=self.quiet) as lines_on_stderr:
            lines = {stage: lines_on_stderr.add_task(f"{manifest.name} {stage}: waiting", total=1)
                     for stage in selected}

            def on_stage(stage: str, state: str) -> None:
                lines_on_stderr.update(lines[stage], description=f"{manifest.name} {stage}: "
                                                                 f"{'running' if state == 'start' else state}",
                                       completed=0 if state == "start" else 1)

            arm.on_event = lambda stage, message: lines_on_stderr.update(
                lines[stage], description=f"{manifest.name} {stage}: {message}")
            run_arm(arm, selected, on_stage, resume=resume)
        return write_report(target)

"""What every evaluation harness adapter (a stack of kind harness) shares: its two jobs. `probe` reports the
environment as every stack's does; `harness` runs the harness against options.policy_url and writes
harness.jsonl (see docs/harnesses.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from runner_contracts import HARNESS_FILE, HarnessSample, JsonlWriter, StageRequest, StageResult

from .rollout import environment_info

def harness_main(request: StageRequest, *, upstream: str, capabilities: list[str],
                 harness: Callable[[StageRequest], StageResult]) -> StageResult:
    """The adapter's entry point: `probe`, or `harness` by the given function."""
    if request.stage == "probe":
        return StageResult(stage="probe", environment=environment_info(upstream), capabilities=capabilities)
    if request.stage == "harness":
        return harness(request)
    raise ValueError(f"a harness adapter has the jobs probe and harness, not {request.stage!r}")


def write_samples(out_dir: Path, samples: Iterable[HarnessSample]) -> None:
    """harness.jsonl in `out_dir`."""
    with JsonlWriter(out_dir / HARNESS_FILE) as writer:
        for sample in samples:
            writer.write(sample)

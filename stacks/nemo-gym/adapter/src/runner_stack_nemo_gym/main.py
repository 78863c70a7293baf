"""Entry point the host launches (`runner_stack_nemo_gym.main:run`)."""

from __future__ import annotations

from runner_contracts import StageRequest, StageResult
from runner_kit.rollout import adapter_main

from .backend import NemoGymBackend


def run(request: StageRequest) -> StageResult:
    task = request.plan.task
    families = {task.family} | {split.family for split in (task.train, task.heldout, task.retention) if split.family}
    return adapter_main(NemoGymBackend(families, native=task.native), request)

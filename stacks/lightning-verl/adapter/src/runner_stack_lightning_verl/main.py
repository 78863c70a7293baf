"""Adapter entry point: the rollout-service stages (probe, service, serve) on the Agent Lightning backend, and
on GPU plans the update and train stages with verl's trainer (verl_stage)."""

from __future__ import annotations

from runner_contracts import StageRequest, StageResult
from runner_kit.rollout import adapter_main

from .backend import LightningBackend


def run(request: StageRequest) -> StageResult:
    if request.stage in ("update", "train") and request.plan.budget.gpus > 0:
        from .verl_stage import run_verl_stage

        return run_verl_stage(request)
    return adapter_main(LightningBackend(native=request.plan.task.native), request)

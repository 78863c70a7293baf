"""Adapter entry point: the rollout-service stages (probe, service, serve) on the SkyRL Gym backend."""

from __future__ import annotations

from runner_contracts import StageRequest, StageResult
from runner_kit.rollout import adapter_main

from .backend import SkyRLGymBackend


def run(request: StageRequest) -> StageResult:
    return adapter_main(SkyRLGymBackend(native=request.plan.task.native), request)

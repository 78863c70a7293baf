"""Adapter entry point: the rollout-service stages (probe, service, serve) on the OpenEnv backend."""

from __future__ import annotations

from runner_contracts import StageRequest, StageResult
from runner_kit.rollout import adapter_main

from .backend import OpenEnvBackend


def run(request: StageRequest) -> StageResult:
    return adapter_main(OpenEnvBackend(native=request.plan.task.native), request)

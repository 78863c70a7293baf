"""Adapter entry point: the rollout-service stages (probe, service, serve) on the OpenEnv backend."""

from __future__ import annotations

from qualification.rollout import adapter_main
from runner_contracts import StageRequest, StageResult

from .backend import OpenEnvBackend


def run(request: StageRequest) -> StageResult:
    return adapter_main(OpenEnvBackend(), request)

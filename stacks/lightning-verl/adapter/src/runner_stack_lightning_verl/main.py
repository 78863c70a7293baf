"""Adapter entry point: the rollout-service stages (probe, service, serve) on the Agent Lightning backend."""

from __future__ import annotations

from qualification.rollout import adapter_main
from runner_contracts import StageRequest, StageResult

from .backend import LightningBackend


def run(request: StageRequest) -> StageResult:
    return adapter_main(LightningBackend(), request)

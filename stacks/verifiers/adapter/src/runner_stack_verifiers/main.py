"""Adapter entry point: `runner_stack_verifiers.main:run`."""

from __future__ import annotations

from runner_kit.rollout import adapter_main


def run(request):
    from .backend import VerifiersBackend

    return adapter_main(VerifiersBackend(), request)

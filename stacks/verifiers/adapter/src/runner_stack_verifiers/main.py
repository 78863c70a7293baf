"""Adapter entry point: `runner_stack_verifiers.main:run`."""

from __future__ import annotations

from runner_kit.rollout import adapter_main


def run(request):
    from .backend import VerifiersBackend

    plan = request.plan
    return adapter_main(VerifiersBackend(native=plan.task.native, max_turns=plan.budget.max_turns), request)

"""Gates: host-side audits over the files a stage wrote. Each returns GateResult records.

Names are imported from their module on first use: a `runner qualify --stages probe` needs the lock gate,
not the trace audit's workers, scratch database and mismatch panel (~20 ms of imports)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module of this package that defines it
_EXPORTS = {
    "call_gates": "calls", "distill_gates": "distill", "HarnessRun": "harness", "harness_gates": "harness",
    "checkpoint_revisions": "stages", "evaluate_gates": "stages", "latest_complete_checkpoint": "stages",
    "lock_gate": "stages", "pooled_evaluation": "stages", "resume_gates": "stages", "service_gates": "stages",
    "update_gates": "stages", "sft_gates": "sft", "ScratchDatabase": "scratch", "SeenIds": "scratch",
    "map_in_order": "scratch", "TraceAudit": "trace",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .calls import call_gates
    from .distill import distill_gates
    from .harness import HarnessRun, harness_gates
    from .scratch import ScratchDatabase, SeenIds, map_in_order
    from .sft import sft_gates
    from .stages import (checkpoint_revisions, evaluate_gates, latest_complete_checkpoint, lock_gate,
                         pooled_evaluation, resume_gates, service_gates, update_gates)
    from .trace import TraceAudit


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

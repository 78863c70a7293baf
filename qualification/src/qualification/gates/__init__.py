"""Gates: host-side audits over the files a stage wrote. Each returns GateResult records."""

from .calls import call_gates
from .distill import distill_gates
from .harness import HarnessRun, harness_gates
from .stages import (
    checkpoint_revisions,
    evaluate_gates,
    latest_complete_checkpoint,
    lock_gate,
    pooled_evaluation,
    resume_gates,
    service_gates,
    update_gates,
)
from .sft import sft_gates
from .scratch import ScratchDatabase, SeenIds, map_in_order
from .trace import TraceAudit

__all__ = [
    "HarnessRun", "ScratchDatabase", "SeenIds", "map_in_order",
    "TraceAudit", "harness_gates", "call_gates", "checkpoint_revisions", "distill_gates", "evaluate_gates", "latest_complete_checkpoint",
    "lock_gate", "pooled_evaluation", "resume_gates", "service_gates", "sft_gates", "update_gates",
]

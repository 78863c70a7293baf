"""runner-contracts: the v1 wire format between the runner host and stack adapters.

Installed in every stack environment, so it depends on msgspec and nothing else.
"""

from .hashing import canonical_json, freeze_plan, plan_id, sha256_bytes, sha256_file
from .io import (
    PARTIAL_SUFFIX,
    JsonlWriter,
    RecordError,
    decode_record,
    encode,
    iter_jsonl,
    read_jsonl,
    read_record,
    write_atomic,
    write_record,
)
from .records import (
    COMPLETE_MARKER,
    RECORD_TYPES,
    SUPPORTED_VERSION,
    Artifact,
    BudgetSpec,
    CapturedCall,
    Checkpoint,
    Demonstration,
    EnvironmentInfo,
    EpisodeResult,
    EpisodeSpec,
    ErrorInfo,
    EvalRecord,
    Evidence,
    GateResult,
    GateSpec,
    Hardware,
    FaultSpec,
    Plan,
    PolicyCall,
    PolicySpec,
    Provenance,
    Record,
    RewardSpec,
    RolloutLedger,
    RolloutRequest,
    RolloutResponse,
    SamplingSpec,
    Segment,
    ServiceCase,
    SplitSpec,
    StageRequest,
    StageResult,
    TaskPackage,
    TaskSpec,
    ToolCallRecord,
    TrainingRow,
    Trajectory,
    Upstream,
)

__all__ = [
    "COMPLETE_MARKER", "PARTIAL_SUFFIX", "RECORD_TYPES", "SUPPORTED_VERSION", "Artifact", "BudgetSpec", "CapturedCall", "Checkpoint", "Demonstration",
    "EnvironmentInfo", "EpisodeResult", "EpisodeSpec", "ErrorInfo", "FaultSpec", "EvalRecord", "Evidence", "GateResult", "GateSpec", "Hardware",
    "JsonlWriter", "Plan", "PolicyCall", "PolicySpec", "Provenance", "Record", "RecordError", "RewardSpec", "RolloutLedger", "RolloutRequest", "RolloutResponse", "SamplingSpec",
    "Segment", "ServiceCase", "SplitSpec", "StageRequest", "StageResult", "TaskPackage", "TaskSpec", "ToolCallRecord", "TrainingRow",
    "Trajectory", "Upstream", "canonical_json", "decode_record", "encode", "freeze_plan", "iter_jsonl",
    "plan_id", "read_jsonl", "read_record", "sha256_bytes", "sha256_file", "write_atomic",
    "write_record",
]

"""Contract v1 records. Field names are the spec: extend, don't rename; a changed meaning bumps `version`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

TokenId = Annotated[int, msgspec.Meta(ge=0)]
LogProb = Annotated[float, msgspec.Meta(le=0.0)]
# Float bounds are written as ints (gt=0): typing caches Annotated[float, Meta(gt=0)] and [..., Meta(gt=0.0)] as one
# (they compare equal), so mixing them made the generated schemas depend on import order.
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
# How the policy writes tool calls in its completions (vLLM's --tool-call-parser names); runner_kit.tool_formats.
ToolFormat = Literal["hermes", "llama3_json", "mistral"]
# A string a chat template contains when it renders (and so teaches) the format's tool calls.
TOOL_CALL_MARKERS: dict[str, str] = {"hermes": "<tool_call>", "llama3_json": '"parameters"', "mistral": "[TOOL_CALLS]"}
# Architectures `runner policy tiny --family` builds, each with its own tokenizer and chat template, and
# the tool-call format that template teaches.
TinyFamily = Literal["qwen2", "llama", "mistral"]
TINY_TOOL_FORMATS: dict[str, str] = {"qwen2": "hermes", "llama": "llama3_json", "mistral": "mistral"}
SegmentSource = Literal["prompt", "policy", "tool", "env"]
Outcome = Literal["success", "failure", "truncated", "error"]
Status = Literal["passed", "failed", "error", "skipped"]
COMPLETE_MARKER = "COMPLETE"  # written last, atomically, into every complete checkpoint folder
StageName = Literal["probe", "service", "rollout", "distill", "update", "resume", "train", "evaluate"]


DEFAULT_EPISODE_TIMEOUT_S = 900.0  # a rollout service's per-attempt limit when the plan sets none

class Record(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every record: `contract` names the record type, `version` its major version."""


# --- plan.json -----------------------------------------------------------------------------------


class SplitSpec(Record, kw_only=True):
    split: str
    n: Annotated[int, msgspec.Meta(ge=1)]
    seed: int
    family: str | None = None  # defaults to task.family; retention probes name their own family


class TaskPackage(Record, kw_only=True, omit_defaults=True):
    """A package that provides task families (runner.task_families entry points): a local path, or a
    pinned requirement (`name==version`) installed from the package index pip is configured with, by a
    lock with sha256 hashes. The host fills in its distribution name and the sha256 of its source tree (a
    path) or of its lock (a requirement), so the plan id covers it."""

    path: str | None = None
    requirement: str | None = None
    lock: str | None = None
    name: str | None = None
    sha256: Sha256 | None = None


class NativeAsset(Record, kw_only=True, omit_defaults=True):
    """A team's own environment in one environment stack's native form (a SkyRL Gym env, an OpenEnv
    Environment, a Verifiers taskset), named by the plan and installed into that stack's jobs only (never the
    host's): `package` is the Python project that holds it, by path; or `requirement` (name==version) with
    `lock`, its hashed lock, installs it from the package index. `module` is imported there first (it
    registers the env); `env` names it (skyrl-gym: a registered id; openenv: `module:Class`; verifiers: the
    taskset id); `kwargs` go to its constructor or config. Episodes come from `dataset` (JSONL rows in the
    stack's own dataset format, inside the package, or beside the plan for a requirement) or, without one,
    from seeds. `cases` is the asset's optional answer key: scripted turns with the reward they must earn.
    The reward is the asset's own; an episode counts as solved at `success_reward` or above. A tool
    environment that scores answers through a tool names it in `answer_tool`: a reply without a tool call is
    submitted through it. The host makes paths absolute and fills in the distribution name and a sha256 (of
    the package's tree, or of the lock and data files), so the plan id covers the asset."""

    stack: str
    env: str
    package: str | None = None
    requirement: str | None = None
    lock: str | None = None
    module: str | None = None
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    dataset: str | None = None
    cases: str | None = None
    success_reward: float = 1.0
    answer_tool: str | None = None  # openenv: the tool a plain-text final answer is submitted through
    data_dir: str | None = None  # a requirement's dataset and cases: the plan's folder (filled in by the host)
    name: str | None = None  # the package's distribution name (filled in by the host)
    sha256: Sha256 | None = None


class TaskSpec(Record, kw_only=True, omit_defaults=True):
    family: str
    train: SplitSpec
    heldout: SplitSpec
    retention: SplitSpec
    # Omitted when empty (omit_defaults), so plans without task packages keep the ids they always had.
    packages: list[TaskPackage] = msgspec.field(default_factory=list)
    native: NativeAsset | None = None  # task.family is then the asset's task, run only by native.stack


class PolicySpec(Record, kw_only=True):
    kind: Literal["tiny", "path"]
    path: str | None = None
    sha256: Sha256 | None = None
    revision: str | None = None
    tiny: dict[str, Any] | None = None  # overrides of TinyRecipe's fields for kind=tiny (seed, sft_steps, ...)
    tool_format: ToolFormat = "hermes"


class TinyRecipe(Record, kw_only=True, frozen=True):
    """How the tiny CPU policy is built (the trl stack builds it); a plan's policy.tiny overrides fields.
    The plan keeps the overrides as written, so the policy's cache key and the plan id only change with them."""

    seed: int = 0
    model_family: TinyFamily = "qwen2"
    families: tuple[str, ...] = ("calc-tool", "german-arith")
    demos_per_family: Annotated[int, msgspec.Meta(ge=1)] = 2000
    vocab_size: Annotated[int, msgspec.Meta(ge=64)] = 640
    hidden_size: Annotated[int, msgspec.Meta(ge=8)] = 128
    layers: Annotated[int, msgspec.Meta(ge=1)] = 2
    heads: Annotated[int, msgspec.Meta(ge=1)] = 4
    kv_heads: Annotated[int, msgspec.Meta(ge=1)] = 2
    intermediate_size: Annotated[int, msgspec.Meta(ge=8)] = 512
    sft_steps: Annotated[int, msgspec.Meta(ge=1)] = 700
    sft_batch_size: Annotated[int, msgspec.Meta(ge=1)] = 32
    sft_learning_rate: Annotated[float, msgspec.Meta(gt=0)] = 3e-3


class RewardSpec(Record, kw_only=True):
    scorer: str
    version: int


class SamplingSpec(Record, kw_only=True):
    temperature: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: NonNegInt = 0
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 48
    seed: int = 0


class BudgetSpec(Record, kw_only=True):
    steps: Annotated[int, msgspec.Meta(ge=1)]
    prompts_per_step: Annotated[int, msgspec.Meta(ge=1)]
    generations_per_prompt: Annotated[int, msgspec.Meta(ge=2)]
    max_turns: Annotated[int, msgspec.Meta(ge=1)] = 3
    wall_clock_s: Annotated[float, msgspec.Meta(gt=0)] = 1800.0
    gpus: NonNegInt = 0
    cpus: Annotated[float, msgspec.Meta(gt=0)] | None = None  # container engines: CPU limit per job
    memory_gb: Annotated[float, msgspec.Meta(gt=0)] | None = None  # container engines: memory limit per job
    learning_rate: Annotated[float, msgspec.Meta(gt=0)] = 1e-4
    # Per episode attempt in a rollout service: a hung environment or tool is killed and retried after this long.
    # None: the service's default (DEFAULT_EPISODE_TIMEOUT_S).
    episode_timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None

    def attempt_timeout_s(self) -> float:
        """The per-attempt episode limit a rollout request carries."""
        return self.episode_timeout_s or DEFAULT_EPISODE_TIMEOUT_S


class GateSpec(Record, kw_only=True):
    logprob_tolerance: Annotated[float, msgspec.Meta(gt=0)] = 1e-3
    update_steps: Annotated[int, msgspec.Meta(ge=1)] = 2
    resume_kill_after_step: Annotated[int, msgspec.Meta(ge=1)] = 1
    resume_steps: Annotated[int, msgspec.Meta(ge=2)] = 3
    min_groups_with_variance: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    retention_margin: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    confidence: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.95


class ReleaseSpec(Record, kw_only=True):
    """When a trained checkpoint may ship: every gate passed, and each condition given here. `heldout_alpha`:
    held-out improved in the paired test at this significance; `retention`: "non-inferior" (the
    evaluate:retention gate's margin) or "zero-drop" (not one success fewer than the base); the mismatch
    panel's median token_mult_prob_error at most `max_token_mult_prob_error`."""

    heldout_alpha: Annotated[float, msgspec.Meta(gt=0, lt=1)] | None = None
    retention: Literal["non-inferior", "zero-drop"] | None = None
    max_token_mult_prob_error: Annotated[float, msgspec.Meta(ge=1)] | None = None
    min_pass_hat_k: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None  # trained held-out pass^k (plan.evaluation)


class EvaluationSpec(Record, kw_only=True):
    """Sampled evaluation besides greedy: `attempts` sampled episodes per held-out and retention item and
    policy (the plan's sampling settings, seeded per attempt), reported as pass@1 and pass^k."""

    attempts: Annotated[int, msgspec.Meta(ge=2, le=64)]


class HarnessSpec(Record, kw_only=True, omit_defaults=True):
    """An evaluation harness (a stack of kind harness: Inspect AI, lm-evaluation-harness) that the evaluate
    stage runs on the base and the trained checkpoint, each served greedily by the trainer's policy server.
    `task` is the harness's task (a file in a folder of its own, relative to the plan; the folder is copied into
    the run and its tree's sha256 is part of the plan id), `metric` the headline (default: the harness's own),
    `limit` the number of samples (default: all)."""

    stack: str
    task: str
    metric: str | None = None
    limit: Annotated[int, msgspec.Meta(ge=1)] | None = None
    sha256: Sha256 | None = None  # of the task's folder, filled in by the host


class DistillSpec(Record, kw_only=True):
    """Distillation (recipe: distill): `teacher` sampled `samples_per_item` times per train item (with `sampling`,
    else the plan's); the samples the task's reference scorer accepts, without duplicates and without a prompt
    of the held-out or retention splits, are the demonstrations the policy (the student) is fine-tuned on."""

    teacher: PolicySpec
    samples_per_item: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    sampling: SamplingSpec | None = None


class Plan(Record, kw_only=True, tag_field="contract", tag="plan"):
    """A language-model plan. Tagged ("contract": "plan") so that a stage request carries it or a domain plan."""

    version: int = 1
    name: str
    # grpo: sampled episodes + rewards; sft: the task's demonstrations; distill: a teacher's accepted samples
    recipe: Literal["grpo", "sft", "distill"] = "grpo"
    task: TaskSpec
    policy: PolicySpec
    reward: RewardSpec
    sampling: SamplingSpec
    budget: BudgetSpec
    seeds: list[int] = msgspec.field(default_factory=lambda: [0])
    gates: GateSpec = msgspec.field(default_factory=GateSpec)
    release: ReleaseSpec | None = None  # plan_id leaves it out when absent: earlier plans keep their ids
    evaluation: EvaluationSpec | None = None  # likewise
    distill: DistillSpec | None = None  # likewise; required by recipe: distill
    harnesses: list[HarnessSpec] = msgspec.field(default_factory=list)  # likewise when empty
    plan_id: Sha256 | None = None


# --- trajectories.jsonl --------------------------------------------------------------------------


class Segment(Record, kw_only=True):
    source: SegmentSource
    token_ids: list[TokenId]
    logprobs: list[LogProb] | None = None  # policy segments only, one per token
    text: str = ""


class ErrorInfo(Record, kw_only=True):
    kind: str
    message: str


class Trajectory(Record, kw_only=True):
    contract: Literal["trajectory"] = "trajectory"
    version: int = 1
    run_id: str
    stack: str
    stage: str
    step: NonNegInt
    episode_id: str
    task_id: str
    group_id: str
    sample_index: NonNegInt
    policy_revision: str
    segments: list[Segment]
    reward: float
    reward_components: dict[str, float] = msgspec.field(default_factory=dict)
    outcome: Outcome
    finish_reason: str
    turns: NonNegInt
    error: ErrorInfo | None = None
    timing: dict[str, float] = msgspec.field(default_factory=dict)


# --- training.jsonl ------------------------------------------------------------------------------


class TrainingRow(Record, kw_only=True):
    """What the optimizer consumed. old_logprobs[i] is the trainer's logprob of input_ids[i] where
    loss_mask[i] == 1 (0.0 elsewhere), computed with the weights that sampled the row."""

    contract: Literal["training-row"] = "training-row"
    version: int = 1
    step: NonNegInt
    row_id: str
    episode_ids: list[str]
    input_ids: list[TokenId]
    loss_mask: list[Annotated[int, msgspec.Meta(ge=0, le=1)]]
    advantage: float
    old_logprobs: list[float] | None = None


class Demonstration(Record, kw_only=True):
    """An SFT target as the stack rendered it: target_mask is 1 on tokens the loss should cover."""

    contract: Literal["demonstration"] = "demonstration"
    version: int = 1
    task_id: str
    input_ids: list[TokenId]
    target_mask: list[Annotated[int, msgspec.Meta(ge=0, le=1)]]


DropReason = Literal["rejected-by-scorer", "truncated", "duplicate", "overlaps-evaluation"]


class TeacherSample(Record, kw_only=True):
    """One episode the distillation teacher sampled on a train item (teacher.jsonl): kept as a demonstration,
    or dropped for the first reason that applies."""

    contract: Literal["teacher-sample"] = "teacher-sample"
    version: int = 1
    task_id: str
    family: str
    item: str  # the TaskItem's JSON, so the host re-scores the episode itself
    attempt: NonNegInt
    messages: list[dict[str, Any]]  # the prompt messages, then the teacher's turns and the tool results
    final_text: str
    tool_calls: list[ToolCallRecord]
    finish_reason: str
    success: bool
    kept: bool
    dropped: DropReason | None = None


# --- evidence.json -------------------------------------------------------------------------------


class Upstream(Record, kw_only=True):
    name: str
    version: str
    git_revision: str | None = None


class Hardware(Record, kw_only=True):
    cpu: str = ""
    cpu_count: int = 0
    gpus: list[str] = msgspec.field(default_factory=list)


class EnvironmentInfo(Record, kw_only=True):
    engine: str
    image: str | None = None
    image_digest: str | None = None
    python: str = ""
    packages: dict[str, str] = msgspec.field(default_factory=dict)
    lock_sha256: str | None = None
    upstream: Upstream | None = None
    hardware: Hardware = msgspec.field(default_factory=Hardware)
    deviations: list[str] = msgspec.field(default_factory=list)


class Artifact(Record, kw_only=True):
    path: str
    sha256: Sha256
    bytes: NonNegInt
    records: NonNegInt | None = None
    partial: bool = False


class Checkpoint(Record, kw_only=True):
    step: NonNegInt
    path: str
    sha256: Sha256


class GateResult(Record, kw_only=True):
    name: str
    passed: bool
    measured: Any = None
    threshold: Any = None
    detail: str = ""
    # "adapter" when `measured` is the adapter's own report (a loss the host cannot recompute); None when
    # the host derived it from files it checks.
    reported_by: Literal["adapter"] | None = None


class Provenance(Record, kw_only=True):
    """What produced a piece of evidence, to reproduce it or to know why not: the runner's source (git
    commit, and whether the tree had uncommitted changes), the command line, the host's Python and
    packages, the plan's task families (where each came from, its scorer version) and the policy's chat
    template."""

    runner_version: str
    git_commit: str | None = None
    git_dirty: bool | None = None
    command: list[str] = msgspec.field(default_factory=list)
    python: str
    platform: str
    host_packages: dict[str, str] = msgspec.field(default_factory=dict)
    task_families: dict[str, str] = msgspec.field(default_factory=dict)  # name -> "<dist> <version>, scorer v<n>"
    chat_template_sha256: str | None = None


class Evidence(Record, kw_only=True):
    contract: Literal["evidence"] = "evidence"
    version: int = 1
    run_id: str
    stack: str
    stage: str
    plan_id: str
    status: Status
    started_at: str
    finished_at: str
    environment: EnvironmentInfo | None = None
    metrics: dict[str, Any] = msgspec.field(default_factory=dict)
    artifacts: list[Artifact] = msgspec.field(default_factory=list)
    checkpoints: list[Checkpoint] = msgspec.field(default_factory=list)
    gates: list[GateResult] = msgspec.field(default_factory=list)
    error: ErrorInfo | None = None
    provenance: Provenance | None = None


# --- host <-> adapter ------------------------------------------------------------------------------


class StageRequest(Record, kw_only=True):
    """What the host asks an adapter to do; written to request.json in the stage's output folder."""

    contract: Literal["stage-request"] = "stage-request"
    version: int = 1
    run_id: str
    stack: str
    stage: str  # a StageName, or an adapter job such as "build-policy"
    plan: Plan | DomainPlan  # a language-model plan, or a domain stack's (runner_contracts.domain)
    out_dir: str
    policy_dir: str | None = None
    steps: int | None = None
    resume_from: str | None = None
    options: dict[str, Any] = msgspec.field(default_factory=dict)


class RolloutLedger(Record, kw_only=True):
    """What a stack's own rollout runner did during a training job whose sampler keeps no call log (verl's
    vLLM servers, for one): the rollouts it claimed and how each ended. The host does not take it on trust:
    the job's trajectories must account for every rollout claimed here (gate calls:rollouts-accounted)."""

    claimed: int
    succeeded: int
    failed: int
    failures: list[str] = msgspec.field(default_factory=list)  # "<rollout id>: <reason>", the first few
    worker_error: str | None = None  # what stopped the runner early, if anything did


class StageResult(Record, kw_only=True):
    """What the adapter reports back (result.json). The host trusts none of it for gates: claims in it
    (a rollout ledger) are checked against the files the job wrote."""

    contract: Literal["stage-result"] = "stage-result"
    version: int = 1
    stage: str
    metrics: dict[str, Any] = msgspec.field(default_factory=dict)
    environment: EnvironmentInfo | None = None
    capabilities: list[str] = msgspec.field(default_factory=list)
    files: dict[str, str] = msgspec.field(default_factory=dict)  # role -> path relative to out_dir
    rollout_ledger: RolloutLedger | None = None
    error: ErrorInfo | None = None


SERVICE_CALLS_FILE = "service-calls.jsonl"  # the service stage's scripted policy calls (PolicyCall records)
TEACHER_FILE = "teacher.jsonl"  # the distill stage's teacher samples (TeacherSample records)
HARNESS_FILE = "harness.jsonl"  # a harness job's scored samples (HarnessSample records)
# In a rollout service's folder, kept current while it runs: {"pids": [...]} of its environment's processes.
ENVIRONMENT_FILE = "environment.json"


class ServiceCase(Record, kw_only=True):
    """One scripted episode of the service stage: what was said, what the stack scored."""

    contract: Literal["service-case"] = "service-case"
    version: int = 1
    task_id: str
    item: str  # TaskItem JSON
    case: str
    expected_success: bool
    final_text: str
    tool_calls: list[dict[str, Any]]
    stack_reward: float
    stack_components: dict[str, float] = msgspec.field(default_factory=dict)
    episode_id: str = ""  # the id its policy calls carry (service-calls.jsonl)
    status: Literal["completed", "failed"] = "completed"
    error: ErrorInfo | None = None


class EvalRecord(Record, kw_only=True):
    """One evaluation episode (held-out or retention) of one policy."""

    contract: Literal["eval-record"] = "eval-record"
    version: int = 1
    policy: Literal["base", "trained", "baseline"]  # baseline: recipe distill's matched SFT baseline
    split: str
    task_id: str
    item: str
    final_text: str
    tool_calls: list[dict[str, Any]]
    stack_reward: float
    success: bool
    finish_reason: str  # stop | length | error (an infrastructure failure: the item is left out and counted)
    decoding: Literal["greedy", "sampled"] = "greedy"
    attempt: NonNegInt = 0  # sampled: which of plan.evaluation.attempts


class HarnessSample(Record, kw_only=True):
    """One sample an evaluation harness scored (harness.jsonl), as the harness's own log records it: its
    score as a number, and the episode id its policy calls carried (every call is in the policy server's
    calls.jsonl under that id)."""

    contract: Literal["harness-sample"] = "harness-sample"
    version: int = 1
    policy: Literal["base", "trained"]
    sample_id: str
    epoch: Annotated[int, msgspec.Meta(ge=1)] = 1
    episode_id: str
    score: float
    answer: str = ""  # the text the harness scored


# --- rollout service (environment adapters) ------------------------------------------------------


class EpisodeSpec(Record, kw_only=True):
    """One episode an environment adapter must run natively. `item` is the TaskItem JSON."""

    contract: Literal["episode-spec"] = "episode-spec"
    version: int = 1
    episode_id: str
    task_id: str
    family: str
    item: str
    seed: int
    max_turns: Annotated[int, msgspec.Meta(ge=1)]


class RolloutRequest(Record, kw_only=True):
    """POST /rollouts: a batch of episodes against one policy endpoint."""

    contract: Literal["rollout-request"] = "rollout-request"
    version: int = 1
    episodes: list[EpisodeSpec]
    policy_base_url: str  # ends in /v1
    policy_model: str = "policy"
    tokenizer_dir: str | None = None  # for stacks that tokenize themselves (token-in/token-out clients)
    tool_format: ToolFormat = "hermes"  # how the policy writes tool calls, for stacks that parse raw text
    sampling: SamplingSpec
    concurrency: Annotated[int, msgspec.Meta(ge=1)] = 4
    max_attempts: Annotated[int, msgspec.Meta(ge=1)] = 2
    # An attempt with no result after this long is abandoned: the environment server is killed and
    # restarted (a hung server unblocks no other way) and the episode retried, or failed after max_attempts.
    episode_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = DEFAULT_EPISODE_TIMEOUT_S


class RolloutPrepare(Record, kw_only=True):
    """POST /prepare: the policy endpoint the coming batches will call, sent by the trainer as soon as it serves
    it, so the service starts what waits for that address (e.g. NeMo Gym's model server and agent) while the
    trainer loads instead of during the first batch. Advisory: a batch starts whatever is still missing."""

    contract: Literal["rollout-prepare"] = "rollout-prepare"
    version: int = 1
    policy_base_url: str  # ends in /v1
    policy_model: str = "policy"
    tokenizer_dir: str | None = None
    tool_format: ToolFormat = "hermes"
    sampling: SamplingSpec
    families: list[str]  # the task families the batches' episodes belong to
    max_turns: Annotated[int, msgspec.Meta(ge=1)]


class ToolCallRecord(Record, kw_only=True):
    name: str
    arguments: dict[str, Any]
    result: str


class CapturedCall(Record, kw_only=True):
    """One model call as the environment stack itself captured it (e.g. at a gateway), in call order."""

    prompt_ids: list[TokenId]
    completion_ids: list[TokenId]
    logprobs: list[LogProb]


class EpisodeResult(Record, kw_only=True):
    """What an environment adapter reports for one episode. `status` failed = given up after retries."""

    contract: Literal["episode-result"] = "episode-result"
    version: int = 1
    episode_id: str
    task_id: str
    status: Literal["completed", "failed"]
    reward: float = 0.0
    reward_components: dict[str, float] = msgspec.field(default_factory=dict)
    success: bool = False
    outcome: Outcome = "error"
    finish_reason: str = ""
    turns: NonNegInt = 0
    final_text: str = ""
    tool_calls: list[ToolCallRecord] = msgspec.field(default_factory=list)
    attempts: NonNegInt = 1
    error: ErrorInfo | None = None
    seconds: float = 0.0
    # The stack's own token capture, when it has one: the trainer builds rows from it and the host
    # audits it against the policy server's log.
    captured_calls: list[CapturedCall] | None = None


class RolloutResponse(Record, kw_only=True):
    contract: Literal["rollout-response"] = "rollout-response"
    version: int = 1
    stack: str
    results: list[EpisodeResult]
    environment_restarts: NonNegInt = 0
    seconds: float = 0.0


class PolicyCall(Record, kw_only=True):
    """One call the policy server answered (calls.jsonl): the exact ids it was given and sampled."""

    contract: Literal["policy-call"] = "policy-call"
    version: int = 1
    call_id: str
    episode_id: str | None  # None = unattributable (an audit failure)
    channel: str  # how the episode id arrived: header | metadata | path | none
    endpoint: str
    attempt: Annotated[int, msgspec.Meta(ge=1)] = 1  # the rollout service's attempt at the episode
    index_in_episode: NonNegInt
    policy_revision: str
    prompt_ids: list[TokenId]
    completion_ids: list[TokenId]
    logprobs: list[LogProb]
    finish_reason: str
    seconds: float = 0.0


from .domain import DOMAIN_RECORD_TYPES, DomainPlan  # noqa: E402  (domain records build on the ones above)

AnyPlan = Plan | DomainPlan  # what a run directory's plan.json holds: a language-model or a domain plan

RECORD_TYPES: dict[str, type[Record]] = {
    "plan": Plan,
    "trajectory": Trajectory,
    "training-row": TrainingRow,
    "demonstration": Demonstration,
    "evidence": Evidence,
    "stage-request": StageRequest,
    "stage-result": StageResult,
    "service-case": ServiceCase,
    "eval-record": EvalRecord,
    "harness-sample": HarnessSample,
    "teacher-sample": TeacherSample,
    "episode-spec": EpisodeSpec,
    "rollout-request": RolloutRequest,
    "rollout-prepare": RolloutPrepare,
    "episode-result": EpisodeResult,
    "rollout-response": RolloutResponse,
    "policy-call": PolicyCall,
    **DOMAIN_RECORD_TYPES,
}
SUPPORTED_VERSION = 1

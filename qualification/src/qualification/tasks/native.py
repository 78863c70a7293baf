"""A team's native asset as a task family: the items are the asset's own dataset rows (or seeds), the reward
is the asset's own, and there is no reference scorer.

A plan with `task.native` runs the team's environment in one stack's own format (a SkyRL Gym env, an OpenEnv
Environment). Everything else in runner (splits, frozen hashes, episodes, the trainer's batches, the service
and evaluate stages) still speaks task families, so `use_plan(plan)` registers this family under
`task.family` in every process that holds the plan: the host, the trainer job, the stack's jobs. Only the
stack's jobs import the asset; this module reads its files as data.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .base import Score, TaskItem, Transcript, hash_bucket, split_rng
from .registry import FamilyError

NATIVE_DATA = "native-data"  # the built asset's copy of its dataset and answer key, under their own paths
NATIVE_DATA_VAR = "RUNNER_NATIVE_DATA"  # where a job finds that copy (a job may not see the package's source)
SPLIT_FIELD = "split"  # a row may name its split ("train" | "heldout"); otherwise a stable hash decides
ID_FIELD = "id"


class NativeFamily:
    """The task of a native asset. `native` is the plan's `NativeAsset` record (package resolved)."""

    synthetic = False
    system_prompt = ""
    tools: tuple = ()
    reference_scorer = False  # the asset's reward is the only one; gates say so

    def __init__(self, name: str, native: Any):
        self.name = name
        self.native = native
        self.scorer_version = 1
        # The host reads the package's own files (or, for an asset from the index, those beside the plan); a job
        # reads the copy built with the asset (the source may be outside what its sandbox or container shows).
        self.data = Path(os.environ.get(NATIVE_DATA_VAR) or native.data_dir or native.package)
        self._rows: dict[str, list[tuple[str, dict[str, Any]]]] | None = None
        self._cases: list[tuple[TaskItem, dict[str, Any]]] | None = None

    @property
    def frozen_splits(self) -> dict[str, tuple[int, int]]:
        """The two splits, each with the rows it holds (a dataset) or a default size (seeds)."""
        if not self.native.dataset:
            return {"train": (64, 0), "heldout": (32, 0)}
        return {"train": (len(self.rows("train")), 0), "heldout": (len(self.rows("heldout")), 0)}

    # --- items -------------------------------------------------------------------------------------------

    def rows(self, split: str) -> list[tuple[str, dict[str, Any]]]:
        """(task id, row) of the dataset's rows in `split`, in file order."""
        if self._rows is None:
            self._rows = _read_dataset(self.data / str(self.native.dataset))
        return self._rows.get(split, [])

    def generate(self, split: str, n: int, seed: int) -> list[TaskItem]:
        if split not in ("train", "heldout"):
            raise FamilyError(f"native task {self.name!r} has splits train and heldout, not {split!r} (a retention "
                              "probe names a family of its own: retention: {family: german-arith, ...})")
        rng = split_rng(self.name, split, seed)
        if not self.native.dataset:
            return [self._seed_item(split, seed) for seed in _seeds_of_split(rng, split, n)]
        pool = self.rows(split)
        if len(pool) < n:
            raise FamilyError(f"{self.data / str(self.native.dataset)}: {len(pool)} rows fall in split {split!r}, "
                              f"the plan asks for {n}")
        return [self._row_item(split, task_id, row) for task_id, row in rng.sample(pool, n)]

    def _row_item(self, split: str, task_id: str, row: dict[str, Any]) -> TaskItem:
        return TaskItem(family=self.name, split=split, task_id=task_id, question=question_of(row),
                        reference={"row": row})

    def _seed_item(self, split: str, seed: int) -> TaskItem:
        return TaskItem(family=self.name, split=split, task_id=f"seed-{seed}", question=f"reset(seed={seed})",
                        reference={"seed": seed})

    def messages_for(self, item: TaskItem) -> list[dict[str, Any]]:
        """The opening conversation: a row's own prompt (a message list or a string), else the item's text."""
        prompt = prompt_of(item.reference.get("row", {}))
        if isinstance(prompt, list):
            return [dict(message) for message in prompt]
        return [{"role": "user", "content": prompt if isinstance(prompt, str) else item.question}]

    # --- the answer key ----------------------------------------------------------------------------------

    def service_cases(self) -> list[tuple[TaskItem, dict[str, Any]]]:
        """(item, case) for the service stage: the asset's answer key when it ships one (`cases`), else one
        empty answer on each of two train items, which checks the lifecycle and not the reward."""
        if self._cases is None:
            if self.native.cases:
                self._cases = _read_cases(self, self.data / self.native.cases)
            else:
                self._cases = [(item, {"case": "lifecycle", "turns": [{"text": ""}], "expected_reward": None,
                                       "expected_success": False}) for item in self.generate("train", 2, 0)]
        return self._cases

    def scripted_cases(self, item: TaskItem) -> list[dict[str, Any]]:
        return [case for known, case in self.service_cases() if known.task_id == item.task_id]

    def expected_reward(self, task_id: str, case: str) -> float | None:
        for item, known in self.service_cases():
            if (item.task_id, known["case"]) == (task_id, case):
                return known["expected_reward"]
        return None

    def solved(self, reward: float) -> bool:
        return reward >= self.native.success_reward

    # --- what a native asset does not have ----------------------------------------------------------------

    def initial_state(self, item: TaskItem) -> dict[str, Any]:
        return {}

    def call_tool(self, item: TaskItem, state: dict[str, Any], name: str, arguments: dict[str, Any]) -> str:
        raise FamilyError(f"native task {self.name!r}: tools are the environment's own ({self.native.stack})")

    def score(self, item: TaskItem, transcript: Transcript) -> Score:
        raise FamilyError(f"native task {self.name!r} has no reference scorer: its reward is the environment's own")

    def demonstration(self, item: TaskItem) -> list[dict[str, Any]]:
        raise FamilyError(f"native task {self.name!r} has no demonstrations; warm-start the tiny policy on other "
                          "families (policy.tiny.families)")


def prompt_of(row: dict[str, Any]) -> Any:
    """A row's opening prompt: its `prompt` (SkyRL, TRL), or the `input` of its `responses_create_params`
    (NeMo Gym's rows, a string or messages)."""
    if "prompt" in row:
        return row["prompt"]
    params = row.get("responses_create_params")
    return params.get("input") if isinstance(params, dict) else None


def question_of(row: dict[str, Any]) -> str:
    """The text a row asks: its prompt's last user message, its prompt string, its `question` field (a
    column an environment's reset reads), or the row as JSON."""
    prompt = prompt_of(row)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    if isinstance(row.get("question"), str):
        return row["question"]
    return json.dumps(row, sort_keys=True, ensure_ascii=False)


def row_id(row: dict[str, Any]) -> str:
    given = row.get(ID_FIELD)
    if isinstance(given, (str, int)) and not isinstance(given, bool):
        return str(given)
    return hashlib.sha256(json.dumps(row, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def split_of(task_id: str, row: dict[str, Any]) -> str:
    return str(row[SPLIT_FIELD]) if SPLIT_FIELD in row else ("heldout" if hash_bucket(task_id) == 0 else "train")


def _seeds_of_split(rng, split: str, n: int) -> list[int]:
    seeds: list[int] = []
    while len(seeds) < n:
        seed = rng.randrange(2**31)
        if seed not in seeds and ("heldout" if hash_bucket(f"seed-{seed}") == 0 else "train") == split:
            seeds.append(seed)
    return seeds


def _json_lines(path: Path) -> list[tuple[int, dict[str, Any]]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FamilyError(f"{path}: no such file") from None
    except UnicodeDecodeError as error:
        raise FamilyError(f"{path}: not UTF-8 ({error.reason} at byte {error.start})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise FamilyError(f"{path}:{number}: not JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(row, dict):
            raise FamilyError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append((number, row))
    if not rows:
        raise FamilyError(f"{path}: no rows")
    return rows


def dataset_rows(path: Path) -> list[tuple[str, str, dict[str, Any]]]:
    """(where for errors, its short name, row) of a native dataset: a .jsonl file, or a .parquet file (SkyRL's
    own format; read with pyarrow on the host, from the JSONL copy built beside it in a job)."""
    if path.suffix == ".jsonl":
        return [(f"{path}:{number}", f"line {number}", row) for number, row in _json_lines(path)]
    if path.suffix != ".parquet":
        raise FamilyError(f"{path}: a native dataset is a .jsonl or .parquet file of the stack's own rows")
    copy = path.with_name(path.name + ".jsonl")
    if os.environ.get(NATIVE_DATA_VAR) and copy.is_file():
        return [(f"{path}: row {number}", f"row {number}", row) for number, row in _json_lines(copy)]
    rows = [(f"{path}: row {index + 1}", f"row {index + 1}", row) for index, row in enumerate(parquet_rows(path))]
    if not rows:
        raise FamilyError(f"{path}: no rows")
    return rows


def parquet_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a Parquet file as Python values (pyarrow is optional: runner[parquet])."""
    try:
        import pyarrow.parquet
    except ImportError:
        raise FamilyError(f"{path}: reading Parquet needs pyarrow: pip install 'runner[parquet]' (or convert the "
                          "file to JSONL)") from None
    try:
        return pyarrow.parquet.read_table(path).to_pylist()
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError and others for a bad file
        raise FamilyError(f"{path}: not a readable Parquet file ({error})") from None


def _read_dataset(path: Path) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    by_split: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    seen: dict[str, str] = {}
    questions: dict[str, tuple[str, str]] = {}
    for where, name, row in dataset_rows(path):
        try:
            json.dumps(row, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise FamilyError(f"{where}: not a JSON value ({error}); rows travel to the stack as JSON") from None
        if prompt_of(row) is not None and not isinstance(prompt_of(row), (str, list)):
            field = "prompt" if "prompt" in row else "responses_create_params.input"
            raise FamilyError(f"{where}: field {field}: expected a string or a list of messages")
        if question_of(row).strip() == "":
            raise FamilyError(f"{where}: field prompt: empty")
        task_id = row_id(row)
        if task_id in seen:
            raise FamilyError(f"{where}: field {ID_FIELD}: {task_id!r} repeats {seen[task_id]}")
        seen[task_id] = name
        split = split_of(task_id, row)
        if split not in ("train", "heldout"):
            raise FamilyError(f"{where}: field {SPLIT_FIELD}: expected train or heldout, got {split!r}")
        question = question_of(row)
        if question in questions and questions[question][0] != split:
            raise FamilyError(f"{where}: field prompt: the same prompt as {questions[question][1]}, "
                              f"which is in {questions[question][0]}: train and held-out would share an item")
        questions.setdefault(question, (split, name))
        by_split.setdefault(split, []).append((task_id, row))
    return by_split


def _read_cases(family: NativeFamily, path: Path) -> list[tuple[TaskItem, dict[str, Any]]]:
    cases = []
    names: set[tuple[str, str]] = set()
    for number, row in _json_lines(path):
        where = f"{path}:{number}"
        name, turns, expected = row.get("case"), row.get("turns"), row.get("expected_reward", None)
        if not isinstance(name, str) or not name:
            raise FamilyError(f"{where}: field case: expected a name")
        if not isinstance(turns, list) or not turns or not all(_is_turn(turn) for turn in turns):
            raise FamilyError(f"{where}: field turns: expected a list of turns, each {{\"text\": ...}} or "
                              "{\"tool_call\": {\"name\": ..., \"arguments\": {...}}} (what the scripted policy "
                              "answers, turn by turn)")
        if expected is not None and (isinstance(expected, bool) or not isinstance(expected, (int, float))):
            raise FamilyError(f"{where}: field expected_reward: expected a number or null")
        if "row" in row:
            if not isinstance(row["row"], dict):
                raise FamilyError(f"{where}: field row: expected the dataset row (an object)")
            item = family._row_item("train", row_id(row["row"]), row["row"])
        elif isinstance(row.get("seed"), int):
            item = family._seed_item("train", row["seed"])
        else:
            raise FamilyError(f"{where}: needs the episode it scripts: row (a dataset row) or seed (an integer)")
        if (item.task_id, name) in names:
            raise FamilyError(f"{where}: field case: {name!r} repeats for {item.task_id}")
        names.add((item.task_id, name))
        cases.append((item, {"case": name, "turns": turns, "expected_reward": expected,
                             "expected_success": expected is not None and family.solved(float(expected))}))
    return cases


def _is_turn(turn: Any) -> bool:
    if not isinstance(turn, dict):
        return False
    if "text" in turn:
        return isinstance(turn["text"], str)
    call = turn.get("tool_call")
    return isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments", {}), dict)


def use_plan(plan: Any) -> None:
    """Registers the plan's native task (if it has one) under `task.family`, in this process."""
    from . import registry

    native = plan.task.native
    if native is not None:
        registry.register(NativeFamily(plan.task.family, native))

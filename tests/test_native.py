"""A team's native asset named by the plan (task.native): its dataset split and frozen like ours, its answer
key, the one-line errors for a broken dataset, answer key or plan, and the host's gates when the only reward
is the asset's own. The asset's code is never imported here (the host reads its files as data); the runs
that import it are in test_native_e2e.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import msgspec
import pytest
from conftest import publish_to_local_index

from qualification.gates import evaluate_gates, service_gates
from qualification.tasks import get_family, split_hash
from runner.api import load_plan
from runner_contracts import EvalRecord, ServiceCase

EXAMPLE = Path(__file__).parents[1] / "examples" / "native" / "skyrl-rechnen"


@pytest.fixture
def asset(tmp_path) -> Path:
    """A copy of the example asset (plan included), to break one thing at a time."""
    return Path(shutil.copytree(EXAMPLE, tmp_path / "asset", ignore=shutil.ignore_patterns("__pycache__")))


def rows(asset: Path) -> list[dict]:
    return [json.loads(line) for line in (asset / "data" / "rechnen.jsonl").read_text().splitlines()]


def write_rows(asset: Path, data: list[dict]) -> None:
    (asset / "data" / "rechnen.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data))


def run_cli(*args: str) -> tuple[int, str]:
    from typer.testing import CliRunner

    from runner.cli import app

    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output + (repr(result.exception) if result.exit_code == 1 else "")


def test_the_dataset_is_split_by_a_stable_hash_and_frozen(asset):
    plan = load_plan(asset / "plan.yaml")
    family = get_family(plan.task.family)
    train, heldout = family.generate("train", 64, 1), family.generate("heldout", 24, 2)
    assert not {i.task_id for i in train} & {i.task_id for i in heldout}
    assert not {i.question for i in train} & {i.question for i in heldout}
    assert split_hash(train) == split_hash(family.generate("train", 64, 1))  # deterministic
    assert split_hash(train) != split_hash(family.generate("train", 64, 9))
    # The opening conversation is the row's own prompt, system message included, untouched.
    row = train[0].reference["row"]
    assert family.messages_for(train[0]) == row["prompt"]
    assert plan.task.native.sha256 and Path(plan.task.native.package) == asset.resolve()


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLE.parent.iterdir() if (p / "plan.yaml").is_file()))
def test_every_native_example_plan_checks(example):
    code, output = run_cli("plan", "check", str(EXAMPLE.parent / example / "plan.yaml"))
    assert code == 0, output


def index_asset(asset: Path, tmp_path: Path, monkeypatch) -> Path:
    """The example asset published to a package index (a folder of wheels, PIP_FIND_LINKS, as a team's private
    index is configured for pip) under another name, locked, and a plan beside its dataset and answer key that
    names it by requirement; returns the plan."""
    publish_to_local_index(asset, "runner-test-rechnen-env", tmp_path / "index", monkeypatch)
    plans = Path(shutil.copytree(asset / "data", tmp_path / "plans" / "data"))
    code, output = run_cli("tasks", "lock", "--requirement", "runner-test-rechnen-env==0.1.0", "--out",
                           str(plans.parent / "rechnen.lock"))
    assert code == 0, output
    plan = plans.parent / "plan.yaml"
    plan.write_text(re.sub(r"package: \..*\n", "requirement: runner-test-rechnen-env==0.1.0\n    lock: rechnen.lock\n",
                           (asset / "plan.yaml").read_text(), count=1))
    return plan


def test_an_asset_from_the_index_is_named_by_a_pinned_requirement_and_its_lock(asset, tmp_path, monkeypatch):
    """Its dataset and answer key are the plan's files; the build installs the locked wheel (hash-checked) and
    copies them beside it; the plan id covers the lock and the data."""
    from runner._task_packages import build_native

    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    plan_file = index_asset(asset, tmp_path, monkeypatch)
    plan = load_plan(plan_file)
    native = plan.task.native
    assert native.package is None and native.name == "runner-test-rechnen-env" and native.data_dir == str(plan_file.parent)
    assert get_family(plan.task.family).generate("train", 64, 1)  # rows read from beside the plan
    built = build_native(plan)
    assert list(built.glob("dependencies/rechnen_env/env.py")) and (built / "native-data" / "data" / "cases.jsonl").is_file()
    code, output = run_cli("plan", "check", str(plan_file))
    assert code == 0, output
    cases = plan_file.parent / "data" / "cases.jsonl"
    cases.write_text(cases.read_text() + cases.read_text().splitlines()[0].replace('"correct"', '"again"') + "\n")
    assert load_plan(plan_file).task.native.sha256 != native.sha256
    text = plan_file.read_text()
    for change, message in [
        ("    lock: rechnen.lock\n", "field task.native.lock: required with a requirement"),
        ("runner-test-rechnen-env==0.1.0", "pin one version, name==version"),
        ("data/rechnen.jsonl", "field task.native.dataset:"),
    ]:
        plan_file.write_text(text.replace(change, {"runner-test-rechnen-env==0.1.0": "runner-test-rechnen-env>=0.1",
                                                   "data/rechnen.jsonl": "data/other.jsonl"}.get(change, ""), 1))
        code, output = run_cli("plan", "check", str(plan_file))
        assert code == 2 and message in " ".join(output.split()), (change, output)
    plan_file.write_text(text.replace("    lock: rechnen.lock\n", "    lock: rechnen.lock\n    package: .\n", 1))
    code, output = run_cli("plan", "check", str(plan_file))
    assert code == 2 and "give a package (a path) or a requirement, not both" in output


def test_a_parquet_dataset_gives_the_items_its_jsonl_gives_and_jobs_read_a_json_copy(asset, tmp_path, monkeypatch):
    """SkyRL's own datasets are Parquet files (datasets' to_parquet); the host reads them with pyarrow, the
    build writes a JSONL copy beside the copied file, and a job (RUNNER_NATIVE_DATA set) reads that."""
    import pyarrow
    import pyarrow.parquet

    from qualification.tasks.native import NATIVE_DATA_VAR
    from runner._task_packages import build_native

    as_jsonl = get_family(load_plan(asset / "plan.yaml").task.family).generate("train", 64, 1)
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows(asset)), asset / "data" / "rechnen.parquet")
    (asset / "data" / "rechnen.jsonl").unlink()
    plan_file = asset / "plan.yaml"
    plan_file.write_text(plan_file.read_text().replace("data/rechnen.jsonl", "data/rechnen.parquet"))
    plan = load_plan(plan_file)
    family = get_family(plan.task.family)
    assert family.generate("train", 64, 1) == as_jsonl
    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    built = build_native(plan)
    assert (built / "native-data" / "data" / "rechnen.parquet.jsonl").is_file()
    monkeypatch.setenv(NATIVE_DATA_VAR, str(built / "native-data"))
    monkeypatch.setattr("builtins.__import__", _no_pyarrow(__import__))
    assert type(family)(plan.task.family, plan.task.native).generate("train", 64, 1) == as_jsonl
    (asset / "data" / "rechnen.parquet").write_bytes(b"PAR1")
    monkeypatch.delenv(NATIVE_DATA_VAR)
    monkeypatch.undo()
    code, output = run_cli("plan", "check", str(plan_file))
    assert code == 2 and "rechnen.parquet: not a readable Parquet file" in output, output


def _no_pyarrow(real_import):
    def guarded(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("a job's environment has no pyarrow")
        return real_import(name, *args, **kwargs)
    return guarded


def test_an_edited_asset_is_another_plan(asset):
    before = load_plan(asset / "plan.yaml")
    (asset / "src" / "rechnen_env" / "env.py").write_text((asset / "src" / "rechnen_env" / "env.py").read_text()
                                                           + "\n# edited\n")
    assert load_plan(asset / "plan.yaml").task.native.sha256 != before.task.native.sha256


@pytest.mark.parametrize(("breakage", "message"), [
    (lambda data: data[:3] + [data[3] | {"prompt": ""}] + data[4:], "rechnen.jsonl:4: field prompt: empty"),
    (lambda data: data + [data[0]], "rechnen.jsonl:201: field id:"),
    (lambda data: data[:1] + [{**data[1], "prompt": 7}] + data[2:], "rechnen.jsonl:2: field prompt: expected a string or a list"),
    (lambda data: data[:5] + [{**data[5], "split": "test"}] + data[6:], "rechnen.jsonl:6: field split: expected train or heldout"),
    (lambda data: data[:2] + [{**data[0], "id": "again", "split": "heldout" if data[0].get("split") != "heldout"
                               else "train"}] + data[3:], "the same prompt as line 1"),
])
def test_a_broken_dataset_is_one_line_naming_file_line_and_field(asset, breakage, message):
    data = rows(asset)
    if "same prompt" in message:  # line 1's row must land in train for the copy in held-out to collide
        data[0]["split"] = "train"
    write_rows(asset, breakage(data))
    code, output = run_cli("plan", "check", str(asset / "plan.yaml"))
    assert code == 2 and "Traceback" not in output
    assert "field task.native.dataset" in output and message in " ".join(output.split()), output


def test_a_row_that_is_not_json_names_its_line(asset):
    path = asset / "data" / "rechnen.jsonl"
    lines = path.read_text().splitlines()
    lines[6] = lines[6][:-1]
    path.write_text("\n".join(lines) + "\n")
    code, output = run_cli("plan", "check", str(asset / "plan.yaml"))
    assert code == 2 and "rechnen.jsonl:7: not JSON" in " ".join(output.split())


@pytest.mark.parametrize(("case", "message"), [
    ({"case": "x", "seed": 1, "turns": "Antwort: 3"}, "cases.jsonl:7: field turns: expected a list"),
    ({"case": "x", "turns": [{"text": "a"}]}, "cases.jsonl:7: needs the episode it scripts"),
    ({"case": "x", "seed": 1, "turns": [{"text": "a"}], "expected_reward": "high"},
     "cases.jsonl:7: field expected_reward: expected a number or null"),
    ({"case": "", "seed": 1, "turns": [{"text": "a"}]}, "cases.jsonl:7: field case: expected a name"),
])
def test_a_broken_answer_key_is_one_line(asset, case, message):
    with (asset / "data" / "cases.jsonl").open("a") as handle:
        handle.write(json.dumps(case) + "\n")
    code, output = run_cli("plan", "check", str(asset / "plan.yaml"))
    assert code == 2 and "field task.native.cases" in output and message in " ".join(output.split()), output


@pytest.mark.parametrize(("old", "new", "message"), [
    ("stack: skyrl-gym", "stack: trl", "the trl stack does not run a team's native asset; stacks that "
                                       "do: lightning-verl, nemo-gym, openenv, skyrl-gym, verifiers"),
    ("stack: skyrl-gym", "stack: skyrl", "field task.native.stack: unknown stack 'skyrl'"),
    ("package: .", "package: ./nowhere", "field task.native.package:"),
    ("dataset: data/rechnen.jsonl", "dataset: data/missing.jsonl", "field task.native.dataset:"),
    ("{family: calc-tool, split: heldout,", "{split: heldout,", "field task.retention.family: a native task has "
                                                                     "no retention split"),
    ("tiny: {seed: 0}", "tiny: {seed: 0, families: [calc-tool, rechnen]}", "rechnen is a native asset's task, "
                                                                            "which has no demonstrations"),
    ("train: {split: train, n: 64", "train: {split: train, n: 400", "rows fall in split 'train', the plan asks for 400"),
])
def test_a_broken_native_plan_is_one_line(asset, old, new, message):
    plan = asset / "plan.yaml"
    assert old in plan.read_text()
    plan.write_text(plan.read_text().replace(old, new, 1))
    code, output = run_cli("plan", "check", str(plan))
    assert code == 2 and "Traceback" not in output and message in " ".join(output.split()), output


def test_only_the_assets_own_stack_may_run_it(asset):
    from runner._plan_checks import arm_problem

    plan = load_plan(asset / "plan.yaml")
    assert arm_problem(plan, ["skyrl-gym", "skyrl-gym@0.4.0"]) is None  # two pins of its own stack may
    code, output = run_cli("qualify", "--stack", "trl", "--plan", str(asset / "plan.yaml"), "--stages", "probe")
    assert code == 2 and "only the skyrl-gym arm can run; trl cannot" in " ".join(output.split())
    code, output = run_cli("compare", "--stacks", "skyrl-gym,openenv", "--plan", str(asset / "plan.yaml"))
    assert code == 2 and "openenv cannot (arms are comparable only on the same asset)" in " ".join(output.split())


def service_case(item, case: str, reward: float, *, status: str = "completed") -> ServiceCase:
    return ServiceCase(task_id=item.task_id, item=item.to_json(), case=case, expected_success=reward >= 1.0,
                       final_text="", tool_calls=[], stack_reward=reward, episode_id=f"service/{item.task_id}/{case}",
                       status=status)


def test_the_service_gate_holds_the_environment_to_its_answer_key(asset):
    family = get_family(load_plan(asset / "plan.yaml").task.family)
    known = family.service_cases()
    agreeing = [service_case(item, case["case"], case["expected_reward"]) for item, case in known]
    gates = {g.name: g for g in service_gates(agreeing)}
    assert gates["service:reward-equals-reference"].passed and gates["service:known-answers"].passed
    assert "as its answer key says (reward from the environment's own reward; no reference scorer)" in \
        gates["service:reward-equals-reference"].detail
    item, case = known[0]
    lying = [service_case(item, case["case"], 0.0)] + agreeing[1:]
    gate = {g.name: g for g in service_gates(lying)}["service:reward-equals-reference"]
    assert not gate.passed and f"{item.task_id}/{case['case']}: environment 0.0 vs answer key 1.0" in gate.detail


def test_without_an_answer_key_the_service_stage_checks_the_lifecycle_only(asset):
    plan = asset / "plan.yaml"
    plan.write_text(plan.read_text().replace("    cases: data/cases.jsonl", ""))
    family = get_family(load_plan(plan).task.family)
    cases = [service_case(item, case["case"], 0.0) for item, case in family.service_cases()]
    gates = {g.name: g for g in service_gates(cases)}
    assert gates["service:native-lifecycle"].passed and "ships no answer key" in gates["service:native-lifecycle"].detail
    assert not gates["service:reward-equals-reference"].passed  # nothing was checked: a lifecycle is not a reward
    failed = service_gates([*cases[:1], service_case(*family.service_cases()[1][:1], "lifecycle", 0.0, status="failed")])
    assert not {g.name: g for g in failed}["service:native-lifecycle"].passed


def eval_record(item, policy: str, reward: float, success: bool) -> EvalRecord:
    return EvalRecord(policy=policy, split="heldout", task_id=item.task_id, item=item.to_json(), final_text="",
                      tool_calls=[], stack_reward=reward, success=success, finish_reason="stop", decoding="greedy")


def test_evaluate_checks_success_against_the_assets_reward_and_threshold(asset):
    family = get_family(load_plan(asset / "plan.yaml").task.family)
    items = family.generate("heldout", 6, 2)
    records = [eval_record(item, policy, float(index % 2), bool(index % 2))
               for policy in ("base", "trained") for index, item in enumerate(items)]
    gates, summary = evaluate_gates(records, margin=0.1, confidence=0.95)
    verified = gates[0]
    assert verified.name == "evaluate:scores-verified" and verified.passed
    assert "12 episodes of the native asset checked against its own reward" in verified.detail
    assert summary["heldout"]["n"] == 6 and summary["heldout"]["trained_k"] == 3
    claimed = [msgspec.structs.replace(records[0], success=True)] + records[1:]  # reward 0.0 yet "solved"
    assert not evaluate_gates(claimed, margin=0.1, confidence=0.95)[0][0].passed

"""Every case of tests/broken_inputs.yaml: a broken plan, argument or file gives exit 2 and one line that
says where and what, never a traceback, and runs nothing."""

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from runner.cli import app

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"
CORPUS = yaml.safe_load((Path(__file__).parent / "broken_inputs.yaml").read_text())


def run_cli(args, env=None):
    result = CliRunner().invoke(app, args, env={"COLUMNS": "400", **(env or {})})
    message = " ".join(result.output.split())
    assert result.exit_code == 2, (args, result.output, result.exception)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert result.output.startswith("error:") and len(result.output.strip().splitlines()) == 1, result.output
    return message


def broken_plan(case, folder: Path) -> Path:
    text = PLAN.read_text()
    if "replace" in case:
        old, new = case["replace"]
        assert old in text, f"{case['name']}: the shipped plan no longer has {old!r}"
        text = text.replace(old, new, 1)
    text = case.get("text", text) + case.get("append", "")
    path = folder / PLAN.name
    path.write_bytes(text.encode("latin-1" if case.get("latin1") else "utf-8"))
    return path


@pytest.mark.parametrize("case", CORPUS["plans"], ids=[case["name"] for case in CORPUS["plans"]])
def test_a_broken_plan_is_one_line_naming_file_line_and_field(tmp_path, case):
    path = broken_plan(case, tmp_path)
    message = run_cli(["plan", "check", str(path)])
    assert str(path) in message and case["error"] in message, message


def test_a_broken_plan_stops_qualify_before_anything_is_built(tmp_path):
    case = CORPUS["plans"][0]
    message = run_cli(["qualify", "--stack", "trl", "--plan", str(broken_plan(case, tmp_path)),
                       "--run-dir", str(tmp_path / "run")])
    assert case["error"] in message
    assert not (tmp_path / "run").exists()


def test_the_shipped_plans_hold():
    for plan in sorted((ROOT / "qualification" / "plans").glob("*-cpu.yaml")):
        result = CliRunner().invoke(app, ["plan", "check", str(plan)], env={"COLUMNS": "400"})
        assert result.exit_code == 0 and "holds" in result.output, (plan, result.output)


def fill(text: str, tmp_path: Path, file: Path) -> str:
    return text.replace("{plan}", str(PLAN)).replace("{tmp}", str(tmp_path)).replace("{file}", str(file))


@pytest.mark.parametrize("case", CORPUS["commands"], ids=[case["name"] for case in CORPUS["commands"]])
def test_a_broken_command_line_is_one_line(tmp_path, case):
    file = tmp_path / "a-file"
    file.write_text("x")
    message = run_cli([fill(arg, tmp_path, file) for arg in case["args"]])
    assert fill(case["error"], tmp_path, file) in message, message


@pytest.mark.parametrize("case", CORPUS["files"], ids=[case["name"] for case in CORPUS["files"]])
def test_a_broken_file_is_one_line_naming_it(tmp_path, case):
    for relative, content in {case["path"]: case["content"], **case.get("also", {})}.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(content)
    env = {"RUNNER_STACKS_DIR": str(tmp_path / "stacks")} if (tmp_path / "stacks").is_dir() else {}
    message = run_cli([fill(arg, tmp_path, tmp_path) for arg in case["args"]], env)
    assert case["error"] in message, message


def test_a_frozen_plan_with_its_tiny_policy_build_loads(tmp_path):
    """plan.json, as a Slurm job reads it: kind tiny with the build's path and sha256 filled in, plan_id set."""
    import msgspec
    from runner_contracts import freeze_plan, write_record

    from runner.api import load_plan

    plan = load_plan(PLAN)
    frozen = freeze_plan(msgspec.structs.replace(plan, policy=msgspec.structs.replace(
        plan.policy, path=str(tmp_path), sha256="0" * 64)))
    write_record(tmp_path / "plan.json", frozen)
    assert load_plan(tmp_path / "plan.json").policy.sha256 == "0" * 64

from pathlib import Path

import pytest

from runner.api import UserError, load_plan

PLAN = Path(__file__).resolve().parents[1] / "qualification" / "plans" / "calc-tool-cpu.yaml"


def test_shipped_plan_loads():
    plan = load_plan(PLAN)
    assert plan.task.family == "calc-tool" and plan.budget.generations_per_prompt >= 2


@pytest.mark.parametrize("old,new,expected", [
    ("  steps: 8\n", "  steps: -1\n", ":16: field budget.steps: Expected `int` >= 1"),
    ("  generations_per_prompt: 4\n", "  generations_per_prompt: 1\n", ":18: field budget.generations_per_prompt"),
    ("reward: {scorer: calc-tool, version: 1}\n", "", ": field reward: Object missing required field `reward`"),
    ("  kind: tiny ", "  kind: huge ", ":11: field policy.kind: Invalid enum value 'huge'"),
    ("  max_turns: 3\n", "  max_turns: 3\n  max_tunrs: 4\n", ":20: field budget.max_tunrs: Object contains unknown field"),
])
def test_plan_errors_name_file_line_and_field(tmp_path, old, new, expected):
    text = PLAN.read_text()
    assert old in text
    bad = tmp_path / "plan.yaml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(UserError) as error:
        load_plan(bad)
    assert str(error.value).startswith(str(bad))
    assert expected in str(error.value)


def test_yaml_syntax_error_has_a_line(tmp_path):
    bad = tmp_path / "plan.yaml"
    bad.write_text("name: x\ntask: [unclosed\n")
    with pytest.raises(UserError, match=r"plan.yaml:\d+: not valid YAML"):
        load_plan(bad)

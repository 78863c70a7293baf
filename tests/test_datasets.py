"""A team's dataset file as a task package (runner tasks from-dataset): rows checked with file, line and
column; splits from a column or a stable hash; the built-in scorers; the generated package found and
checked through a plan, like any task package."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from qualification.tasks import Transcript
from qualification.tasks.dataset import correct

from runner._datasets import Columns, read_dataset
from runner.api import UserError

RUNNER = str(Path(sys.executable).parent / "runner")


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def sums(n: int = 40) -> list[dict]:
    return [{"id": f"q{i}", "prompt": f"What is {i} plus {i + 3}?", "answer": str(2 * i + 3)} for i in range(n)]


@pytest.mark.parametrize(("scorer", "reply", "reference", "pattern", "ok"), [
    ("exact", "  Paris. ", "paris", None, True), ("exact", "Lyon", "Paris", None, False),
    ("numeric", "1,000.0000001", "1000", None, True), ("numeric", "1001", "1000", None, False),
    ("numeric", "about 3", "3", None, False), ("choice", "(B) the second", "B", None, True),
    ("choice", "C", "B", None, False), ("regex", "4.0", "4", r"4(\.0+)?", True), ("regex", "44", "4", r"4(\.0+)?", False),
])
def test_the_built_in_scorers(scorer, reply, reference, pattern, ok):
    assert correct(scorer, reply, reference, pattern=pattern) is ok


@pytest.mark.parametrize(("row", "where"), [
    ({"id": "q1", "prompt": "What is 1 plus 4?"}, ":2: column 'answer': missing or empty"),
    ({"id": "q1", "prompt": "", "answer": "5"}, ":2: column 'prompt': missing or empty"),
    ({"id": "q0", "prompt": "Other?", "answer": "5"}, ":2: column 'id': duplicate id 'q0' (first on line 1)"),
    ({"id": "q1", "prompt": "What is 1 plus 4?", "answer": "five"}, ":2: column 'answer': 'five' is not a number"),
    ({"id": "q1", "prompt": "What is 1 plus 4?", "answer": "5", "split": "dev"}, ":2: column 'split': 'dev' is not"),
])
def test_a_bad_row_is_one_error_naming_file_line_and_column(tmp_path, row, where):
    path = jsonl(tmp_path / "qa.jsonl", [{"id": "q0", "prompt": "What is 0 plus 3?", "answer": "3"}, row])
    with pytest.raises(UserError) as raised:
        read_dataset(path, "numeric")
    assert f"{path}{where}" in str(raised.value)


def test_a_prompt_in_train_and_heldout_is_refused_and_csv_lines_count_the_header(tmp_path):
    path = tmp_path / "qa.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, ["id", "question", "gold", "split"])
        writer.writeheader()
        writer.writerow({"id": "a", "question": "Capital of France?", "gold": "Paris", "split": "train"})
        writer.writerow({"id": "b", "question": "capital of  france?", "gold": "Paris", "split": "heldout"})
    with pytest.raises(UserError, match=r"qa.csv:3: column 'question': the same prompt is in train and heldout \(line 2\)"):
        read_dataset(path, "exact", Columns(prompt="question", answer="gold"))
    (tmp_path / "qa.parquet").write_bytes(b"PAR1")
    with pytest.raises(UserError, match=r"expected a .jsonl or .csv file \(Parquet: convert it"):
        read_dataset(tmp_path / "qa.parquet", "exact")


def test_rows_without_a_split_are_split_by_a_stable_hash(tmp_path):
    rows = read_dataset(jsonl(tmp_path / "qa.jsonl", sums(200)), "numeric", heldout_share=0.25)
    again = read_dataset(jsonl(tmp_path / "qa2.jsonl", list(reversed(sums(200)))), "numeric", heldout_share=0.25)
    assert {r["id"]: r["split"] for r in rows} == {r["id"]: r["split"] for r in again}  # by content, not order
    assert 30 < sum(r["split"] == "heldout" for r in rows) < 70


def test_the_generated_package_is_a_family_a_plan_can_name(tmp_path):
    env = {**os.environ, "RUNNER_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "200"}
    made = subprocess.run([RUNNER, "tasks", "from-dataset", str(jsonl(tmp_path / "qa.jsonl", sums())), "--name", "sums",
                           "--scorer", "numeric", "--out", str(tmp_path / "sums-tasks")], capture_output=True, text=True,
                          env=env)
    assert made.returncode == 0, made.stderr
    assert "family: sums" in made.stdout and "packages: [" in made.stdout
    plan = tmp_path / "plan.yaml"
    plan.write_text((Path(__file__).parent.parent / "examples" / "shop-tasks" / "plan.yaml").read_text()
                    .replace("shop-total", "sums").replace("packages: [.]", "packages: [sums-tasks]")
                    .replace("n: 64", "n: 20").replace("n: 48, seed: 2", "n: 5, seed: 2"))
    checked = subprocess.run([RUNNER, "tasks", "check", "sums", "--plan", str(plan), "--json"], capture_output=True,
                             text=True, env=env)
    assert checked.returncode == 0, checked.stderr
    found = json.loads(checked.stdout)
    assert found["problems"] == [] and found["version"] == "1.0.0"


def test_a_family_without_tools_is_not_asked_for_tool_calls():
    from qualification.gates import TraceAudit

    audit = TraceAudit(vocab_size=10, group_size=2, tolerance=1e-3)
    names = {g.name for g in audit.degeneracy_gates(0.1, expects_tools=False)}
    assert "signal:tool-calls" not in names and "signal:reward-variance" in names
    assert "signal:tool-calls" in {g.name for g in audit.degeneracy_gates(0.1)}


def test_a_dataset_family_scores_its_own_rows(tmp_path):
    from qualification.tasks.dataset import DatasetFamily

    rows = read_dataset(jsonl(tmp_path / "qa.jsonl", sums(12)), "numeric")
    data = jsonl(tmp_path / "data.jsonl", rows)
    family = DatasetFamily("sums", data, "numeric")
    item = family.generate("train", 1, 0)[0]
    assert family.score(item, Transcript(final_text=f"Working.\nAnswer: {item.reference['answer']}")).success
    assert not family.score(item, Transcript(final_text=item.reference["answer"])).success  # no 'Answer:' line
    with pytest.raises(ValueError, match="has .* rows, the plan asks for 99"):
        family.generate("train", 99, 0)

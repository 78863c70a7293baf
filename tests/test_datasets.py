"""A team's dataset file as a task package (runner tasks from-dataset): rows checked with file, line and
column; splits from a column or a stable hash; the built-in scorers; the generated package found and
checked through a plan, like any task package."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from qualification.tasks import Transcript
from qualification.tasks.dataset import correct

from runner._datasets import Columns, read_dataset, read_tools, write_package
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
    with pytest.raises(UserError, match=r"qa.parquet: not a readable Parquet file"):
        read_dataset(tmp_path / "qa.parquet", "exact")
    (tmp_path / "qa.xlsx").write_bytes(b"")
    with pytest.raises(UserError, match=r"qa.xlsx: expected a .jsonl, .csv or .parquet file"):
        read_dataset(tmp_path / "qa.xlsx", "exact")


def test_a_parquet_file_reads_like_jsonl_and_names_rows_in_errors(tmp_path):
    import pyarrow
    import pyarrow.parquet

    rows = [{**row, "level": index % 3} for index, row in enumerate(sums(30))]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "qa.parquet")
    columns = Columns(metadata=("level",))
    assert read_dataset(tmp_path / "qa.parquet", "numeric", columns) == read_dataset(
        jsonl(tmp_path / "qa.jsonl", rows), "numeric", columns)
    assert read_dataset(tmp_path / "qa.parquet", "numeric", columns)[4]["metadata"] == {"level": 1}
    rows[3]["answer"] = None
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(UserError, match=r"bad.parquet: row 4: column 'answer': missing or empty"):
        read_dataset(tmp_path / "bad.parquet", "numeric")
    with pytest.raises(UserError, match=r"qa.parquet: row 1: column 'topic': missing \(a --metadata-column"):
        read_dataset(tmp_path / "qa.parquet", "numeric", Columns(metadata=("topic",)))


@pytest.fixture(scope="module")
def math_verify():
    """math-verify from the math scorer's own lock, built under the user cache as the host builds it."""
    from runner._datasets import _math_library

    _math_library()
    import math_verify

    return math_verify


@pytest.mark.parametrize(("reply", "reference", "ok"), [
    ("0.5", "\\frac{1}{2}", True), ("\\frac12", "1/2", True), ("(x+1)^2", "x^2+2x+1", True),
    ("2^{1/2}", "\\sqrt{2}", True), ("\\{2, 1\\}", "\\{1,2\\}", True), ("$\\boxed{3}$", "3", True),
    ("4", "3", False), ("x^2+1", "(x+1)^2", False), ("3.14159", "\\pi", False), ("no idea", "3", False),
])
def test_the_math_scorer_is_equivalence_by_math_verify(math_verify, reply, reference, ok):
    assert correct("math", reply, reference) is ok


def test_a_math_answer_math_verify_cannot_read_is_refused(math_verify, tmp_path):
    rows = [{"id": "a", "prompt": "Half of one?", "answer": "\\frac{1}{2}"}, {"id": "b", "prompt": "?", "answer": "???"}]
    with pytest.raises(UserError, match=r"qa.jsonl:2: column 'answer': '\?\?\?' is not an expression math-verify"):
        read_dataset(jsonl(tmp_path / "qa.jsonl", rows), "math")


def test_a_rows_own_system_prompt_opens_its_episodes(tmp_path):
    from qualification.tasks import opening_messages
    from qualification.tasks.dataset import DatasetFamily

    source = sums(12)
    source[0]["system"] = "Reply in French. Answer on the last line as 'Answer: <answer>'."
    data = jsonl(tmp_path / "data.jsonl", read_dataset(jsonl(tmp_path / "qa.jsonl", source), "numeric"))
    family = DatasetFamily("sums", data, "numeric", system_prompt="Default.")
    items = {item.task_id: item for split in family.by_split for item in family.generate(split, len(family.by_split[split]), 0)}
    assert opening_messages(family, items["sums/q0"])[0]["content"].startswith("Reply in French.")
    assert opening_messages(family, items["sums/q1"]) == [{"role": "system", "content": "Default."},
                                                          {"role": "user", "content": items["sums/q1"].question}]


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


def test_a_math_dataset_package_brings_its_locked_scorer_library(tmp_path):
    """The package pins math-verify with hashes; `runner tasks check` (a fresh process with no math-verify
    installed) scores the family's cases with the library from the package's own built folder."""
    from qualification.tasks.dataset import MATH_LOCK

    env = {**os.environ, "RUNNER_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "200"}
    rows = [{"id": f"h{i}", "prompt": f"Write {i} halves as a fraction.", "answer": f"\\frac{{{i}}}{{2}}",
             "split": "train" if i <= 16 else "heldout"} for i in range(1, 21)]
    made = subprocess.run([RUNNER, "tasks", "from-dataset", str(jsonl(tmp_path / "qa.jsonl", rows)), "--name", "halves",
                           "--scorer", "math", "--out", str(tmp_path / "halves")], capture_output=True, text=True, env=env)
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "halves" / "requirements.lock").read_bytes() == MATH_LOCK.read_bytes()
    assert "math-verify" in (tmp_path / "halves" / "pyproject.toml").read_text()
    plan = tmp_path / "plan.yaml"
    plan.write_text((Path(__file__).parent.parent / "examples" / "shop-tasks" / "plan.yaml").read_text()
                    .replace("shop-total", "halves").replace("packages: [.]", "packages: [halves]")
                    .replace("n: 64", "n: 16").replace("n: 48, seed: 2", "n: 4, seed: 2"))
    checked = subprocess.run([RUNNER, "tasks", "check", "halves", "--plan", str(plan), "--json"], capture_output=True,
                             text=True, env={**env, "PYTHONNOUSERSITE": "1"})
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["problems"] == []
    built = next(p for p in (tmp_path / "cache" / "task-packages").iterdir() if p.is_dir())
    assert (built / "dependencies" / "math_verify").is_dir() and (built / "dataset_halves").is_dir()
    # The dependencies come after what an environment has: here a stand-in environment folder with its own
    # antlr4 wins over the lock's, and math-verify, which it lacks, still comes from the lock.
    own = tmp_path / "environment" / "antlr4"
    shutil.copytree(built / "dependencies" / "antlr4", own)
    (own / "__init__.py").write_text((own / "__init__.py").read_text() + "\nOURS = True\n")
    probe = subprocess.run([sys.executable, "-c", "import antlr4, math_verify; print(getattr(antlr4, 'OURS', False), "
                            "math_verify.__file__)"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": f"{built}:{tmp_path / 'environment'}"})
    assert probe.returncode == 0, probe.stderr
    ours, source = probe.stdout.split()
    assert ours == "True" and source.startswith(str(built / "dependencies"))


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


ORDERS = Path(__file__).resolve().parents[1] / "examples" / "support-orders"


def orders_rows(n: int = 20) -> list[dict]:
    with open(ORDERS / "orders.csv", newline="") as handle:
        return [dict(row) for row, _ in zip(csv.DictReader(handle), range(n))]


def test_a_tool_datasets_rows_carry_replayed_calls_and_its_family_calls_the_teams_tool(tmp_path):
    from qualification.tasks.dataset import DatasetFamily

    tools = read_tools(ORDERS / "tools.yaml")
    rows = read_dataset(jsonl(tmp_path / "qa.jsonl", orders_rows()), "exact", tools=tools)
    assert rows[0]["calls"] == [{"name": "order_status", "arguments": {"order_id": "C-9994"}}]
    write_package(tmp_path / "pkg", "orders", rows, "exact", tolerance=0, system_prompt="Look it up.", tools=tools)
    source = tmp_path / "pkg" / "src" / "dataset_orders"
    sys.path.insert(0, str(source.parent))
    try:
        import dataset_orders
    finally:
        sys.path.remove(str(source.parent))
    family: DatasetFamily = dataset_orders.FAMILY
    assert [(t.name, [p.name for p in t.params]) for t in family.tools] == [("order_status", ["order_id"])]
    item = family.generate("train", 1, 0)[0]
    state = family.initial_state(item)
    assert family.call_tool(item, state, "order_status", {"order_id": "C-9994"}) == "delivered"
    assert family.call_tool(item, state, "order_status", {"order_id": "nope"}).startswith("error: ValueError: no order")
    assert family.call_tool(item, state, "refund", {}) == "error: this task has no tool 'refund'"
    from qualification.tasks import ToolCall, check_family

    answered = Transcript(final_text="Answer: delivered")
    assert not family.score(item, answered).success  # require_tool_call: the right answer without a call fails
    looked_up = Transcript(final_text="Answer: delivered",
                           tool_calls=[ToolCall("order_status", {"order_id": "C-9994"}, "delivered")])
    assert family.score(item, looked_up).success
    problems, counts = check_family(family, n=4, seed=0)
    assert problems == [] and counts["cases"] == 4 * 5  # correct, wrong, no-answer-line, malformed-call, no-tool


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r.update(calls=""), "qa.jsonl:1: column 'calls': missing; tools.yaml sets require_tool_call"),
    (lambda r: r.update(calls="[{"), "qa.jsonl:1: column 'calls': not valid JSON"),
    (lambda r: r.update(calls='[{"name": "refund", "arguments": {}}]'), "call 1 names 'refund'; tools.yaml declares order_status"),
    (lambda r: r.update(calls='[{"name": "order_status", "arguments": {"id": "A-1"}}]'), "arguments must be exactly order_id"),
    (lambda r: r.update(calls='[{"name": "order_status", "arguments": {"order_id": 7}}]'), "argument order_id is not a string"),
    (lambda r: r.update(calls='[{"name": "order_status", "arguments": {"order_id": "A-1"}}]'),
     "call 1 order_status returned \"error: ValueError: no order 'A-1'"),
])
def test_a_bad_calls_column_is_one_error_naming_the_row(tmp_path, change, message):
    rows = orders_rows(3)
    change(rows[0])
    with pytest.raises(UserError) as raised:
        read_dataset(jsonl(tmp_path / "qa.jsonl", rows), "exact", tools=read_tools(ORDERS / "tools.yaml"))
    assert message in str(raised.value)


@pytest.mark.parametrize(("sidecar", "module", "message"), [
    ("module: orders.py\ntools: []\n", "", "tools.yaml:2: field tools: empty"),
    ("module: orders.py\ntools:\n  - {name: order_status, description: x, parameters: [{name: order_id, type: str}]}\n",
     "", "tools.yaml:3: field tools[0].parameters[0].type: Invalid enum value 'str'; expected one of integer, number, string"),
    ("module: missing.py\ntools:\n  - {name: order_status, description: x}\n", "", "tools.yaml:1: field module: "),
    ("module: orders.py\ntools:\n  - {name: refund, description: x}\n", "def order_status(state, order_id): pass\n",
     "tools.yaml:3: field tools[0]: orders.py has no function refund(state, ...)"),
    ("module: orders.py\ntools:\n  - {name: order_status, description: x, parameters: [{name: order_id, type: string}]}\n",
     "def order_status(state): pass\n", "orders.py:order_status cannot be called as order_status(state, order_id)"),
    ("module: orders.py\ntools:\n  - {name: order_status, description: x}\n", "import nope\n",
     "orders.py: importing it failed: ModuleNotFoundError"),
])
def test_a_bad_tools_file_is_one_error_naming_its_line(tmp_path, sidecar, module, message):
    (tmp_path / "tools.yaml").write_text(sidecar)
    (tmp_path / "orders.py").write_text(module or (ORDERS / "orders.py").read_text())
    with pytest.raises(UserError) as raised:
        read_tools(tmp_path / "tools.yaml")
    assert message in str(raised.value)

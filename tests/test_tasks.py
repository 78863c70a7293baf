import json
import os
import subprocess
import sys
from pathlib import Path

from qualification.tasks import (
    ToolCall,
    Transcript,
    exact_overlap,
    families,
    get_family,
    play_scripted_case,
    split_hash,
    strict_final_answer,
)


def test_generators_are_deterministic_and_hashed():
    family = get_family("calc-tool")
    a, b = family.generate("train", 20, 1), family.generate("train", 20, 1)
    assert a == b and split_hash(a) == split_hash(b)
    assert split_hash(family.generate("train", 20, 2)) != split_hash(a)


def test_train_and_heldout_are_disjoint():
    family = get_family("calc-tool")
    train, heldout = family.generate("train", 500, 1), family.generate("heldout", 200, 1)
    assert exact_overlap(train, heldout) == 0
    assert not {i.reference["expression"] for i in train} & {i.reference["expression"] for i in heldout}


def test_strict_final_answer():
    assert strict_final_answer("Rechnung...\nAntwort: 42") == 42
    assert strict_final_answer("Antwort: -3 ") == -3
    assert strict_final_answer("Antwort: 42 Euro") is None
    assert strict_final_answer("Die Antwort ist 42") is None
    assert strict_final_answer("") is None


def _calc_case(final: str, calls: list[tuple[str, str]]):
    family = get_family("calc-tool")
    item = family.generate("heldout", 1, 5)[0]
    transcript = Transcript(final_text=final.format(**item.reference),
                            tool_calls=[ToolCall("rechner", {"ausdruck": e.format(**item.reference)},
                                                 family.call_tool(item, {}, "rechner", {"ausdruck": e.format(**item.reference)}))
                                        for _, e in calls])
    return family.score(item, transcript)


def test_calc_tool_scorer_known_answers():
    right = _calc_case("Antwort: {answer}", [("rechner", "{expression}")])
    assert right.success and right.reward == 1.0
    wrong = _calc_case("Antwort: 1", [("rechner", "{expression}")])
    assert not wrong.success and wrong.components["tool_called"] == 1.0
    lucky = _calc_case("Antwort: {answer}", [])
    assert not lucky.success and lucky.components["correct"] == 1.0, "a right answer without the tool is not grounded"
    malformed = _calc_case("{expression} ist das Ergebnis", [("rechner", "{expression}")])
    assert not malformed.success and malformed.components["well_formed"] == 0.0


def test_calculator_tool_rejects_other_input():
    family = get_family("calc-tool")
    item = family.generate("train", 1, 0)[0]
    assert family.call_tool(item, {}, "rechner", {"ausdruck": "12 * 3"}) == "36"
    assert family.call_tool(item, {}, "rechner", {"ausdruck": "__import__('os')"}).startswith("Fehler")
    assert family.call_tool(item, {}, "shell", {}).startswith("Fehler")


def test_scripted_cases_match_the_reference_scorer():
    for name in ("calc-tool", "german-arith"):
        family = get_family(name)
        item = family.generate("train", 1, 3)[0]
        cases = family.scripted_cases(item)
        assert any(c["expected_success"] for c in cases) and not all(c["expected_success"] for c in cases)


def test_every_family_scores_its_scripted_cases_as_labelled():
    for family in families().values():
        for item in family.generate("train", 6, 11):
            for case in family.scripted_cases(item):
                score = play_scripted_case(family, item, case)
                assert score.success == case["expected_success"], (family.name, case["case"], score)
                assert 0.0 <= score.reward <= 1.0


def test_rag_known_answers():
    from qualification.tasks.german_rag import GermanRagCited

    family = GermanRagCited()
    items = family.generate("train", 40, 2)
    single = next(i for i in items if i.reference["kind"] == "single")
    abstain = next(i for i in items if i.reference["kind"] == "abstain")
    pid, answer = single.reference["passages"][0], single.reference["answer"]

    def score(item, text):
        return family.score(item, Transcript(final_text=text))

    right = score(single, f"Antwort: {answer} [{pid}]")
    assert right.success and right.reward == 1.0
    wrong_citation = score(single, f"Antwort: {answer} [D31-P1]")
    assert not wrong_citation.success and wrong_citation.components["correct"] == 1.0
    assert wrong_citation.components["citation_precision"] == 0.0 and 0 < wrong_citation.reward < right.reward
    wrong = score(single, f"Antwort: 1 Euro [{pid}]")
    assert not wrong.success and wrong.components["unsupported_claims"] == 1.0
    assert score(abstain, "Antwort: Keine Angabe in den Dokumenten.").success
    assert not score(abstain, "Antwort: 24 Monate [D00-P2]").success
    assert not score(single, "Antwort: Keine Angabe in den Dokumenten.").success
    assert score(single, answer).components["well_formed"] == 0.0


def test_business_comm_is_scored_on_the_final_state():
    from qualification.tasks.business_comm import BusinessComm

    family = BusinessComm()
    item = family.generate("train", 1, 4)[0]
    cases = {c["case"]: c for c in family.scripted_cases(item)}
    right = play_scripted_case(family, item, cases["correct"])
    informal = play_scripted_case(family, item, cases["informal-address"])
    assert right.success and right.reward == 1.0
    assert not informal.success and informal.components["booking"] == 1.0 and informal.components["formal_address"] == 0.0
    double = play_scripted_case(family, item, cases["double-booking"])
    assert double.components["no_double_booking"] == 0.0
    leak = play_scripted_case(family, item, cases["discloses-other-customer"])
    assert leak.components["no_disclosure"] == 0.0 and leak.components["recipient"] == 1.0


def test_new_families_keep_heldout_disjoint_and_are_labelled_synthetic():
    assert all(family.synthetic for family in families().values())
    # Families with a held-out split partition their question space; german-arith is a retention probe
    # over ~130 problems and has no held-out split.
    for name in ("calc-tool", "german-rag-cited", "business-comm"):
        family = get_family(name)
        assert exact_overlap(family.generate("train", 60, 1), family.generate("heldout", 30, 1)) == 0


def test_rag_three_passage_questions_need_every_citation():
    from qualification.tasks.german_rag import GermanRagCited

    family = GermanRagCited()
    item = next(i for i in family.generate("train", 200, 1) if len(i.reference["passages"]) == 3)
    cites = [f"[{p}]" for p in item.reference["passages"]]
    full = family.score(item, Transcript(final_text=f"Antwort: {item.reference['answer']} {' '.join(cites)}"))
    partial = family.score(item, Transcript(final_text=f"Antwort: {item.reference['answer']} {' '.join(cites[:2])}"))
    assert full.success and not partial.success
    assert abs(partial.components["citation_recall"] - 2 / 3) < 1e-9 and partial.components["citation_precision"] == 1.0


PLUGIN = '''
from qualification.tasks import Score, TaskItem, Transcript


class Echo:
    """A family from outside this project: repeat the word back."""

    name = "echo"
    scorer_version = 3
    synthetic = True
    system_prompt = "Repeat the word."
    tools = ()
    frozen_splits = {"train": (4, 1), "heldout": (4, 2)}

    def generate(self, split, n, seed):
        return [TaskItem(family=self.name, split=split, task_id=f"echo/{split}/{seed}/{i}",
                         question=f"word-{split}-{seed}-{i}", reference={"answer": f"word-{split}-{seed}-{i}"})
                for i in range(n)]

    def initial_state(self, item):
        return {}

    def call_tool(self, item, state, name, arguments):
        return "no tools"

    def score(self, item, transcript):
        ok = transcript.final_text.strip() == item.reference["answer"]
        return Score(reward=float(ok), success=ok, components={"exact": float(ok)}, outcome="success" if ok else "failure")

    def demonstration(self, item):
        return [{"role": "assistant", "content": item.reference["answer"]}]

    def scripted_cases(self, item):
        return [{"case": "right", "expected_success": True, "turns": [{"text": item.reference["answer"]}]},
                {"case": "mislabelled", "expected_success": BAD, "turns": [{"text": "nope"}]}]
'''


def _plugin_on_path(root: Path, mislabelled: bool) -> dict[str, str]:
    """A package with a runner.task_families entry point, importable through PYTHONPATH: the metadata
    importlib.metadata reads from an installed distribution (dist-info), without installing into our venv."""
    (root / "echo_tasks").mkdir(parents=True)
    (root / "echo_tasks" / "__init__.py").write_text(PLUGIN.replace("BAD", "True" if mislabelled else "False"))
    info = root / "echo_tasks-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-tasks\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[runner.task_families]\necho = echo_tasks:Echo\n")
    return {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"}


def test_a_family_from_another_package_is_found_by_its_entry_point_and_checked(tmp_path):
    runner = str(Path(sys.executable).parent / "runner")
    env = _plugin_on_path(tmp_path / "good", mislabelled=False)
    listed = json.loads(subprocess.run([runner, "tasks", "list", "--json"], env=env, capture_output=True, text=True,
                                       check=True).stdout)
    echo = next(row for row in listed if row["family"] == "echo")
    assert (echo["distribution"], echo["version"], echo["source"]) == ("echo-tasks", "0.3", "echo_tasks:Echo")
    assert echo["splits"]["train"]["n"] == 4 and len(echo["splits"]["heldout"]["sha256"]) == 64
    assert {"calc-tool", "german-arith"} <= {row["family"] for row in listed}  # ours, through the same group
    good = subprocess.run([runner, "tasks", "check", "echo", "--json"], env=env, capture_output=True, text=True)
    assert good.returncode == 0 and json.loads(good.stdout)["problems"] == []

    env = _plugin_on_path(tmp_path / "bad", mislabelled=True)
    bad = subprocess.run([runner, "tasks", "check", "echo", "-n", "2"], env=env, capture_output=True, text=True)
    assert bad.returncode == 1
    assert "echo/train/0/0/mislabelled: scored success=False, labelled True" in " ".join(bad.stderr.split())
    assert "Traceback" not in bad.stderr


def test_a_family_that_misses_part_of_the_interface_is_refused_by_name(tmp_path):
    env = _plugin_on_path(tmp_path, mislabelled=False)
    source = tmp_path / "echo_tasks" / "__init__.py"
    source.write_text(source.read_text().replace("    def scripted_cases(self, item):", "    def cases(self, item):"))
    result = subprocess.run([str(Path(sys.executable).parent / "runner"), "tasks", "check", "echo"], env=env,
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "task family 'echo' (echo_tasks:Echo) lacks scripted_cases" in " ".join(result.stderr.split())


FIRST_LOAD_RACE = r"""
import importlib.metadata, json, threading
from qualification.tasks import get_family

calls, real = [], importlib.metadata.entry_points
def counted(**kwargs):
    calls.append(kwargs)
    return real(**kwargs)
importlib.metadata.entry_points = counted
start, got = threading.Barrier(16), []
def episode():
    start.wait()
    got.append(get_family("calc-tool"))
threads = [threading.Thread(target=episode) for _ in range(16)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps({"instances": len({id(family) for family in got}), "lookups": len(calls)}))
"""


def test_episode_threads_asking_for_a_family_at_once_share_one_load():
    # A batch's episode threads all ask for their family when it starts: the first one loads it, the others
    # get that same instance rather than each reading the entry points and building their own.
    run = subprocess.run([sys.executable, "-c", FIRST_LOAD_RACE], capture_output=True, text=True, check=True)
    assert json.loads(run.stdout) == {"instances": 1, "lookups": 1}

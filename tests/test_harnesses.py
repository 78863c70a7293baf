"""Evaluation harnesses (plan `harnesses`): the host's audit of a harness's samples against the policy server's
calls, and Inspect AI (inspect_ai==0.3.285, its own environment) run by the evaluate stage on the base and the
trained checkpoint of a trl run, through the trainer's policy server on 127.0.0.1; with
RUNNER_TEST_ALL_HARNESSES=1 (`make test-harnesses`), lm-evaluation-harness (lm_eval==0.4.13) beside it.

Slow (the end-to-end tests only): the first run builds the inspect environment (~45 s); ~35 s after that."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qualification.gates import HarnessRun, harness_gates
from runner_contracts import HarnessSample, PolicyCall

ROOT = Path(__file__).resolve().parents[1]
RUNNER = str(Path(sys.executable).parent / "runner")
PLAN = ROOT / "examples" / "harnesses" / "plan.yaml"
PLAN_ALL = ROOT / "examples" / "harnesses" / "plan-all.yaml"


def samples(label: str, scores: list[float]) -> list[HarnessSample]:
    return [HarnessSample(policy=label, sample_id=f"s{i}", episode_id=f"{label}/e{i}", score=score)
            for i, score in enumerate(scores)]


def calls(episodes: list[str | None]) -> list[PolicyCall]:
    return [PolicyCall(call_id=f"{episode}#0", episode_id=episode, channel="header" if episode else "none",
                       endpoint="chat", index_in_episode=0, policy_revision="r", prompt_ids=[1], completion_ids=[2],
                       logprobs=[-0.1], finish_reason="stop") for episode in episodes]


def run(label: str, scores: list[float], *, value: float | None = None, episodes: list[str | None] | None = None,
        status: str = "success") -> HarnessRun:
    return HarnessRun(samples=samples(label, scores),
                      reported={"status": status, "metric": "accuracy", "samples": len(scores),
                                "value": sum(scores) / len(scores) if value is None else value},
                      calls=calls([f"{label}/e{i}" for i in range(len(scores))] if episodes is None else episodes))


def gates_of(runs: dict[str, HarnessRun]) -> tuple[dict[str, bool], dict]:
    checks, summary = harness_gates("inspect", runs, 0.95)
    return {gate.name.rsplit(":", 1)[1]: gate.passed for gate in checks}, summary


def test_a_harness_that_agrees_with_the_server_passes_and_is_paired():
    passed, summary = gates_of({"base": run("base", [0, 1, 1, 0]), "trained": run("trained", [1, 1, 1, 0])})
    assert passed == {"completed": True, "calls-attributed": True, "score-recomputed": True}
    assert summary["base"]["value"] == 0.5 and summary["trained"]["samples"] == 4
    assert (summary["paired"]["improved_pairs"], summary["paired"]["worsened_pairs"]) == (1, 0)


@pytest.mark.parametrize(("broken", "gate"), [
    (run("base", [0, 1], value=1.0), "score-recomputed"),  # a headline its samples do not give
    (run("base", [0, 1], episodes=["base/e0", "base/e1", None]), "calls-attributed"),  # a call naming no sample
    (run("base", [0, 1], episodes=["base/e0", "base/e1", "base/other"]), "calls-attributed"),  # a stray call
    (run("base", [0, 1], episodes=["base/e0"]), "calls-attributed"),  # a sample the server never served
    (run("base", [0, 1], status="error"), "completed"),
])
def test_a_harness_whose_files_disagree_fails_the_gate_that_says_so(broken, gate):
    passed, _ = gates_of({"base": broken, "trained": run("trained", [1, 1])})
    assert not passed[gate] and all(ok for name, ok in passed.items() if name != gate)


def qualified(plan: Path, run_dir: Path) -> list[dict]:
    """`runner qualify --stack trl --stages train,evaluate`: the evaluate stage's harness rows."""
    result = subprocess.run([RUNNER, "qualify", "--stack", "trl", "--plan", str(plan), "--stages", "train,evaluate",
                             "--run-dir", str(run_dir), "--json"], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "400"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((run_dir / "stages" / "evaluate" / "evidence.json").read_text())["metrics"]["harnesses"]


def scored(run_dir: Path, stack: str, label: str) -> list[dict]:
    path = run_dir / "stages" / "evaluate" / "harnesses" / stack / label / "harness.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_inspect_evaluates_the_base_and_trained_checkpoints_of_a_run(tmp_path):
    """`runner qualify --stack trl` with the plan's Inspect task: each checkpoint is served by the trl
    environment's policy server and Inspect's eval runs in the inspect environment; Inspect's own log, the
    per-sample records and the server's call log agree, and the report carries the headline with the paired
    verdict."""
    run_dir = tmp_path / "run"
    qualified(PLAN, run_dir)
    evidence = json.loads((run_dir / "stages" / "evaluate" / "evidence.json").read_text())
    gates = {gate["name"]: gate for gate in evidence["gates"] if gate["name"].startswith("harness:inspect:")}
    assert {"harness:inspect:no-foreign-packages", "harness:inspect:pins", "harness:inspect:completed",
            "harness:inspect:calls-attributed", "harness:inspect:score-recomputed"} <= set(gates)
    assert gates["harness:inspect:no-foreign-packages"]["detail"] == "no other stack's upstream and no torch installed"
    [row] = evidence["metrics"]["harnesses"]
    assert row["upstream"] == "inspect_ai==0.3.285" and row["task"] == "rechnen" and row["metric"] == "accuracy"
    folder = run_dir / "stages" / "evaluate" / "harnesses" / "inspect"
    for label in ("base", "trained"):
        log = json.loads((folder / label / row[label]["log"]).read_text())  # Inspect's own log, as it wrote it
        assert log["status"] == "success" and log["results"]["scores"][0]["metrics"]["accuracy"]["value"] == row[label]["value"]
        samples = scored(run_dir, "inspect", label)
        served = [json.loads(line) for line in (folder / label / "policy" / "calls.jsonl").read_text().splitlines()]
        assert len(samples) == row[label]["samples"] == 16
        assert {c["episode_id"] for c in served} == {s["episode_id"] for s in samples}
        assert all(c["channel"] == "header" and c["episode_id"].startswith(f"{label}/") for c in served)
    assert row["paired"]["n"] == 16 and row["paired"]["test"] == "exact McNemar (two-sided)"
    assert (run_dir / "harness-tasks" / f"inspect-{row['task_sha256'][:12]}" / "rechnen.jsonl").is_file()
    report = (run_dir / "report.md").read_text()
    assert "## Evaluation harnesses" in report and "| inspect (inspect_ai==0.3.285) | rechnen | accuracy |" in report
    assert "<h2>Evaluation harnesses</h2>" in (run_dir / "report.html").read_text()


@pytest.mark.slow
def test_lm_eval_beside_inspect_scores_the_same_problems_alike(tmp_path):
    """Both harnesses on the same 16 problems (an Inspect task and an lm_eval YAML task over one JSONL file),
    each in its own environment, against the same served checkpoints: lm_eval's own results file gives the
    headline, every request carried its episode id in the body, and each problem scores the same under both."""
    if not os.environ.get("RUNNER_TEST_ALL_HARNESSES"):
        pytest.skip("RUNNER_TEST_ALL_HARNESSES=1 (`make test-harnesses`) builds lm-evaluation-harness's environment "
                    "(~760 MB, ~1 min cold) and runs it beside Inspect: ~1.5 min more than CI's 60-minute budget "
                    "holds; the suite runs the harness machinery end to end with Inspect")
    run_dir = tmp_path / "run"
    rows = {row["stack"]: row for row in qualified(PLAN_ALL, run_dir)}
    lm = rows["lm-eval"]
    assert lm["upstream"] == "lm_eval==0.4.13" and (lm["task"], lm["metric"]) == ("rechnen", "exact_match")
    folder = run_dir / "stages" / "evaluate" / "harnesses" / "lm-eval"
    for label in ("base", "trained"):
        results = json.loads((folder / label / lm[label]["log"]).read_text())  # lm_eval's own results file
        assert results["results"]["rechnen"]["exact_match,strict"] == lm[label]["value"]
        served = [json.loads(line) for line in (folder / label / "policy" / "calls.jsonl").read_text().splitlines()]
        assert served and all(c["channel"] == "metadata" for c in served)
        by_problem = {int(s["sample_id"]): s["score"] for s in scored(run_dir, "lm-eval", label)}
        assert by_problem == {int(s["sample_id"][1:]): s["score"] for s in scored(run_dir, "inspect", label)}

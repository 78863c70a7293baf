"""Domain stacks (runner_contracts.domain): the host's audits of a domain stage's files, the domain plan's errors,
and, opt-in, the mace and lerobot stacks qualified end to end on their own CPU plans."""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qualification.gates.domain import case_gates, compare_models, data_gates, recompute, replay_gates
from runner_contracts import DataSplit, DomainPrediction, DomainStep, NativeMetric, sha256_path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = str(Path(sys.executable).parent / "runner")
MACE_PLAN = ROOT / "stacks" / "mace" / "plans" / "cpu.yaml"
LEROBOT_PLAN = ROOT / "stacks" / "lerobot" / "plans" / "cpu.yaml"
SHA = "a" * 64


def metric(name: str, recompute_rule: dict, value: float | None, *, model: str = "trained", direction: str = "lower",
           expected: float | None = None, items: int = 4) -> NativeMetric:
    return NativeMetric(model=model, split="heldout", name=name, value=value, items=items, direction=direction,
                        computed_by="test", recompute=recompute_rule, data_sha256=SHA, expected=expected)


def items(model: str, rows: list[dict[str, float]]) -> list[DomainPrediction]:
    return [DomainPrediction(model=model, split="heldout", item_id=f"i{n}", values=row) for n, row in enumerate(rows)]


def test_metrics_are_recomputed_from_the_per_item_values():
    rows = items("trained", [{"err": 0.1, "w": 1, "t": -0.1, "p": -0.2}, {"err": 0.3, "w": 3, "t": 0.2, "p": -0.1},
                             {"err": 0.2, "w": 1, "t": -0.3, "p": 0.1}, {"err": 0.0, "w": 1, "t": 0.4, "p": 0.5}])
    assert recompute(metric("mae", {"kind": "mean", "key": "err"}, 0.15), rows) == pytest.approx(0.15)
    assert recompute(metric("mae", {"kind": "mean", "key": "err", "weight": "w"}, 0), rows) == pytest.approx(1.2 / 6)
    stability = {"kind": "stability", "true": "t", "pred": "p", "threshold": 0.0}
    # true stable: i0, i2; predicted stable: i0, i1 -> TP 1, FP 1, FN 1, TN 1
    assert recompute(metric("f1", {**stability, "metric": "F1"}, 0), rows) == pytest.approx(0.5)
    assert recompute(metric("p", {**stability, "metric": "Precision"}, 0), rows) == pytest.approx(0.5)
    assert recompute(metric("a", {**stability, "metric": "Accuracy"}, 0), rows) == pytest.approx(0.5)
    nothing_right = items("trained", [{"t": -0.1, "p": 0.1}, {"t": 0.1, "p": -0.1}])
    assert recompute(metric("a", {**stability, "metric": "Accuracy"}, None), nothing_right) is None, \
        "Matbench Discovery's stable_metrics raises without a true positive: no metric is defined then"


def test_a_resumed_run_must_replay_order_losses_and_weights_bit_for_bit():
    def steps(*losses: float, order: str = "b" * 64) -> list[DomainStep]:
        return [DomainStep(step=n, loss=loss, items=8, order_sha256=order) for n, loss in enumerate(losses, start=1)]

    plain = steps(0.5, 0.4, 0.3)
    same = replay_gates(plain, steps(0.5, 0.41), steps(0.5, 0.4, 0.3), 1, "w", "w")
    assert all(g.passed for g in same), same
    drifted = {g.name: g for g in replay_gates(plain, steps(0.5), steps(0.5, 0.4, 0.30000001), 1, "w", "v")}
    assert not drifted["resume:same-steps"].passed and "[3]" in drifted["resume:same-steps"].detail
    assert not drifted["resume:same-final-weights"].passed
    reordered = replay_gates(plain, steps(0.5), steps(0.5, 0.4, 0.3, order="c" * 64), 1, "w", "w")
    assert not reordered[0].passed


def test_known_cases_fail_a_scorer_that_does_not_score_as_it_must():
    mean = {"kind": "mean", "key": "err"}
    good = [metric("mae", mean, 0.0, model="perfect"), metric("mae", mean, 0.1, model="broken", expected=0.1)]
    assert case_gates(good, 1e-6)[0].passed
    wrong = case_gates([metric("mae", mean, 0.0, model="perfect"), metric("mae", mean, 0.12, model="broken",
                                                                          expected=0.1)], 1e-6)[0]
    assert not wrong.passed and "broken mae: 0.12 (must be 0.1)" in wrong.detail
    f1 = {"kind": "stability", "metric": "F1", "true": "t", "pred": "p"}
    not_ideal = case_gates([metric("f1", f1, 0.9, model="perfect", direction="higher"), good[1]], 1e-6)[0]
    assert not not_ideal.passed and "perfect f1" in not_ideal.detail
    rate, ret = {"kind": "rate", "key": "success"}, {"kind": "mean", "key": "sum_reward"}
    rollouts = [metric("success_rate", rate, 1.0, model="perfect", direction="higher", expected=1.0),
                metric("mean_return", ret, -6.52, model="perfect", direction="higher", expected=-6.52),
                metric("success_rate", rate, 0.0, model="broken", direction="higher", expected=0.0)]
    assert case_gates(rollouts, 1e-6)[0].passed, "a return has no ideal value: only the expected one is checked"
    short = case_gates([metric("success_rate", rate, 0.97, model="perfect", direction="higher"), *rollouts[1:]], 1e-6)[0]
    assert not short.passed and "perfect success_rate: 0.97" in short.detail


def test_a_split_may_be_a_dataset_folder_hashed_file_by_file(tmp_path):
    """A LeRobot dataset is a folder (parquet files and meta/): its sha256 covers every file's path and bytes."""
    dataset = tmp_path / "train"
    (dataset / "meta").mkdir(parents=True)
    (dataset / "meta" / "info.json").write_text('{"fps": 50}')
    (dataset / "data.parquet").write_bytes(b"PAR1")
    manifest = [DataSplit(split="train", path="train", items=2, sha256=sha256_path(dataset), generator="test")]
    gates, hashes = data_gates("service", manifest, tmp_path)
    assert gates[0].passed and hashes == {"train": manifest[0].sha256}
    (dataset / "meta" / "info.json").rename(dataset / "info.json")  # same bytes, another place
    assert not data_gates("service", manifest, tmp_path)[0][0].passed
    (dataset / "info.json").rename(dataset / "meta" / "info.json")
    (dataset / "data.parquet").write_bytes(b"PAR2")
    moved = data_gates("service", manifest, tmp_path)[0][0]
    assert not moved.passed and "['train']" in moved.detail


def test_base_against_trained_reads_the_paired_interval_in_the_metrics_direction():
    mean = metric("mae", {"kind": "mean", "key": "err"}, None, items=40)
    base = items("base", [{"err": 0.30 + 0.01 * (n % 5)} for n in range(40)])
    better = items("trained", [{"err": 0.10 + 0.01 * (n % 3)} for n in range(40)])
    row = compare_models("mae", "lower", base, better, mean, 0.95)
    assert row["verdict"] == "improved" and row["difference"] < 0 and row["difference_interval"][1] < 0
    assert row["base"]["interval"][0] <= row["base"]["value"] <= row["base"]["interval"][1]
    assert row["p_value"] < 0.001 and "Wilcoxon" in row["test"]
    assert compare_models("mae", "higher", base, better, mean, 0.95)["verdict"] == "regressed"
    assert compare_models("mae", "lower", base, items("trained", [r.values for r in base]), mean, 0.95)["verdict"] \
        == "inconclusive"


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([RUNNER, *args], capture_output=True, text=True, timeout=timeout)


def test_a_domain_plan_and_a_stack_must_go_together(tmp_path):
    wrong_stack = run_cli("qualify", "--stack", "trl", "--plan", str(MACE_PLAN), "--run-dir", str(tmp_path / "a"))
    assert wrong_stack.returncode == 2 and "is a domain plan (domain: mace)" in wrong_stack.stderr
    lm_plan = ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"
    wrong_plan = run_cli("qualify", "--stack", "mace", "--plan", str(lm_plan), "--run-dir", str(tmp_path / "b"))
    assert wrong_plan.returncode == 2 and "the mace stack is a domain stack" in wrong_plan.stderr
    assert "Traceback" not in wrong_stack.stderr + wrong_plan.stderr
    listed = json.loads(run_cli("stacks", "list", "--json").stdout)
    assert {row["name"]: row["kind"] for row in listed if row["name"] in ("mace", "lerobot")} == \
        {"mace": "domain", "lerobot": "domain"}


@pytest.mark.parametrize(("change", "message"), [
    (lambda p: p.update(domain="trl"), "field domain: 'trl' is not a domain stack"),
    (lambda p: p["budget"].update(steps=0), "budget.steps"),
    (lambda p: p["data"].update(colour="blue"), "data.colour"),
    (lambda p: p["gates"].update(resume_kill_after_step=3), "must be below gates.resume_steps"),
])
def test_a_bad_domain_plan_is_named_by_file_line_and_field(tmp_path, change, message):
    plan = yaml.safe_load(MACE_PLAN.read_text())
    change(plan)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    result = run_cli("qualify", "--stack", "mace", "--plan", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and message in result.stderr and f"{path}:" in result.stderr, result.stderr
    assert not (tmp_path / "run" / "stages").exists()


def qualified_on_every_stage(stack: str, plan: Path, run_dir: Path) -> dict:
    """`runner qualify` on every stage: its JSON summary, once every gate passed, the resume replayed bit for bit
    and the probe found no other stack's upstream in the environment."""
    result = run_cli("qualify", "--stack", stack, "--plan", str(plan), "--run-dir", str(run_dir), "--json",
                     timeout=1800)  # with the environment's build, cold
    summary = json.loads(result.stdout)
    assert result.returncode == 0, f"{summary['failed_gates']} {summary['errors']}"
    assert summary["stages"] == dict.fromkeys(["probe", "service", "update", "resume", "train", "evaluate"], "passed")
    gates = {g["name"]: g["passed"] for stage in ("probe", "resume")
             for g in json.loads((run_dir / "stages" / stage / "evidence.json").read_text())["gates"]}
    assert gates["resume:same-final-weights"] and gates["probe:no-foreign-packages"]
    return summary


@pytest.mark.slow
def test_mace_qualifies_on_its_cpu_plan_with_native_metrics_and_a_bit_identical_resume(tmp_path):
    """The mace stack's own CPU plan, every stage, in its own environment (mace-torch on CPU torch)."""
    if not os.environ.get("RUNNER_TEST_ALL_DOMAINS"):
        pytest.skip("RUNNER_TEST_ALL_DOMAINS=1 (`make test-domains`) builds the mace environment (torch, mace-torch: "
                    "~1.5 GB, ~1 min cold) and qualifies it on its CPU plan (~3 min on 2 cores): more than CI's "
                    "60-minute budget holds; the suite checks the domain gates, plans and reports without it")
    run_dir = tmp_path / "run"
    summary = qualified_on_every_stage("mace", MACE_PLAN, run_dir)
    native = summary["native"]
    assert {"energy_mae_per_atom", "force_mae", "stability_f1"} <= set(native)
    headline = native["energy_mae_per_atom"]
    assert headline["trained"]["interval"][0] <= headline["trained"]["value"] <= headline["trained"]["interval"][1]
    report = (run_dir / "report.md").read_text()
    assert "## Native metrics" in report and "The data is synthetic" in report
    files = [run_dir / "plan.json", run_dir / "data" / "data.jsonl", run_dir / "stages" / "train" / "steps.jsonl",
             run_dir / "stages" / "evaluate" / "predictions.jsonl", run_dir / "stages" / "evaluate" / "metrics.jsonl"]
    smaller = yaml.safe_load(MACE_PLAN.read_text())
    smaller["model"]["options"]["num_channels"] = 8  # a second model size, set beside the first
    smaller_plan = tmp_path / "smaller.yaml"
    smaller_plan.write_text(yaml.safe_dump(smaller, sort_keys=False))
    second = run_cli("qualify", "--stack", "mace", "--plan", str(smaller_plan), "--run-dir", str(tmp_path / "small"),
                     "--stages", "probe,train,evaluate", "--json")
    assert second.returncode == 0, second.stdout[-2000:]
    beside = run_cli("report", str(run_dir), "--beside", str(tmp_path / "small"), "--json")
    rows = json.loads(beside.stdout)
    assert beside.returncode == 0 and [row["run"] for row in rows] == ["run", "small"]
    assert rows[0]["plan_id"] != rows[1]["plan_id"] and all("energy_mae_per_atom" in row["native"] for row in rows)
    assert "'num_channels': 8" in html.unescape((run_dir / "side-by-side.html").read_text())
    validated = run_cli("validate", *map(str, files), "--json")
    assert validated.returncode == 0 and [r["contract"] for r in json.loads(validated.stdout)] == [
        "DomainPlan", "DataSplit", "DomainStep", "DomainPrediction", "NativeMetric"], validated.stdout


@pytest.mark.slow
def test_lerobot_qualifies_on_its_cpu_plan_with_rollout_metrics_and_a_bit_identical_resume(tmp_path):
    """The lerobot stack's own CPU plan, every stage, in its own environment (lerobot 0.4.4, MuJoCo's Reacher)."""
    if not os.environ.get("RUNNER_TEST_ALL_DOMAINS"):
        pytest.skip("RUNNER_TEST_ALL_DOMAINS=1 (`make test-domains`) builds the lerobot environment (lerobot and "
                    "PyPI's CUDA build of torch 2.9.1: ~8 GB, several minutes cold) and qualifies it on its CPU "
                    "plan (~3 min on 2 cores): more than CI's 60-minute budget holds")
    run_dir = tmp_path / "run"
    summary = qualified_on_every_stage("lerobot", LEROBOT_PLAN, run_dir)
    service = json.loads((run_dir / "stages" / "service" / "evidence.json").read_text())
    cases = service["metrics"]["cases"]
    assert cases["perfect"]["success_rate"] == {"value": 1.0, "expected": 1.0}
    assert cases["broken"]["success_rate"]["value"] == cases["broken"]["success_rate"]["expected"]
    headline = summary["native"]["success_rate"]
    assert headline["verdict"] == "improved", headline
    assert headline["trained"]["interval"][0] <= headline["trained"]["value"] <= headline["trained"]["interval"][1]
    assert (run_dir / "data" / "train" / "meta" / "info.json").is_file(), "the training split is a LeRobot dataset"
    validated = run_cli("validate", str(run_dir / "data" / "data.jsonl"),
                        str(run_dir / "stages" / "evaluate" / "metrics.jsonl"), "--json")
    assert validated.returncode == 0, validated.stdout


@pytest.mark.parametrize(("stack", "plan"), [("mace", MACE_PLAN), ("lerobot", LEROBOT_PLAN)])
def test_a_domain_arm_renders_as_a_slurm_job_whose_frozen_plan_reads_back_to_the_same_id(tmp_path, stack, plan):
    run_dir = tmp_path / "run"
    result = run_cli("qualify", "--stack", stack, "--plan", str(plan), "--executor", "slurm", "--cluster",
                     str(ROOT / "clusters" / "example-h100.toml"), "--dry-run", "--run-dir", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr
    script = (run_dir / "slurm" / f"{stack}.sbatch").read_text()
    assert f"qualify --stack {stack} --plan {run_dir / 'plan.json'}" in script
    frozen = json.loads((run_dir / "plan.json").read_text())
    assert frozen["contract"] == "domain-plan" and frozen["gates"]["metric_tolerance"] == 1e-06
    from runner._plan import load_plan
    from runner._policy import resolve_policy

    assert resolve_policy(load_plan(run_dir / "plan.json"), None).plan_id == frozen["plan_id"]


@pytest.mark.slow
@pytest.mark.parametrize(("stack", "plan", "cold"), [("mace", MACE_PLAN, "~2 min"), ("lerobot", LEROBOT_PLAN, "~8 min, 8 GB")])
def test_a_domain_stack_qualifies_in_its_docker_image_to_the_same_weights(request, tmp_path, stack, plan, cold):
    """The same plan in the stack's image (real Docker Engine, started by the test): every gate, and the final
    weights the local engine's run trains (measured for both: identical, Python 3.11.2 in the image, 3.11.7 here)."""
    if not os.environ.get("RUNNER_TEST_ALL_DOMAINS"):
        pytest.skip(f"RUNNER_TEST_ALL_DOMAINS=1 (`make test-domains`) builds the {stack} image ({cold} cold) and "
                    "qualifies it there: more than CI's 60-minute budget holds")
    from container_daemons import copy_stacks

    url = request.getfixturevalue("docker_engine")  # started only when the test is opted in
    stacks = copy_stacks(tmp_path / "stacks")  # building records the image's digest in pins.json
    runs = {}
    for engine in ("docker", "local"):
        run_dir = tmp_path / engine
        result = subprocess.run([RUNNER, "qualify", "--stack", stack, "--plan", str(plan), "--engine", engine,
                                 "--stages", "probe,train", "--run-dir", str(run_dir), "--json"],
                                capture_output=True, text=True, timeout=1800,
                                env={**os.environ, "DOCKER_HOST": url, "RUNNER_STACKS_DIR": str(stacks)})
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        runs[engine] = json.loads((run_dir / "stages" / "train" / "evidence.json").read_text())
    probe = json.loads((tmp_path / "docker" / "stages" / "probe" / "evidence.json").read_text())
    assert probe["environment"]["engine"] == "docker" and probe["environment"]["image"].startswith(f"runner-{stack}:")
    assert runs["docker"]["checkpoints"] == runs["local"]["checkpoints"]

"""End to end on the real trl==1.16.0 stack (CPU, tiny policy): what `make demo` does, audited on the trl
arm of the session's comparison, plus a failing plan, the SFT recipe and the programme tracks.

Slow: the first run builds the trl environment (~1.5 min) and the tiny policy (~4 min); both are
cached under RUNNER_CACHE_DIR (default ~/.cache/runner) and reused afterwards.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import CALC_PLAN

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"
RUNNER = str(Path(sys.executable).parent / "runner")

pytestmark = pytest.mark.slow


def runner(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    result = subprocess.run([RUNNER, *args], capture_output=True, text=True, env={
        **__import__("os").environ, "COLUMNS": "400"})
    if check and result.returncode != 0:
        raise AssertionError(f"runner {' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def demo_run(local_comparison) -> Path:
    """The trl arm of the session's comparison (what `make demo` runs, on the demo plan at half its sizes):
    one run of the arm serves every test here instead of a second qualification."""
    return local_comparison[0] / "arms" / "trl"


def test_every_stage_passes(demo_run):
    summary = json.loads((demo_run / "summary.json").read_text())
    assert summary["stages"] == {s: "passed" for s in
                                 ("probe", "service", "rollout", "update", "resume", "train", "evaluate")}
    assert summary["max_logprob_gap"] <= 1e-3
    for split in ("heldout", "retention"):
        assert summary["evaluation"][split]["verdict"] in ("improved", "inconclusive", "regressed")
    evidence = json.loads((demo_run / "stages" / "probe" / "evidence.json").read_text())
    assert evidence["environment"]["upstream"] == {"name": "trl", "version": "1.16.0", "git_revision": None}
    assert evidence["environment"]["packages"]["torch"].startswith("2.13.0")
    assert "Gates" in (demo_run / "report.md").read_text()


def test_rollout_is_real_multi_turn_tool_use(demo_run):
    gates = {g["name"]: g for g in json.loads((demo_run / "stages" / "rollout" / "evidence.json").read_text())["gates"]}
    assert gates["signal:tool-calls"]["measured"] > 0.5
    assert gates["signal:reward-variance"]["passed"]
    first = json.loads((demo_run / "stages" / "rollout" / "trajectories.jsonl").read_text().splitlines()[0])
    sources = [s["source"] for s in first["segments"]]
    assert sources[:3] == ["prompt", "policy", "tool"], sources


def test_validate_accepts_demo_output_and_rejects_corruption(demo_run, tmp_path):
    files = [demo_run / "stages" / stage / name for stage in ("rollout", "train")
             for name in ("trajectories.jsonl", "training.jsonl")]
    assert runner("validate", *map(str, files)).returncode == 0
    bad = tmp_path / "trajectories.jsonl"
    shutil.copy(files[0], bad)
    lines = bad.read_text().splitlines(keepends=True)
    record = json.loads(lines[2])
    record["segments"][1]["logprobs"].append(-0.5)
    lines[2] = json.dumps(record) + "\n"
    bad.write_text("".join(lines))
    result = runner("validate", str(bad))
    assert result.returncode == 1
    assert f"{bad}:3: segments[1].logprobs" in result.stderr.replace("\n", "")


def test_second_run_reuses_environment_and_policy(demo_run, tmp_path):
    result = runner("qualify", "--stack", "trl", "--plan", str(CALC_PLAN), "--stages", "probe",
                    "--run-dir", str(tmp_path / "again"))
    assert result.returncode == 0, result.stderr
    assert "reusing trl environment" in result.stderr and "building" not in result.stderr
    first = json.loads((demo_run / "plan.json").read_text())
    second = json.loads((tmp_path / "again" / "plan.json").read_text())
    assert first["plan_id"] == second["plan_id"] and first["policy"]["sha256"] == second["policy"]["sha256"]


def test_failed_gate_stops_the_arm_and_keeps_evidence(tmp_path):
    # Sampling this hot, the warm-started policy never succeeds: no reward variance, nothing to learn.
    plan = tmp_path / "hot.yaml"
    plan.write_text(PLAN.read_text().replace("temperature: 1.3", "temperature: 8.0"))
    run_dir = tmp_path / "hot"
    result = runner("qualify", "--stack", "trl", "--plan", str(plan), "--run-dir", str(run_dir), "--json")
    assert result.returncode == 1
    summary = json.loads(result.stdout)
    assert summary["stages"]["rollout"] == "failed"
    assert "rollout:signal:reward-variance" in summary["failed_gates"]
    assert all(summary["stages"][s] == "skipped" for s in ("update", "resume", "train", "evaluate"))
    evidence = json.loads((run_dir / "stages" / "rollout" / "evidence.json").read_text())
    assert any(a["path"].endswith("trajectories.jsonl") and a["records"] > 0 for a in evidence["artifacts"])


def test_tiny_policy_is_deterministic(tmp_path):
    digests = []
    for name in ("a", "b"):
        result = runner("policy", "tiny", "--out", str(tmp_path / name), "--sft-steps", "4", "--rebuild", "--json")
        assert result.returncode == 0, result.stderr
        digests.append(json.loads(result.stdout)["sha256"])
    assert digests[0] == digests[1]


def test_each_plan_seed_is_a_trial_and_the_evaluation_pools_them(tmp_path):
    """seeds: [7, 8] trains and evaluates twice, the second trial sampling with seed 8 under seeds/seed-8;
    evaluation: {attempts: 2} adds two sampled attempts per item (pass@1, pass^2); the report pools both
    trials' paired outcomes and lists each seed; --resume keeps both."""
    plan = tmp_path / "seeds.yaml"
    plan.write_text(PLAN.read_text().replace("seeds: [7]", "seeds: [7, 8]").replace("  steps: 8\n", "  steps: 2\n")
                    .replace("resume_steps: 3", "resume_steps: 2").replace("n: 48, seed: 2", "n: 8, seed: 2")
                    .replace("n: 48, seed: 3", "n: 8, seed: 3") + "evaluation: {attempts: 2}\n")
    run_dir = tmp_path / "run"
    args = ("qualify", "--stack", "trl", "--plan", str(plan), "--stages", "train,evaluate", "--run-dir", str(run_dir),
            "--json")
    summary = json.loads(runner(*args, check=True).stdout)
    assert [(row["seed"], row["stages"]) for row in summary["seeds"]] == [
        (seed, {"train": "passed", "evaluate": "passed"}) for seed in (7, 8)]
    trial = run_dir / "seeds" / "seed-8" / "stages"
    requests = [json.loads((folder / "train" / "request.json").read_text()) for folder in (run_dir / "stages", trial)]
    assert [r["plan"]["sampling"]["seed"] for r in requests] == [7, 8]
    completions = [[line for line in (folder / "train" / "trajectories.jsonl").read_text().splitlines()]
                   for folder in (run_dir / "stages", trial)]
    assert completions[0] != completions[1], "the second trial samples with its own seed"
    heldout = summary["evaluation"]["heldout"]
    assert heldout["seeds"] == 2 and heldout["n"] == 16 and "2 repeats pooled" in heldout["test"]
    assert len(heldout["trained_per_seed"]) == 2
    sampled = heldout["sampled"]
    assert sampled["attempts"] == 2 and sampled["items"] + sampled["excluded_items"] == 16
    assert set(sampled["trained"]["pass^k"]) == {"1", "2"}
    assert sampled["trained"]["pass^k"]["2"] <= sampled["trained"]["pass^k"]["1"] == sampled["trained"]["pass@1"]
    records = [json.loads(line) for line in (trial / "evaluate" / "eval.jsonl").read_text().splitlines()]
    assert sorted({(r["decoding"], r["attempt"]) for r in records}) == [("greedy", 0), ("sampled", 0), ("sampled", 1)]
    assert "## Sampled evaluation" in (run_dir / "report.md").read_text()
    assert "## Seeds" in (run_dir / "report.md").read_text() and "<h2>Seeds</h2>" in (run_dir / "report.html").read_text()
    kept = (trial / "evaluate" / "evidence.json").read_bytes()
    again = json.loads(runner(*args, "--resume", check=True).stdout)
    assert again["passed"] and (trial / "evaluate" / "evidence.json").read_bytes() == kept


def test_sft_recipe_passes_every_gate(tmp_path):
    plan = ROOT / "qualification" / "plans" / "calc-tool-sft-cpu.yaml"
    result = runner("qualify", "--stack", "trl", "--plan", str(plan), "--run-dir", str(tmp_path / "sft"), "--json")
    summary = json.loads(result.stdout)
    assert result.returncode == 0, f"{summary['failed_gates']} {summary['errors']}"
    assert summary["stages"] == {s: "passed" for s in ("probe", "service", "update", "resume", "train", "evaluate")}
    update = json.loads((tmp_path / "sft" / "stages" / "update" / "evidence.json").read_text())
    gates = {g["name"]: g for g in update["gates"]}
    assert gates["sft:mask-equals-targets"]["passed"] and gates["update:weights-changed"]["passed"]
    assert update["metrics"]["trained_tokens"] > 0


# One warm start for both tracks, a quarter of theirs (150 steps on 600 demonstrations per family instead of
# 600 on 1500): the tracks' own recipes take ~10 min each on 2 cores, and this one still calls tools and
# varies in reward on both. The tracks' plans are otherwise used as they are.
TRACKS_WARM_START = {"seed": 0, "families": ["german-rag-cited", "business-comm", "german-arith"], "sft_steps": 150,
                     "sft_batch_size": 16, "demos_per_family": 600}


@pytest.mark.parametrize("plan_name", ["german-rag-cited-cpu", "business-comm-cpu"])
def test_trl_qualifies_on_the_programme_tracks(plan_name, tmp_path):
    """The synthetic RAG and business-communication tracks, on a tiny policy warm-started on both, through
    the stages that exercise the track (its tools, scorer and multi-turn loop in the service stage; a sampled
    batch with tool calls and reward variance; two GRPO steps with the trace audit). Training to the end and
    the held-out verdict are the same code for every track: the session's comparison covers them."""
    plan = yaml.safe_load((ROOT / "qualification" / "plans" / f"{plan_name}.yaml").read_text())
    plan["policy"]["tiny"] = TRACKS_WARM_START
    plan_file = tmp_path / f"{plan_name}.yaml"
    plan_file.write_text(yaml.safe_dump(plan, sort_keys=False))
    run_dir = tmp_path / plan_name
    stages = ("probe", "service", "rollout", "update")
    result = runner("qualify", "--stack", "trl", "--plan", str(plan_file), "--stages", ",".join(stages),
                    "--run-dir", str(run_dir), "--json")
    summary = json.loads(result.stdout)
    assert result.returncode == 0, f"{summary['failed_gates']} {summary['errors']}"
    assert summary["stages"] == {stage: "passed" for stage in stages}
    rollout = json.loads((run_dir / "stages" / "rollout" / "evidence.json").read_text())
    gates = {g["name"]: g["passed"] for g in rollout["gates"]}
    assert gates["signal:tool-calls"] and gates["trace:trained-equals-sampled"], gates
    assert "Gate matrix" in (run_dir / "report.html").read_text()


def test_a_bundle_of_the_run_verifies_and_a_tampered_or_added_file_is_named(demo_run, tmp_path):
    bundle = tmp_path / "bundle"
    made = runner("bundle", str(demo_run), "--out", str(bundle), "--json", check=True)
    assert json.loads(made.stdout)["qualified"] is True
    card = (bundle / "README.md").read_text()
    assert card.startswith("---\n") and "model-index:" in card and "split: heldout" in card
    assert "Qualified: every gate of the plan passed." in card
    assert (bundle / "model.safetensors").is_file() and not (bundle / "optimizer.pt").exists()
    assert runner("bundle", "verify", str(bundle)).returncode == 0
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=bundle).returncode == 0
    with open(bundle / "model.safetensors", "r+b") as weights:
        weights.seek(-1, 2)
        last = weights.read(1)
        weights.seek(-1, 2)
        weights.write(bytes([last[0] ^ 1]))
    (bundle / "notes.txt").write_text("added later\n")
    checked = runner("bundle", "verify", str(bundle), "--json")
    problems = json.loads(checked.stdout)["problems"]
    assert checked.returncode == 1
    assert any("model.safetensors: sha256" in p and "differs from SHA256SUMS" in p for p in problems), problems
    assert any("model.safetensors: not a checkpoint the train stage's evidence records" in p for p in problems)
    assert any("notes.txt: not in SHA256SUMS" in p for p in problems), problems


def test_a_run_that_did_not_qualify_is_bundled_only_when_asked_and_says_so(demo_run, tmp_path):
    run = Path(shutil.copytree(demo_run, tmp_path / "run", ignore=shutil.ignore_patterns("*.log")))
    summary = json.loads((run / "summary.json").read_text())
    summary["stages"]["evaluate"] = "failed"
    (run / "summary.json").write_text(json.dumps(summary))
    refused = runner("bundle", str(run), "--out", str(tmp_path / "b"))
    assert refused.returncode == 2 and "not every gate passed (evaluate: failed)" in refused.stderr
    assert not (tmp_path / "b").exists()
    made = runner("bundle", str(run), "--out", str(tmp_path / "b"), "--allow-failed", check=True)
    assert "not qualified" in made.stdout
    assert "**Not qualified**: bundled with --allow-failed; failed: evaluate: failed" in (tmp_path / "b" / "README.md").read_text()

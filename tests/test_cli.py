"""The small CLI commands: JSON output for scripts, one-line errors for bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runner.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, list(args), env={"COLUMNS": "300"})


def test_stacks_list_json_reads_the_manifests():
    result = invoke("stacks", "list", "--json")
    assert result.exit_code == 0
    stacks = {row["name"]: row for row in json.loads(result.output)}
    assert stacks["trl"]["upstream"] == "trl==1.16.0" and stacks["trl"]["python"] == "3.11"
    assert len(stacks["trl"]["lock_sha256"]) == 64


def test_tasks_list_json_has_hashed_frozen_splits():
    result = invoke("tasks", "list", "--json")
    assert result.exit_code == 0
    families = {row["family"]: row for row in json.loads(result.output)}
    assert set(families) == {"calc-tool", "german-arith", "german-rag-cited", "business-comm"}
    assert all(row["synthetic"] for row in families.values())
    assert len(families["german-rag-cited"]["splits"]["heldout"]["sha256"]) == 64
    again = {row["family"]: row for row in json.loads(invoke("tasks", "list", "--json").output)}
    assert again == families, "splits are frozen: same hashes every time"


def test_tasks_show_prints_items_and_demonstrations():
    result = invoke("tasks", "show", "german-rag-cited", "--split", "heldout", "-n", "2", "--json")
    items = json.loads(result.output)
    assert result.exit_code == 0 and len(items) == 2
    assert items[0]["demonstration"][-1]["content"].startswith("Antwort:")


def test_unknown_family_and_stack_are_one_line_errors(tmp_path):
    result = invoke("tasks", "show", "nope")
    assert result.exit_code == 2 and "unknown task family 'nope'" in result.output
    plan = tmp_path / "p.yaml"
    plan.write_text("name: x\n")
    result = invoke("qualify", "--stack", "nope", "--plan", str(plan))
    assert result.exit_code == 2 and "unknown stack 'nope'; known stacks:" in result.output and "trl" in result.output


def test_engine_and_executor_mistakes_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    plan = "qualification/plans/calc-tool-cpu.yaml"
    cases = [
        (("images", "list", "--engine", "docker"), "no docker engine answers at unix://"),
        (("qualify", "--stack", "trl", "--plan", plan, "--engine", "docker"), "no docker engine answers"),
        (("qualify", "--stack", "trl", "--plan", plan, "--engine", "kubernetes"), "available engines are local, docker"),
        (("qualify", "--stack", "trl", "--plan", plan, "--dry-run"), "--cluster and --dry-run belong to --executor slurm"),
        (("qualify", "--stack", "trl", "--plan", plan, "--engine", "local", "--image", "x"), "--image needs --engine docker"),
        (("qualify", "--stack", "trl", "--plan", plan, "--resume"), "--resume needs --run-dir"),
        (("qualify", "--stack", "trl", "--plan", plan, "--executor", "slurm", "--engine", "docker", "--image", "x"),
         "--image belongs to --executor local"),
        (("status", str(tmp_path)), "no slurm/jobs.json"),
        (("images", "export", "--stack", "trl", "--to", "zip"), "--to 'zip': expected sif, docker-archive or def"),
        (("compare", "--stacks", "trl,openenv", "--plan", plan, "--stages", "probe,warmup"),
         "--stages: unknown stage(s) warmup; stages are probe, service"),
    ]
    for args, message in cases:
        result = invoke(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in " ".join(result.output.split()), (args, result.output)
        assert "Traceback" not in result.output


@pytest.mark.slow  # freezing the plan builds the tiny policy (minutes in a cold cache)
def test_a_slurm_comparison_of_some_stages_puts_them_on_every_arms_run_line(tmp_path):
    """--stages reaches each arm's batch script (a dry run: written, not submitted); without it the arms
    run every stage and the line names none."""
    plan = "qualification/plans/calc-tool-cpu.yaml"
    for stages, expected in (("rollout,probe", "--stages probe,rollout"), (None, None)):
        target = tmp_path / (stages or "all")
        args = ["compare", "--stacks", "trl,openenv", "--plan", plan, "--executor", "slurm", "--dry-run",
                "--run-dir", str(target)] + (["--stages", stages] if stages else [])
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        for stack in ("trl", "openenv"):
            script = (target / "slurm" / f"{stack}.sbatch").read_text()
            run_line = next(line for line in script.splitlines() if line.startswith("exec "))
            assert f"--stack {stack}" in run_line
            assert (expected in run_line) if expected else ("--stages" not in run_line), run_line


def test_the_installed_command_loads_one_command_and_keeps_exit_codes_and_output(tmp_path):
    # `runner X` builds an app with X alone and ends without the interpreter's teardown: the exit code and
    # every line printed must survive both
    command = Path(sys.executable).parent / "runner"
    listed = subprocess.run([command, "stacks", "list", "--json"], capture_output=True, text=True)
    assert listed.returncode == 0 and "trl" in {row["name"] for row in json.loads(listed.stdout)}
    bad = tmp_path / "trajectories.jsonl"
    bad.write_text("{not json\n")
    invalid = subprocess.run([command, "validate", str(bad)], capture_output=True, text=True)
    assert invalid.returncode == 1 and f"{bad}:1" in invalid.stderr.replace("\n", "")
    refused = subprocess.run([command, "qualify", "--stack", "nope", "--plan", "x.yaml"], capture_output=True, text=True)
    assert refused.returncode == 2 and "unknown stack 'nope'" in refused.stderr
    unknown = subprocess.run([command, "qualfy"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "No such command 'qualfy'" in unknown.stderr
    overview = subprocess.run([command, "--help"], capture_output=True, text=True, env={"COLUMNS": "200", "PATH": ""})
    assert overview.returncode == 0
    assert all(name in overview.stdout for name in ("qualify", "compare", "validate", "stacks", "bundle", "cancel"))


def test_a_json_qualify_does_not_import_rich():
    """`runner qualify --json` prints JSON and no progress: its command module, executor, stages and report, with
    the quiet spinner and progress lines, leave rich unimported (~20 ms of every scripted command's start)."""
    code = ("import sys; from runner.cli import build_app; build_app('qualify'); "
            "from runner._console import progress, status; import runner._executors.local, runner._stages.probe; "
            "s = status('x', quiet=True); s.__enter__(); p = progress(quiet=True).__enter__(); "
            "p.update(p.add_task('x', total=1), completed=1); "
            "print(sorted(m for m in sys.modules if m == 'rich' or m.startswith('rich.')))")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"
    shown = subprocess.run([sys.executable, "-c", code.replace("quiet=True", "quiet=False")], capture_output=True,
                           text=True, check=True).stdout
    assert "rich.progress" in shown  # the same calls without --json do show progress

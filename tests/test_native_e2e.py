"""A team's own environment, qualified as it is, through `runner qualify` on the real stacks (CPU, tiny
policy): an OpenEnv MCP environment (openenv==0.10.0) over every stage, a SkyRL Gym env (skyrl-gym==0.4.0)
and a Verifiers taskset package (verifiers==0.4.0) over probe, service and rollout, a NeMo Gym
resources server (nemo-gym==0.7.0) and an OpenAI-SDK harness behind Agent Lightning 1.0.2's gateway on
probe and service; an asset from a package index; then broken assets of each kind, each refused on one
line with its stage's files kept.

Slow: each stack's environment and the tiny policy are built once per cache (shared with the rest of the
suite); the full openenv arm takes ~2.5 min on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "native"
RUNNER = str(Path(sys.executable).parent / "runner")
ALL_STAGES = ["probe", "service", "rollout", "update", "resume", "train", "evaluate"]
MACHINERY_STAGES = ["probe", "service", "rollout"]  # the asset's own code, the crash and the attribution

pytestmark = pytest.mark.slow


def qualify(stack: str, plan: Path, run_dir: Path, *stages: str) -> tuple[subprocess.CompletedProcess, dict]:
    args = [RUNNER, "qualify", "--stack", stack, "--plan", str(plan), "--run-dir", str(run_dir), "--json"]
    if stages:
        args += ["--stages", ",".join(stages)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=1800, env={**os.environ, "COLUMNS": "400"})
    assert "Traceback" not in result.stdout + result.stderr
    return result, json.loads((run_dir / "summary.json").read_text())


def evidence(run_dir: Path, stage: str) -> dict:
    return json.loads((run_dir / "stages" / stage / "evidence.json").read_text())


def gates(run_dir: Path, stage: str) -> dict[str, dict]:
    return {gate["name"]: gate for gate in evidence(run_dir, stage)["gates"]}


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def passed_run(stack: str, example: str, folder: Path, *stages: str) -> Path:
    run_dir = folder / stack
    result, _ = qualify(stack, EXAMPLES / example / "plan.yaml", run_dir, *stages)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def openenv_run(tmp_path_factory) -> Path:
    return passed_run("openenv", "openenv-rechner", tmp_path_factory.mktemp("native"))


@pytest.fixture(scope="module")
def skyrl_run(tmp_path_factory) -> Path:
    """The stages that exercise the env (its trainer side is the trl arm's, which openenv's full run covers;
    all seven stages passed in 82 s)."""
    return passed_run("skyrl-gym", "skyrl-rechnen", tmp_path_factory.mktemp("native"), *MACHINERY_STAGES)


@pytest.fixture(scope="module")
def verifiers_run(tmp_path_factory) -> Path:
    """The stages that exercise the asset (all seven stages passed by hand in 183 s)."""
    return passed_run("verifiers", "verifiers-rechner", tmp_path_factory.mktemp("native"), *MACHINERY_STAGES)


@pytest.mark.parametrize("arm", ["skyrl_run", "openenv_run", "verifiers_run"])
def test_a_native_asset_passes_every_gate_of_every_stage(arm, request):
    run_dir = request.getfixturevalue(arm)
    summary = json.loads((run_dir / "summary.json").read_text())
    ran = list(summary["stages"])
    assert summary["stages"] == dict.fromkeys(ran, "passed") and sorted(ran) in (sorted(ALL_STAGES),
                                                                                sorted(MACHINERY_STAGES))
    service = gates(run_dir, "service")
    assert "as its answer key says (reward from the environment's own reward; no reference scorer)" in \
        service["service:reward-equals-reference"]["detail"]
    assert "no reference scorer" in service["tasks:scorer-pinned"]["detail"]
    rollout = gates(run_dir, "rollout")
    for name in ("calls:attributed", "calls:policy-tokens-captured", "recovery:fault-injected",
                 "recovery:environment-restarted", "recovery:no-episode-lost"):
        assert rollout[name]["passed"], rollout[name]
    if "evaluate" in ran:
        verified = gates(run_dir, "evaluate")["evaluate:scores-verified"]
        assert verified["passed"] and "episodes of the native asset checked against its own reward" in verified["detail"]


def test_the_skyrl_env_steps_on_the_policys_text_and_its_feedback_is_not_trained(skyrl_run):
    """A wrong answer gets the env's feedback as a user turn and another policy turn: those feedback tokens
    sit between two policy segments with loss mask 0, and the episode's reward is the env's own."""
    episodes = lines(skyrl_run / "stages" / "rollout" / "trajectories.jsonl")
    assert {e["task_id"] for e in episodes} and all(e["reward"] in (0.0, 0.25, 0.5, 1.0) for e in episodes)
    multi = [e for e in episodes if sum(s["source"] == "policy" for s in e["segments"]) > 1]
    assert multi, "no episode got the env's feedback and a second turn"
    feedback = [s for s in multi[0]["segments"][1:-1] if s["source"] != "policy"]
    assert feedback and any("Versuche" in s["text"] or "Antworte" in s["text"] for s in feedback)
    rows = {row["episode_ids"][0]: row for row in lines(skyrl_run / "stages" / "rollout" / "training.jsonl")}
    row = rows[multi[0]["episode_id"]]
    policy_tokens = sum(len(s["token_ids"]) for s in multi[0]["segments"] if s["source"] == "policy")
    assert sum(row["loss_mask"]) == policy_tokens


def test_the_openenv_tools_and_answer_tool_ran_in_the_teams_environment(openenv_run):
    cases = {(c["task_id"], c["case"]): c for c in lines(openenv_run / "stages" / "service" / "service.jsonl")}
    tool_then_answer = next(c for (_, name), c in cases.items() if name == "tool-then-answer")
    assert tool_then_answer["tool_calls"][0]["name"] == "rechner" and tool_then_answer["tool_calls"][0]["result"] == "2"
    assert tool_then_answer["stack_reward"] == 1.0
    assert next(c for (_, name), c in cases.items() if name == "wrong-answer")["stack_reward"] == 0.0
    # The policy is offered the calculator, not the answer tool (a plain reply goes there).
    episodes = lines(openenv_run / "stages" / "rollout" / "trajectories.jsonl")
    prompt = episodes[0]["segments"][0]["text"]
    assert "rechner" in prompt and "submit_answer" not in prompt


def test_the_verifiers_taskset_ran_its_own_toolset_and_reward(verifiers_run):
    """The service cases ran the team's `rechner` tool in its own MCP server; in the rollout the episodes'
    rewards are the taskset's `correct` reward, recorded as a component under its own name, and the policy's
    tool calls were answered by the team's tool server."""
    cases = {c["case"]: c for c in lines(verifiers_run / "stages" / "service" / "service.jsonl")
             if c["task_id"] == "r000"}
    assert cases["tool-then-answer"]["tool_calls"][0]["result"] == "615"
    assert "kein Ausdruck" in cases["bad-expression"]["tool_calls"][0]["result"]
    assert cases["wrong-answer"]["stack_reward"] == 0.0 and cases["answer"]["stack_reward"] == 1.0
    episodes = lines(verifiers_run / "stages" / "rollout" / "trajectories.jsonl")
    assert all(set(e["reward_components"]) == {"correct"} and e["reward"] == e["reward_components"]["correct"]
               for e in episodes)
    assert any(len([s for s in e["segments"] if s["source"] == "policy"]) > 1 for e in episodes)
    log = (verifiers_run / "service" / "verifiers-native-envserver.log").read_text()  # the rollout service's
    assert "taskset=rechner_vf" in log


def test_a_team_harness_runs_unmodified_behind_the_gateway(tmp_path):
    run_dir = tmp_path / "lightning"
    result, summary = qualify("lightning-verl", EXAMPLES / "lightning-harness" / "plan.yaml", run_dir,
                              "probe", "service")
    assert result.returncode == 0, result.stdout[-3000:]
    service = gates(run_dir, "service")
    assert all(gate["passed"] for gate in service.values()), service
    calls = lines(run_dir / "stages" / "service" / "service-calls.jsonl")
    second_try = [c for c in calls if c["episode_id"].endswith("/second-try")]
    assert len(second_try) == 4  # two rows, two model calls each: the harness's own retry loop


def test_a_nemo_gym_resources_server_runs_as_it_is(tmp_path):
    run_dir = tmp_path / "nemo-gym"
    result, summary = qualify("nemo-gym", EXAMPLES / "nemo-gym-rechner" / "plan.yaml", run_dir, "probe", "service")
    assert result.returncode == 0, result.stdout[-3000:]
    cases = {c["case"]: c for c in lines(run_dir / "stages" / "service" / "service.jsonl")}
    assert cases["tool-then-answer"]["tool_calls"][0] == {"name": "rechner", "arguments": {"ausdruck": "1 + 1"},
                                                          "result": "2"}
    assert cases["tool-then-answer"]["stack_reward"] == 1.0 and cases["tool-call-last"]["stack_reward"] == 0.0


def test_an_asset_from_the_package_index_runs_as_one_by_path_does(tmp_path, monkeypatch):
    """The SkyRL example published as a wheel to a local index (PIP_FIND_LINKS) and named by its pinned
    requirement and hashed lock: the stack's jobs import it from the built folder, and the service stage
    scores its answer key."""
    from test_native import index_asset

    asset = Path(shutil.copytree(EXAMPLES / "skyrl-rechnen", tmp_path / "asset", ignore=shutil.ignore_patterns("__pycache__")))
    plan = index_asset(asset, tmp_path, monkeypatch)
    shutil.rmtree(asset)  # nothing is read from the source tree
    run_dir = tmp_path / "run"
    result, summary = qualify("skyrl-gym", plan, run_dir, "probe", "service")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "runner-test-rechnen-env==0.1.0 from the index" in " ".join(result.stdout.split())
    cases = {c["case"]: c for c in lines(run_dir / "stages" / "service" / "service.jsonl")
             if json.loads(c["item"])["family"] == "rechnen"}
    assert cases["correct"]["stack_reward"] == 1.0 and cases["wrong-then-correct"]["stack_reward"] == 0.5


def broken_copy(example: str, tmp_path: Path, path: str, old: str, new: str) -> Path:
    folder = Path(shutil.copytree(EXAMPLES / example, tmp_path / example, ignore=shutil.ignore_patterns("__pycache__")))
    target = folder / path
    text = target.read_text()
    assert old in text
    target.write_text(text.replace(old, new, 1))
    return folder / "plan.yaml"


@pytest.mark.parametrize(("stack", "example", "path", "old", "new", "message"), [
    ("skyrl-gym", "skyrl-rechnen", "src/rechnen_env/__init__.py", "from skyrl_gym.envs import register",
     "from skyrl_gym.envs import register\nimport rechnen_helpers",
     "native asset: importing rechnen_env failed: ModuleNotFoundError: No module named 'rechnen_helpers'"),
    ("skyrl-gym", "skyrl-rechnen", "src/rechnen_env/__init__.py", 'register(id="rechnen"', 'register(id="rechnen2"',
     "native asset: skyrl-gym has no env 'rechnen' registered after importing rechnen_env"),
    ("openenv", "openenv-rechner", "plan.yaml", "env: rechner_env:RechnerEnvironment", "env: rechner_env:RechnerState",
     "native asset: rechner_env:RechnerState is not an openenv MCPEnvironment subclass"),
    ("lightning-verl", "lightning-harness", "plan.yaml", "env: rechen_agent.agent:solve", "env: rechen_agent.agent:solved",
     "native asset: importing rechen_agent.agent:solved failed: AttributeError"),
    ("nemo-gym", "nemo-gym-rechner", "plan.yaml", "env: rechner_gym.app:RechnerResourcesServer",
     "env: rechner_gym.app:RechnerRequest", "native asset: rechner_gym.app:RechnerRequest is not a nemo_gym "
                                            "SimpleResourcesServer subclass"),
    ("verifiers", "verifiers-rechner", "src/rechner_vf/__init__.py", '"RechnerTask", "RechnerTaskset"]',
     '"RechnerTask"]', "native asset: loading taskset rechner_vf failed: TypeError: taskset module 'rechner_vf' "
                       "exports no Taskset subclass via `__all__`"),
    ("verifiers", "verifiers-rechner", "plan.yaml", "kwargs: {}", "kwargs: {limit: many}",
     "native asset: taskset rechner_vf config (task.native.kwargs): limit:"),
])
def test_an_asset_that_cannot_load_fails_the_arm_on_one_line(tmp_path, stack, example, path, old, new, message):
    """The probe starts the rollout service, which loads the asset first: the probe fails with the cause, and
    the service's own log stays where the message says."""
    run_dir = tmp_path / "run"
    result, summary = qualify(stack, broken_copy(example, tmp_path, path, old, new), run_dir, "probe", "service")
    assert result.returncode == 1 and summary["stages"] == {"probe": "error", "service": "skipped"}
    error = evidence(run_dir, "probe")["error"]["message"]
    assert message in error and "\n" not in error
    assert Path(error.rsplit("(logs: ", 1)[1].rstrip(")")).is_file()


def test_a_tool_that_hangs_fails_its_episodes_at_the_plans_episode_timeout(tmp_path):
    """The team's calculator never returns: each episode that calls it is abandoned after the plan's
    budget.episode_timeout_s, its env server killed and restarted, retried once and then failed, naming the
    timeout; the other cases and every file of the stage are kept."""
    plan = broken_copy("verifiers-rechner", tmp_path, "src/rechner_vf/tools.py", "        match = EXPRESSION.match(ausdruck)\n",
                       "        import time\n        time.sleep(3600)\n        match = EXPRESSION.match(ausdruck)\n")
    plan.write_text(plan.read_text().replace("  max_turns: 3\n", "  max_turns: 3\n  episode_timeout_s: 4\n", 1))
    run_dir = tmp_path / "run"
    result, summary = qualify("verifiers", plan, run_dir, "probe", "service")
    assert result.returncode == 1 and summary["stages"]["service"] == "failed"
    cases = {(c["task_id"], c["case"]): c for c in lines(run_dir / "stages" / "service" / "service.jsonl")}
    hung = cases[("r000", "tool-then-answer")]
    assert hung["status"] == "failed" and "no result after 4 s (episode_timeout_s)" in hung["error"]["message"]
    assert len(cases) == 15  # every scripted case kept, the ones the restarts cost marked failed with their cause
    assert "episode_timeout_s" in gates(run_dir, "service")["service:scripted-episodes"]["detail"]


@pytest.mark.parametrize(("stack", "example", "path", "old", "new", "message"), [
    ("skyrl-gym", "skyrl-rechnen", "src/rechnen_env/env.py", "        self.turns += 1\n",
     "        self.turns += 1\n        raise ZeroDivisionError('the reward broke')\n", "the reward broke"),
    ("openenv", "openenv-rechner", "src/rechner_env/environment.py", "            submitted = str(",
     "            raise KeyError('no grader')\n            submitted = str(", "no grader"),
    ("lightning-verl", "lightning-harness", "src/rechen_agent/agent.py", '            return {"reward": 1.0',
     '            return {"reward": float("nan")', "expected its reward, a finite number"),
    ("nemo-gym", "nemo-gym-rechner", "src/rechner_gym/app.py", "        final = \"\"\n",
     "        final = \"\"\n        raise RuntimeError('verify broke')\n", "verify broke"),
    ("verifiers", "verifiers-rechner", "src/rechner_vf/taskset.py", "        numbers = NUMBER.findall(",
     "        raise LookupError('the rubric broke')\n        numbers = NUMBER.findall(", "the rubric broke"),
])
def test_a_reward_that_raises_fails_the_service_stage_naming_the_cause(tmp_path, stack, example, path, old, new,
                                                                       message):
    run_dir = tmp_path / "run"
    result, summary = qualify(stack, broken_copy(example, tmp_path, path, old, new), run_dir, "probe", "service")
    assert result.returncode == 1 and summary["stages"]["service"] == "failed"
    detail = gates(run_dir, "service")["service:scripted-episodes"]["detail"]
    assert message in detail, detail
    cases = lines(run_dir / "stages" / "service" / "service.jsonl")
    assert any(case["status"] == "failed" for case in cases) and len(cases) >= 9  # every case kept, marked

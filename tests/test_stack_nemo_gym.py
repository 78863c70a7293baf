"""The nemo-gym stack (nemo-gym==0.7.0, Python 3.13 with --ignore-requires-python) in its own environment:
task families as NeMo Gym resources servers, episodes through the stock simple_agent and a vllm_model
subclass, against a scripted policy.

Slow: the first run builds the environment (~1.5 min, 1.4 GB; cached under RUNNER_CACHE_DIR afterwards);
each test starts NeMo Gym server processes (~3 s of CPU each).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import msgspec
import pytest

from qualification._http import post_json
from qualification.policy_protocol import openai_tools
from qualification.scripted_policy import ScriptedPolicyServer
from qualification.tasks import FAMILIES, TaskItem, ToolCall, Transcript, get_family
from runner._engine import LocalEngine
from runner._plan import load_plan
from runner._stacks import get_stack
from runner_contracts import EpisodeSpec, FaultSpec, RolloutRequest, RolloutResponse, SamplingSpec, StageRequest

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"
# Other stacks' upstream distributions (and torch): none may be in this environment.
FOREIGN = {"torch", "trl", "openenv", "openenv-core", "verifiers", "agentlightning", "agent-lightning", "verl"}
SAMPLING = SamplingSpec(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64, seed=0)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env():
    return LocalEngine().prepare(get_stack("nemo-gym"))


def scripted_episodes(families=None, max_turns: int = 8) -> tuple[list[EpisodeSpec], dict[str, tuple]]:
    """Every scripted case (known-good and known-bad) of one train item of each family."""
    episodes, cases = [], {}
    for name in sorted(families or FAMILIES):
        family = get_family(name)
        item = family.generate("train", 1, 1)[0]
        for case in family.scripted_cases(item):
            episode_id = f"{name}/{case['case']}"
            episodes.append(EpisodeSpec(episode_id=episode_id, task_id=item.task_id, family=name,
                                        item=item.to_json(), seed=0, max_turns=max_turns))
            cases[episode_id] = (family, item, case)
    return episodes, cases


def reference(family, item, result: dict):
    calls = [ToolCall(c["name"], c["arguments"], c["result"]) for c in result["tool_calls"]]
    return family.score(item, Transcript(final_text=result["final_text"], tool_calls=calls))


def test_environment_has_nemo_gym_and_no_other_stack(env):
    out = subprocess.run([str(env.python), "-c",
                          "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name'].lower()"
                          ".replace('_', '-').replace('.', '-'): d.version for d in m.distributions()}))"],
                         capture_output=True, text=True, check=True).stdout
    packages = json.loads(out)
    assert packages["nemo-gym"] == "0.7.0"
    assert not FOREIGN & set(packages), FOREIGN & set(packages)


DRIVER = r"""
import json, sys
from qualification.rollout import PolicyEndpoint
from runner_contracts import EpisodeSpec, SamplingSpec
import msgspec
from runner_stack_nemo_gym.backend import NemoGymBackend

from concurrent.futures import ThreadPoolExecutor

args = json.loads(sys.stdin.read())
episodes = [msgspec.convert(spec, EpisodeSpec) for spec in args["episodes"]]
backend = NemoGymBackend({episode.family for episode in episodes})
backend.start()
try:
    policy = PolicyEndpoint(base_url=args["base_url"], model="scripted-policy",
                            sampling=msgspec.convert(args["sampling"], SamplingSpec))
    with ThreadPoolExecutor(4) as pool:
        for result in pool.map(lambda episode: backend.run_episode(episode, policy), episodes):
            print(json.dumps(msgspec.to_builtins(result)), flush=True)
finally:
    backend.stop()
"""


def test_scripted_episodes_score_as_the_reference(env):
    episodes, cases = scripted_episodes()
    with ScriptedPolicyServer({e: c[2]["turns"] for e, c in cases.items()}) as policy:
        args = {"base_url": policy.base_url, "sampling": msgspec.to_builtins(SAMPLING),
                "episodes": [msgspec.to_builtins(e) for e in episodes]}
        run = subprocess.run([str(env.python), "-c", DRIVER], input=json.dumps(args), capture_output=True,
                             text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-3000:]
        calls = list(policy.calls)
    results = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["episode_id"] for r in results] == [e.episode_id for e in episodes]
    # Every call names its episode twice (header X-Episode-ID, which the policy server reads first, and
    # body metadata.episode_id), and carries the family's tools exactly as openai_tools renders them.
    assert {c["episode_id"] for c in calls} == set(cases) and {c["channel"] for c in calls} == {"header"}
    for call in calls:
        assert call["body"]["metadata"]["episode_id"] == call["episode_id"]
        family = cases[call["episode_id"]][0]
        assert call["body"].get("tools") == (openai_tools(family) or None), call["body"].get("tools")
    for result in results:
        family, item, case = cases[result["episode_id"]]
        score = reference(family, item, result)
        assert result["status"] == "completed"
        assert result["reward"] == score.reward and result["reward_components"] == score.components, result
        assert result["success"] is score.success is case["expected_success"], result
    for name in FAMILIES:
        assert {r["success"] for r in results if r["episode_id"].startswith(name + "/")} == {True, False}


def test_probe_and_service_stage_through_the_engine(env, tmp_path):
    engine = LocalEngine()
    probe = engine.run(env, StageRequest(run_id="t", stack="nemo-gym", stage="probe", plan=load_plan(PLAN),
                                         out_dir=str(tmp_path / "probe")), timeout_s=60)
    assert probe.ok, (tmp_path / "probe" / "stderr.log").read_text()[-3000:]
    environment = json.loads((tmp_path / "probe" / "result.json").read_text())["environment"]
    assert (environment["upstream"]["name"], environment["upstream"]["version"]) == ("nemo-gym", "0.7.0")

    out = tmp_path / "service"
    outcome = engine.run(env, StageRequest(run_id="t", stack="nemo-gym", stage="service", plan=load_plan(PLAN),
                                           out_dir=str(out), options={"items_per_family": 1}), timeout_s=180)
    assert outcome.ok, (out / "stderr.log").read_text()[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["metrics"]["failed_episodes"] == [] and result["metrics"]["unattributed_calls"] == 0
    cases = [json.loads(line) for line in (out / "service.jsonl").read_text().splitlines()]
    assert cases
    for case in cases:
        item = TaskItem.from_json(case["item"])
        score = reference(get_family(item.family), item, case)
        assert case["stack_reward"] == score.reward
        assert score.success is case["expected_success"], case


def test_environment_killed_mid_batch_loses_no_episode(env, tmp_path):
    # The plan's families (their resources servers start with the service), 4 episodes at a time; the
    # resources servers are SIGKILLed when the 6th episode starts.
    episodes, cases = scripted_episodes(["calc-tool", "german-arith"])
    engine = LocalEngine()
    service = engine.start_service(env, StageRequest(run_id="t", stack="nemo-gym", stage="serve",
                                                     plan=load_plan(PLAN), out_dir=str(tmp_path)), ready_timeout_s=120)
    try:
        assert service.url.startswith("http://127.0.0.1:")
        with ScriptedPolicyServer({e: c[2]["turns"] for e, c in cases.items()}) as policy:
            request = RolloutRequest(episodes=episodes, policy_base_url=policy.base_url, sampling=SAMPLING,
                                     concurrency=4, max_attempts=3, fault=FaultSpec(kill_environment_after_started=5))
            response = msgspec.convert(post_json(service.url + "/rollouts", msgspec.to_builtins(request),
                                                 timeout=300), RolloutResponse)
    finally:
        assert service.stop() == 0
    assert response.faults_injected == 1 and response.environment_restarts >= 1
    assert [r.episode_id for r in response.results] == [e.episode_id for e in episodes]
    assert any(r.attempts > 1 for r in response.results)
    for result in response.results:
        assert result.status == "completed", result.error
        family, item, case = cases[result.episode_id]
        score = reference(family, item, msgspec.to_builtins(result))
        assert result.reward == score.reward and result.success is case["expected_success"]

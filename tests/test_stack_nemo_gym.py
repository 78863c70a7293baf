"""The nemo-gym stack (nemo-gym==0.7.0, Python 3.13 with --ignore-requires-python) in its own environment:
task families as NeMo Gym resources servers, episodes through the stock simple_agent and a vllm_model
subclass, against a scripted policy.

Slow: the first run builds the environment (~1.5 min, 1.4 GB; cached under RUNNER_CACHE_DIR afterwards);
each test starts NeMo Gym server processes (~3 s of CPU each).
"""

from __future__ import annotations

import json
import subprocess

import msgspec
import pytest
from runner_contracts import StageRequest
from runner_kit.policy import openai_tools
from runner_kit.scripted_policy import ScriptedPolicyServer
from stack_checks import (
    PLAN,
    SAMPLING,
    assert_crash_mid_batch_loses_nothing,
    assert_only_its_own_upstream,
    assert_scripted_results,
    assert_service_stage,
    scripted_episodes,
)

from runner.api import LocalEngine, get_stack, load_plan

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env():
    return LocalEngine().prepare(get_stack("nemo-gym"))


def test_environment_has_nemo_gym_and_no_other_stack(env):
    assert_only_its_own_upstream(env)


DRIVER = r"""
import json, os, sys
from runner_kit.rollout import PolicyEndpoint
from runner_contracts import EpisodeSpec, SamplingSpec
import msgspec
from runner_stack_nemo_gym.backend import NemoGymBackend

from concurrent.futures import ThreadPoolExecutor

args = json.loads(sys.stdin.read())
episodes = [msgspec.convert(spec, EpisodeSpec) for spec in args["episodes"]]
backend = NemoGymBackend({episode.family for episode in episodes})
backend.start()
backend.warm_up()  # as the rollout service does
standbys = [process.pid for process, _ in backend._standbys]
try:
    policy = PolicyEndpoint(base_url=args["base_url"], model="scripted-policy",
                            sampling=msgspec.convert(args["sampling"], SamplingSpec))
    with ThreadPoolExecutor(4) as pool:
        for result in pool.map(lambda episode: backend.run_episode(episode, policy), episodes):
            print(json.dumps(msgspec.to_builtins(result)), flush=True)
    harness = [s.process.pid for s in backend._servers.values() if s.kind != "resources"]
    replacements = [process.pid for process, _ in backend._standbys]
finally:
    backend.stop()
def exists(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
print(json.dumps({"standbys": standbys, "harness": harness, "replacements": replacements,
                  "alive_after_stop": [p for p in standbys + harness + replacements if exists(p)]}))
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
    *lines, processes = run.stdout.splitlines()
    processes = json.loads(processes)
    # The first model server and agent are the two standbys warm_up() started (NeMo Gym imported before
    # the policy's address was known), each replaced by a new standby for the next stage's; the other
    # families' agents start cold; stop() ends them all.
    assert len(processes["standbys"]) == 2 and len(processes["harness"]) > 2, processes
    assert set(processes["standbys"]) < set(processes["harness"]), processes
    assert len(processes["replacements"]) == 2 and not set(processes["replacements"]) & set(processes["harness"])
    assert processes["alive_after_stop"] == []
    # Every call names its episode twice (header X-Episode-ID, which the policy server reads first, and
    # body metadata.episode_id), and carries the family's tools exactly as openai_tools renders them.
    assert_scripted_results([json.loads(line) for line in lines], cases, calls, "header")
    for call in calls:
        assert call["body"]["metadata"]["episode_id"] == call["episode_id"]
        family = cases[call["episode_id"]][0]
        assert call["body"].get("tools") == (openai_tools(family) or None), call["body"].get("tools")


def test_probe_and_service_stage_through_the_engine(env, tmp_path):
    probe = LocalEngine().run(env, StageRequest(run_id="t", stack="nemo-gym", stage="probe", plan=load_plan(PLAN),
                                                out_dir=str(tmp_path / "probe")), timeout_s=60)
    assert probe.ok, (tmp_path / "probe" / "stderr.log").read_text()[-3000:]
    environment = json.loads((tmp_path / "probe" / "result.json").read_text())["environment"]
    assert (environment["upstream"]["name"], environment["upstream"]["version"]) == ("nemo-gym", "0.7.0")
    assert_service_stage(env, tmp_path / "service", timeout_s=180)


def test_environment_killed_mid_batch_loses_no_episode(env, tmp_path):
    # The plan's families (their resources servers start with the service), 4 episodes at a time; the
    # resources servers are SIGKILLed when the 6th episode starts.
    assert_crash_mid_batch_loses_nothing(env, tmp_path, ["calc-tool", "german-arith"])

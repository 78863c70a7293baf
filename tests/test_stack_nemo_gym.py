"""The nemo-gym stack (nemo-gym==0.7.0, Python 3.13 with --ignore-requires-python) in its own environment:
task families as NeMo Gym resources servers, episodes through the stock simple_agent and a vllm_model
subclass, against a scripted policy.

Slow: the first run builds the environment (~1.5 min, 1.4 GB; cached under RUNNER_CACHE_DIR afterwards);
each test starts NeMo Gym server processes (~4 s of CPU each; the harness servers are forks of one).
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
from runner_kit.processes import command_line
from runner_kit.rollout import PolicyEndpoint
from runner_contracts import EpisodeSpec, SamplingSpec
import msgspec
from runner_stack_nemo_gym.backend import NemoGymBackend

from concurrent.futures import ThreadPoolExecutor

args = json.loads(sys.stdin.read())
episodes = [msgspec.convert(spec, EpisodeSpec) for spec in args["episodes"]]
backend = NemoGymBackend({episode.family for episode in episodes})
backend.start()
fork_server = backend._prefork.process.pid
def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as handle:
        return [int(child) for child in handle.read().split()]
try:
    policy = PolicyEndpoint(base_url=args["base_url"], model="scripted-policy",
                            sampling=msgspec.convert(args["sampling"], SamplingSpec))
    # What the trainer's POST /prepare does before its first batch: the harness servers start now.
    backend.prepare(policy, sorted({e.family for e in episodes}), episodes[0].max_turns)
    prepared = sorted(s.process.pid for s in backend._servers.values() if s.kind != "resources" and s.alive())
    with ThreadPoolExecutor(4) as pool:
        for result in pool.map(lambda episode: backend.run_episode(episode, policy), episodes):
            print(json.dumps(msgspec.to_builtins(result)), flush=True)
    launchers = [s.process.pid for s in backend._servers.values() if s.kind != "resources"]
    resources = [s.process.pid for s in backend._servers.values() if s.kind == "resources"]
    forks = children(fork_server)
    same_program = [command_line(pid) == command_line(fork_server) for pid in forks]
finally:
    backend.stop()
def exists(pid):  # a zombie waiting for init to reap it is gone
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
everything = [fork_server, *launchers, *resources, *forks]
print(json.dumps({"prepared": prepared, "launchers": launchers, "forks": forks, "same_program": same_program,
                  "resources": resources, "alive_after_stop": [p for p in everything if exists(p)]}))
"""


def test_scripted_episodes_score_as_the_reference_on_the_servers_prepare_started(env):
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
    # Each model server and agent is a fork of the fork server that imported NeMo Gym at start (a child
    # running the fork server's own program, not a new interpreter), one per launcher; the resources
    # servers, the environment, are processes of their own. stop() ends them all.
    assert len(processes["launchers"]) > 2 and len(processes["forks"]) == len(processes["launchers"]), processes
    assert all(processes["same_program"]), processes
    assert processes["resources"] and not set(processes["resources"]) & set(processes["forks"]), processes
    assert processes["alive_after_stop"] == []
    # prepare() started every model server and agent the episodes then used, before any episode ran.
    assert processes["prepared"] == sorted(processes["launchers"]), processes
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

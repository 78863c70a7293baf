"""The openenv stack (openenv==0.10.0) in its own environment: our task families as an OpenEnv Environment
behind create_app/uvicorn, episodes through EnvClient WebSocket sessions against a scripted policy.

Slow: the first run builds the environment (~1 min; cached under RUNNER_CACHE_DIR afterwards).
"""

from __future__ import annotations

import json
import subprocess

import msgspec
import pytest
from stack_checks import (
    SAMPLING,
    assert_crash_mid_batch_loses_nothing,
    assert_only_its_own_upstream,
    assert_scripted_results,
    assert_service_stage,
    scripted_episodes,
)

from qualification.scripted_policy import ScriptedPolicyServer
from runner._engine import LocalEngine
from runner._stacks import get_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env():
    return LocalEngine().prepare(get_stack("openenv"))


def test_environment_has_openenv_and_no_other_stack(env):
    assert_only_its_own_upstream(env)


DRIVER = r"""
import json, sys
from qualification.rollout import PolicyEndpoint
from runner_contracts import EpisodeSpec, SamplingSpec
import msgspec
from runner_stack_openenv.backend import OpenEnvBackend

args = json.loads(sys.stdin.read())
backend = OpenEnvBackend()
backend.start()
try:
    policy = PolicyEndpoint(base_url=args["base_url"], model="scripted-policy",
                            sampling=msgspec.convert(args["sampling"], SamplingSpec))
    for spec in args["episodes"]:
        result = backend.run_episode(msgspec.convert(spec, EpisodeSpec), policy)
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
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        calls = list(policy.calls)
    assert_scripted_results([json.loads(line) for line in run.stdout.splitlines()], cases, calls, "header")


def test_service_stage_through_the_engine(env, tmp_path):
    assert_service_stage(env, tmp_path, timeout_s=120)


def test_environment_killed_mid_batch_loses_no_episode(env, tmp_path):
    # 21 episodes, 4 at a time; the server is SIGKILLed when the 6th starts.
    assert_crash_mid_batch_loses_nothing(env, tmp_path)

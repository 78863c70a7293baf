"""The lightning-verl stack (agentlightning==1.0.2, verl==0.9.1 pinned, no torch) in its own Python 3.12
environment: an unmodified OpenAI-SDK team harness behind agl-server's gateway, which captures every model
call's token ids and logprobs in its store.

Slow: the first run builds the environment (~2 min; cached under RUNNER_CACHE_DIR afterwards). The last test
also needs the trl environment and the cached tiny calc policy (built on first use, several minutes).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import msgspec
import pytest
from stack_checks import (
    PLAN,
    SAMPLING,
    assert_crash_mid_batch_loses_nothing,
    assert_only_its_own_upstream,
    assert_scripted_results,
    assert_service_stage,
    installed_packages,
    scripted_episodes,
)

from qualification.continuity import chain_calls
from qualification.scripted_policy import ScriptedPolicyServer
from runner._engine import LocalEngine
from runner._plan import load_plan
from runner._stacks import get_stack
from runner_contracts import CapturedCall, EpisodeSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env():
    return LocalEngine().prepare(get_stack("lightning-verl"))


def test_environment_has_agentlightning_and_verl_and_no_other_stack(env):
    assert_only_its_own_upstream(env)  # verl is this stack's own pin, torch is absent
    assert installed_packages(env)["verl"] == "0.9.1"


DRIVER = r"""
import json, sys
from qualification.rollout import PolicyEndpoint
from runner_contracts import EpisodeSpec, SamplingSpec
import msgspec
from runner_stack_lightning_verl.backend import LightningBackend

args = json.loads(sys.stdin.read())
backend = LightningBackend()
backend.start()
try:
    policy = PolicyEndpoint(base_url=args["base_url"], model=args["model"],
                            sampling=msgspec.convert(args["sampling"], SamplingSpec))
    for spec in args["episodes"]:
        result = backend.run_episode(msgspec.convert(spec, EpisodeSpec), policy)
        print(json.dumps(msgspec.to_builtins(result)), flush=True)
finally:
    backend.stop()
"""


def _run_driver(env, base_url: str, model: str, episodes: list[EpisodeSpec], timeout: float = 180) -> list[dict]:
    args = {"base_url": base_url, "model": model, "sampling": msgspec.to_builtins(SAMPLING),
            "episodes": [msgspec.to_builtins(e) for e in episodes]}
    run = subprocess.run([str(env.python), "-c", DRIVER], input=json.dumps(args), capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_scripted_episodes_score_as_the_reference(env):
    episodes, cases = scripted_episodes()
    with ScriptedPolicyServer({e: c[2]["turns"] for e, c in cases.items()}) as policy:
        results = _run_driver(env, policy.base_url, policy.model, episodes)
        calls = list(policy.calls)
    assert_scripted_results(results, cases, calls, "path")
    # The scripted policy returns no token ids: nothing captured, the trainer would use the server's log.
    assert all(r["captured_calls"] is None for r in results)


def test_service_stage_through_the_engine(env, tmp_path):
    assert_service_stage(env, tmp_path, timeout_s=180)


def test_gateway_and_harnesses_killed_mid_batch_lose_no_episode(env, tmp_path):
    # 21 episodes, 4 at a time; agl-server and the running harnesses are SIGKILLed when the 6th starts.
    assert_crash_mid_batch_loses_nothing(env, tmp_path)


POLICY_SERVER = r"""
import json, sys
from pathlib import Path
import msgspec
from transformers import AutoModelForCausalLM, AutoTokenizer
from runner_contracts import SamplingSpec
from runner_stack_trl.policy_server import PolicyServer

args = json.loads(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(args["policy_dir"])
model = AutoModelForCausalLM.from_pretrained(args["policy_dir"])
server = PolicyServer(model, tokenizer, sampling=msgspec.convert(args["sampling"], SamplingSpec),
                      calls_path=Path(args["calls_path"]), revision="test").start()
print(server.base_url, flush=True)
sys.stdin.read()
server.close()
"""


def test_gateway_capture_equals_the_policy_servers_log(env, tmp_path):
    """The trl stack's real PolicyServer (tiny calc policy, trl env) behind the gateway: every episode's
    captured prompt ids, sampled ids and logprobs equal what the server logged, and chain into one row."""
    from qualification.tasks import get_family
    from runner._policy import build_tiny

    engine = LocalEngine()
    plan = load_plan(PLAN)
    policy_dir = build_tiny(engine, dict(plan.policy.tiny or {}), plan)
    trl = engine.prepare(get_stack("trl"))
    calls_path = tmp_path / "calls.jsonl"
    server = subprocess.Popen(
        [str(trl.python), "-c", POLICY_SERVER, json.dumps({
            "policy_dir": str(policy_dir), "calls_path": str(calls_path), "sampling": msgspec.to_builtins(SAMPLING)})],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        base_url = server.stdout.readline().strip()
        assert base_url.startswith("http://127.0.0.1:"), base_url
        family = get_family("calc-tool")
        episodes = [EpisodeSpec(episode_id=f"real/{index}", task_id=item.task_id, family=family.name,
                                item=item.to_json(), seed=0, max_turns=plan.budget.max_turns)
                    for index, item in enumerate(family.generate("train", 4, 7))]
        results = _run_driver(env, base_url, "policy", episodes)
    finally:
        server.stdin.close()
        server.wait(timeout=60)
    served = [json.loads(line) for line in Path(calls_path).read_text().splitlines()]
    assert {c["channel"] for c in served} == {"path"} and all(c["episode_id"] for c in served)
    assert [r["episode_id"] for r in results] == [e.episode_id for e in episodes]
    for result in results:
        assert result["status"] == "completed", result
        captured = [msgspec.convert(c, CapturedCall) for c in result["captured_calls"]]
        logged = [c for c in served if c["episode_id"] == result["episode_id"]]
        assert len(captured) == len(logged) == result["turns"] >= 1
        assert [(c.prompt_ids, c.completion_ids, c.logprobs) for c in captured] == \
               [(c["prompt_ids"], c["completion_ids"], c["logprobs"]) for c in logged]
        row = chain_calls(captured)
        assert row is not None and row.breaks == 0 and row.calls_used == len(captured), row


HARNESS_KILL = r"""
import json, sys, threading, time
import msgspec
from qualification.rollout import BatchRunner
from runner_contracts import EpisodeSpec, RolloutRequest, SamplingSpec
from runner_stack_lightning_verl.backend import LightningBackend

args = json.loads(sys.stdin.read())
backend = LightningBackend()
backend.start()
killed = []

def kill_when_busy():
    # SIGKILL only the team harnesses (agl-server stays up) once two episodes are mid-harness.
    while True:
        running = backend.running_harnesses()
        if len(running) >= 2:
            killed.append(len(running))
            backend.kill_harnesses()
            return
        time.sleep(0.01)

try:
    threading.Thread(target=kill_when_busy, daemon=True).start()
    request = RolloutRequest(episodes=[msgspec.convert(e, EpisodeSpec) for e in args["episodes"]],
                             policy_base_url=args["base_url"], policy_model=args["model"],
                             sampling=msgspec.convert(args["sampling"], SamplingSpec), concurrency=4, max_attempts=3)
    response = BatchRunner(backend).run(request)
    marked = backend.gateway.api("GET", "/api/rollouts?state_in=failed")
finally:
    backend.stop()
print(json.dumps({"response": msgspec.to_builtins(response), "killed": killed, "marked": marked}))
"""


def test_harness_killed_mid_episode_is_marked_failed_in_the_store_and_retried(env):
    from stack_checks import reference

    episodes, cases = scripted_episodes(["business-comm", "calc-tool"])
    with ScriptedPolicyServer({e: c[2]["turns"] for e, c in cases.items()}) as policy:
        args = {"base_url": policy.base_url, "model": policy.model, "sampling": msgspec.to_builtins(SAMPLING),
                "episodes": [msgspec.to_builtins(e) for e in episodes]}
        run = subprocess.run([str(env.python), "-c", HARNESS_KILL], input=json.dumps(args), capture_output=True,
                             text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    results = out["response"]["results"]
    assert out["killed"] and out["killed"][0] >= 2
    assert [r["episode_id"] for r in results] == [e.episode_id for e in episodes]
    retried = {r["episode_id"] for r in results if r["attempts"] > 1}
    assert len(retried) >= 2
    for result in results:
        assert result["status"] == "completed", result
        family, item, case = cases[result["episode_id"]]
        assert result["reward"] == reference(family, item, result).reward
    # Each abandoned attempt stays in agl-server's store as a failed rollout naming its episode.
    marked = out["marked"]
    assert {m["metadata"]["episode_id"] for m in marked} == retried
    assert all(m["status"]["error_message"] == "team harness killed by signal 9" for m in marked)

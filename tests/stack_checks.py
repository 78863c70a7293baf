"""Checks every environment stack's test runs: its environment's packages, scripted episodes per family,
and an environment server killed in the middle of a rollout batch served through the engine."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import msgspec
from qualification.tasks import ToolCall, Transcript, get_family, sources
from runner_contracts import (
    ENVIRONMENT_FILE,
    SERVICE_CALLS_FILE,
    PolicyCall,
    ServiceCase,
    read_jsonl,
    EpisodeSpec,
    RolloutRequest,
    RolloutResponse,
    SamplingSpec,
    StageRequest,
)
from runner_kit.http import post_json
from runner_kit.scripted_policy import ScriptedPolicyServer

from conftest import wait_until

from runner._engines.jobs import last_error_lines
from runner.api import LocalEngine, StackEnvironment, all_stacks, load_plan

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"
SAMPLING = SamplingSpec(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64, seed=0)


def installed_packages(env: StackEnvironment) -> dict[str, str]:
    out = subprocess.run([str(env.python), "-c",
                          "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name'].lower()"
                          ".replace('_', '-').replace('.', '-'): d.version for d in m.distributions()}))"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def assert_only_its_own_upstream(env: StackEnvironment) -> None:
    """The stack's pinned upstream is installed; torch and every other stack's upstream are not."""
    packages = installed_packages(env)
    own = env.manifest.upstream
    assert packages[own.name] == own.version
    foreign = {"torch", "openenv-core", "agentlightning", "verl"} | {
        m.upstream.name for m in all_stacks().values() if m.name != env.manifest.name}
    foreign -= set(env.manifest.locked_packages())  # what the stack pins itself is its own
    assert not foreign & set(packages), foreign & set(packages)


def scripted_episodes(families=None, max_turns: int = 8) -> tuple[list[EpisodeSpec], dict[str, tuple]]:
    """Every scripted case (known-good and known-bad) of one train item of each family."""
    episodes, cases = [], {}
    for name in sorted(families or sources()):
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


def published_pids(service_dir: Path) -> list[int]:
    """The environment's processes as the rollout service publishes them (ENVIRONMENT_FILE)."""
    return json.loads((service_dir / ENVIRONMENT_FILE).read_text())["pids"]


def assert_crash_mid_batch_loses_nothing(env: StackEnvironment, tmp_path: Path, families=None,
                                         kill_after: int = 5, channel: str | None = None) -> list[dict]:
    """The stack's rollout service (through the engine, as an arm runs it) whose environment processes (as
    its environment.json names them) the engine SIGKILLs once `kill_after` episodes called the policy, as the
    rollout stage's crash does: every episode comes back completed with the reference score, some on a
    second attempt, and the environment runs again under new processes; with `channel`, also everything
    assert_scripted_results checks (components, both outcomes per family, every call attributed through
    that channel). Returns the results as dicts."""
    episodes, cases = scripted_episodes(families)
    # On the host's network: this test's scripted policy server and its POST /rollouts are on the host.
    service = LocalEngine(host_network=True).start_service(env, StageRequest(
        run_id="t", stack=env.manifest.name, stage="serve", plan=load_plan(PLAN), out_dir=str(tmp_path)),
        ready_timeout_s=120)
    try:
        assert service.url.startswith("http://127.0.0.1:")
        with ScriptedPolicyServer({e: c[2]["turns"] for e, c in cases.items()}) as policy:
            request = RolloutRequest(episodes=episodes, policy_base_url=policy.base_url, sampling=SAMPLING,
                                     concurrency=4, max_attempts=3)
            replies: list = []
            batch = threading.Thread(target=lambda: replies.append(
                post_json(service.url + "/rollouts", msgspec.to_builtins(request), timeout=600)))
            batch.start()
            wait_until(lambda: len({c["episode_id"] for c in policy.calls}) >= kill_after or not batch.is_alive(),
                       "episodes to call the policy", 300, poll_s=0.01)
            environment = published_pids(tmp_path)
            killed = service.kill_processes(environment)
            batch.join(600)
            response = msgspec.convert(replies[0], RolloutResponse)
            calls = list(policy.calls)
            time.sleep(0.3)  # the service republishes within 0.1 s of a change
            restarted = published_pids(tmp_path)
    finally:
        code = service.stop()
    assert code == 0, (f"the rollout service exited {code} on SIGTERM: "
                       f"{last_error_lines(tmp_path / 'stderr.log', lines=12)}")
    assert killed and sorted(killed) == sorted(environment), (killed, environment)
    assert response.environment_restarts >= 1 and restarted and not set(restarted) & set(killed)
    assert [r.episode_id for r in response.results] == [e.episode_id for e in episodes]
    assert any(r.attempts > 1 for r in response.results)
    for result in response.results:
        assert result.status == "completed", result.error
        family, item, case = cases[result.episode_id]
        score = reference(family, item, msgspec.to_builtins(result))
        assert result.reward == score.reward and result.success is case["expected_success"]
    results = [msgspec.to_builtins(result) for result in response.results]
    if channel is not None:
        assert_scripted_results(results, cases, calls, channel)
    return results


# Runs in the stack environment: each episode through the backend's run_episode, as the rollout service does.
DRIVER = r"""
import importlib, json, sys
import msgspec
from runner_contracts import EpisodeSpec, SamplingSpec
from runner_kit.rollout import PolicyEndpoint

args = json.loads(sys.stdin.read())
module, _, name = args["backend"].partition(":")
backend = getattr(importlib.import_module(module), name)()
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


def drive_episodes(env: StackEnvironment, backend: str, base_url: str, episodes: list[EpisodeSpec], *,
                   model: str = "scripted-policy", timeout: float = 180) -> list[dict]:
    """The episodes through `backend` ("module:Class") in the stack's environment against the policy at
    `base_url`; their results, in order (lines an upstream prints besides are skipped)."""
    args = {"backend": backend, "base_url": base_url, "model": model, "sampling": msgspec.to_builtins(SAMPLING),
            "episodes": [msgspec.to_builtins(e) for e in episodes]}
    run = subprocess.run([str(env.python), "-c", DRIVER], input=json.dumps(args), capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def run_scripted_episodes(env: StackEnvironment, backend: str, episodes: list[EpisodeSpec],
                          scripts: dict[str, list]) -> tuple[list[dict], list[dict]]:
    """The episodes through `backend` ("module:Class") in the stack's environment against a scripted
    policy: (results, the policy calls it received)."""
    with ScriptedPolicyServer(scripts) as policy:
        results = drive_episodes(env, backend, policy.base_url, episodes, model=policy.model)
        calls = list(policy.calls)
    return results, calls


def assert_scripted_results(results: list[dict], cases: dict[str, tuple], calls: list[dict], channel: str) -> None:
    """Backend results equal the reference scorer (reward, components, success), in order; every family
    has a known-good and a known-bad case; every policy call named its episode through `channel`."""
    assert [r["episode_id"] for r in results] == list(cases)
    assert {c["episode_id"] for c in calls} == set(cases) and {c["channel"] for c in calls} == {channel}
    for result in results:
        family, item, case = cases[result["episode_id"]]
        score = reference(family, item, result)
        assert result["status"] == "completed"
        assert result["reward"] == score.reward and result["reward_components"] == score.components, result
        assert result["success"] is score.success is case["expected_success"], result
    for name in {family.name for family, _, _ in cases.values()}:
        assert {r["success"] for r in results if r["episode_id"].startswith(name + "/")} == {True, False}


def assert_service_stage(env: StackEnvironment, out: Path, timeout_s: float = 300) -> None:
    """The scaffold's service stage through the engine: the host's gate over its files (every scripted case
    of the plan ran once and completed, every policy call names one), and every scripted case scored as
    the reference scorer scores it."""
    from qualification.tasks import TaskItem

    from runner._stages.service import scripted_episodes_gate

    outcome = LocalEngine().run(env, StageRequest(run_id="t", stack=env.manifest.name, stage="service",
                                                  plan=load_plan(PLAN), out_dir=str(out),
                                                  options={"items_per_family": 1}), timeout_s=timeout_s)
    assert outcome.ok, (out / "stderr.log").read_text()[-3000:]
    gate, _ = scripted_episodes_gate(load_plan(PLAN), read_jsonl(out / "service.jsonl", ServiceCase),
                                     read_jsonl(out / SERVICE_CALLS_FILE, PolicyCall), items_per_family=1)
    assert gate.passed, gate
    cases = [json.loads(line) for line in (out / "service.jsonl").read_text().splitlines()]
    assert cases
    for case in cases:
        item = TaskItem.from_json(case["item"])
        score = reference(get_family(item.family), item, case)
        assert case["stack_reward"] == score.reward
        assert score.success is case["expected_success"], case

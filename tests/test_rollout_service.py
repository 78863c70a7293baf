"""The rollout-service scaffold, the policy protocol and the host-side call audits, in the host venv.

Real HTTP servers on 127.0.0.1 with free ports: the scripted policy server, the reference backend's
task server and the rollout service. No upstream stack is involved (those have their own tests)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from qualification.gates import call_gates
from qualification.tasks import get_family
from runner_contracts import (
    EpisodeSpec,
    FaultSpec,
    PolicyCall,
    RolloutRequest,
    RolloutResponse,
    SamplingSpec,
    Segment,
    Trajectory,
)
from runner_kit.continuity import chain_calls
from runner_kit.http import HttpError, get_json, post_json
from runner_kit.policy import openai_tools, parse_tool_calls
from runner_kit.reference_backend import ReferenceBackend
from runner_kit.rollout import BatchRunner, PolicyEndpoint, RolloutService
from runner_kit.scripted_policy import ScriptedPolicyServer

ROOT = Path(__file__).resolve().parents[1]


def _scripted_batch(family_name: str, n: int = 2, max_turns: int = 6):
    family = get_family(family_name)
    episodes, scripts, expected = [], {}, {}
    for item in family.generate("train", n, 1):
        for case in family.scripted_cases(item):
            episode_id = f"{item.task_id}/{case['case']}"
            episodes.append(EpisodeSpec(episode_id=episode_id, task_id=item.task_id, family=family_name,
                                        item=item.to_json(), seed=0, max_turns=max_turns))
            scripts[episode_id] = case["turns"]
            expected[episode_id] = case["expected_success"]
    return episodes, scripts, expected


@pytest.mark.parametrize("family_name", ["calc-tool", "german-arith", "german-rag-cited", "business-comm"])
def test_reference_backend_scores_scripted_cases_like_the_reference_scorer(family_name):
    episodes, scripts, expected = _scripted_batch(family_name)
    backend = ReferenceBackend()
    backend.start()
    try:
        with ScriptedPolicyServer(scripts) as policy:
            response = BatchRunner(backend).run(RolloutRequest(
                episodes=episodes, policy_base_url=policy.base_url, sampling=SamplingSpec(), concurrency=3))
            channels = {call["channel"] for call in policy.calls}
    finally:
        backend.stop()
    assert [r.episode_id for r in response.results] == [e.episode_id for e in episodes]
    assert all(r.status == "completed" for r in response.results)
    assert {r.episode_id: r.success for r in response.results} == expected
    assert channels == {"header"}


def test_environment_crash_mid_batch_loses_no_episode():
    episodes, scripts, expected = _scripted_batch("business-comm", n=3)
    backend = ReferenceBackend()
    backend.start()
    try:
        with ScriptedPolicyServer(scripts) as policy:
            response = BatchRunner(backend).run(RolloutRequest(
                episodes=episodes, policy_base_url=policy.base_url, sampling=SamplingSpec(), concurrency=3,
                max_attempts=3, fault=FaultSpec(kill_environment_after_started=len(episodes) // 2)))
            retry_ids = {c["episode_id"] for c in policy.calls if c["wire_id"].endswith("~attempt-2")}
    finally:
        backend.stop()
    assert response.faults_injected == 1 and response.environment_restarts >= 1
    assert sorted(r.episode_id for r in response.results) == sorted(e.episode_id for e in episodes)
    retried = [r for r in response.results if r.attempts > 1]
    assert retried, "the crash hit no episode in flight"
    assert all(r.status == "completed" and r.success == expected[r.episode_id] for r in retried), retried
    assert {r.episode_id for r in retried} <= retry_ids  # retries call the policy under their own attempt id


def test_rollout_service_over_http_and_its_errors():
    episodes, scripts, _ = _scripted_batch("calc-tool", n=1)
    with RolloutService(ReferenceBackend()) as service, ScriptedPolicyServer(scripts) as policy:
        assert get_json(service.url + "/health") == {"status": "ok"}
        assert get_json(service.url + "/info")["episode_id_channel"] == "header X-Episode-ID"
        request = RolloutRequest(episodes=episodes, policy_base_url=policy.base_url, sampling=SamplingSpec())
        response = msgspec.convert(post_json(service.url + "/rollouts", msgspec.to_builtins(request)), RolloutResponse)
        assert len(response.results) == len(episodes)
        with pytest.raises(HttpError) as bad:
            post_json(service.url + "/rollouts", {"episodes": "nope"})
        assert bad.value.status == 422 and "rollout-request" in str(bad.value)


def test_policy_calls_need_an_episode_and_every_channel_works():
    scripts = {"ep/1": [{"text": "Antwort: 3"}]}
    with ScriptedPolicyServer(scripts) as policy:
        body = {"messages": [{"role": "user", "content": "1+2"}]}
        with pytest.raises(HttpError) as refused:
            post_json(policy.base_url + "/chat/completions", body)
        assert refused.value.status == 400 and "attributed" in str(refused.value)
        endpoint = PolicyEndpoint(base_url=policy.base_url, model="m", sampling=SamplingSpec())
        post_json(policy.base_url + "/chat/completions", body, headers=endpoint.headers("ep/1"))
        post_json(endpoint.episode_base_url("ep/1") + "/chat/completions", body)
        post_json(policy.base_url + "/chat/completions", {**body, "metadata": {"episode_id": "ep/1"}})
        assert [c["channel"] for c in policy.calls] == ["header", "path", "metadata"]
        assert {c["episode_id"] for c in policy.calls} == {"ep/1"}


def test_tool_call_parsing_keeps_malformed_calls_as_text():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "rechner", "arguments": {"ausdruck": "1 + 2"}}\n</tool_call>')
    assert content == "" and calls[0]["function"]["name"] == "rechner"
    assert calls[0]["function"]["arguments"] == '{"ausdruck": "1 + 2"}'
    text = '<tool_call>\n{"name": "rechner", "arguments": {"ausdruck": \n</tool_call>'
    assert parse_tool_calls(text) == (text, [])
    assert [t["function"]["name"] for t in openai_tools(get_family("business-comm"))] == sorted(
        spec.name for spec in get_family("business-comm").tools)


@dataclass
class _Call:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]


def test_rows_chain_calls_by_exact_prefix_and_count_breaks():
    first = _Call([1, 2], [3, 4], [-0.1, -0.2])
    second = _Call([1, 2, 3, 4, 9, 9], [5], [-0.3])
    row = chain_calls([first, second])
    assert row.prompt_ids == [1, 2] and row.completion_ids == [3, 4, 9, 9, 5]
    assert row.mask == [1, 1, 0, 0, 1] and row.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert (row.breaks, row.untrained_calls, row.calls_used) == (0, 0, 2)
    retokenised = _Call([1, 2, 7, 9], [5], [-0.3])  # the history came back with different ids
    broken = chain_calls([first, retokenised, second])
    assert broken.completion_ids == [3, 4] and (broken.breaks, broken.untrained_calls) == (1, 2)
    assert chain_calls([]) is None


def _trajectory(episode_id: str, policy_ids: list[int]) -> Trajectory:
    return Trajectory(run_id="r", stack="s", stage="rollout", step=1, episode_id=episode_id, task_id="t",
                      group_id="g", sample_index=0, policy_revision="x", reward=0.0, outcome="failure",
                      finish_reason="stop", turns=1,
                      segments=[Segment(source="prompt", token_ids=[1]),
                                Segment(source="policy", token_ids=policy_ids, logprobs=[0.0] * len(policy_ids))])


def _call(episode_id: str | None, index: int, ids: list[int]) -> PolicyCall:
    return PolicyCall(call_id=f"{episode_id}#{index}", episode_id=episode_id, channel="header", endpoint="chat",
                      index_in_episode=index, policy_revision="x", prompt_ids=[1], completion_ids=ids,
                      logprobs=[0.0] * len(ids), finish_reason="stop")


def test_call_audit_fails_on_unattributed_foreign_or_altered_tokens():
    trajectories = [_trajectory("e1", [5, 6, 7])]
    good = [_call("e1", 0, [5, 6]), _call("e1", 1, [7])]
    gates, metrics = call_gates(good, trajectories)
    assert all(g.passed for g in gates) and metrics["policy_calls"] == 2
    gates, _ = call_gates(good + [_call(None, 0, [])], trajectories)
    assert not gates[0].passed
    gates, _ = call_gates(good + [_call("other", 0, [1])], trajectories)
    assert not gates[0].passed and "other" in gates[0].detail
    gates, _ = call_gates([_call("e1", 0, [5, 6]), _call("e1", 1, [8])], trajectories)
    assert gates[0].passed and not gates[1].passed


def test_comparison_refuses_arms_of_different_plans(tmp_path):
    from runner_contracts import freeze_plan, write_record

    from runner.api import UserError, load_plan, write_comparison

    plan = freeze_plan(load_plan(ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"))
    other = freeze_plan(msgspec.structs.replace(plan, name="other", plan_id=None))
    for arm, arm_plan in (("a", plan), ("b", other)):
        write_record(tmp_path / "arms" / arm / "plan.json", arm_plan)
    with pytest.raises(UserError, match="different plans"):
        write_comparison(tmp_path, ["a", "b"])

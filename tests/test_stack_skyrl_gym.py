"""The skyrl-gym stack (skyrl-gym==0.4.0) in its own environment: our task families as one SkyRL Gym
BaseTextEnv made by skyrl_gym.make, episodes driven as SkyRL's generator drives them (init, then step per
policy turn) against a scripted policy, the env worker SIGKILLed mid-batch through the rollout service.

Slow: the first run builds the environment (~30 s; cached under RUNNER_CACHE_DIR afterwards).
"""

from __future__ import annotations

import msgspec
import pytest
from stack_checks import (
    assert_crash_mid_batch_loses_nothing,
    assert_only_its_own_upstream,
    assert_service_stage,
    installed_packages,
    reference,
    run_scripted_episodes,
    scripted_episodes,
)

from runner.api import LocalEngine, get_stack

pytestmark = pytest.mark.slow
BACKEND = "runner_stack_skyrl_gym.backend:SkyRLGymBackend"


@pytest.fixture(scope="module")
def env():
    return LocalEngine().prepare(get_stack("skyrl-gym"))


def test_environment_has_skyrl_gym_and_no_torch(env):
    assert_only_its_own_upstream(env)
    assert "torch" not in installed_packages(env)


def test_scripted_episodes_score_as_the_reference_through_a_crash(env, tmp_path):
    # 21 scripted episodes, 4 at a time; the env worker is SIGKILLed when the 6th starts.
    results = assert_crash_mid_batch_loses_nothing(env, tmp_path, channel="header")
    # Tool results are the family's own: replaying the calls on a fresh state gives the same strings.
    cases = scripted_episodes()[1]
    for result in results:
        family, item, _ = cases[result["episode_id"]]
        state = family.initial_state(item)
        assert [c["result"] for c in result["tool_calls"]] == [
            family.call_tool(item, state, c["name"], c["arguments"]) for c in result["tool_calls"]]


def test_the_env_owns_the_turn_limit(env):
    """business-comm's good script needs five turns; with three the env ends the episode as truncated after
    the third turn's tool call, as SkyRL envs enforce max_turns themselves; the empty answer is scored as the
reference scores it (the booking already made earns its partial credit)."""
    episodes, cases = scripted_episodes(families=["business-comm"])
    good = next(e for e in episodes if cases[e.episode_id][2]["expected_success"])
    cut = msgspec.structs.replace(good, episode_id="business-comm/cut", max_turns=3)
    [result], calls = run_scripted_episodes(env, BACKEND, [cut], {cut.episode_id: cases[good.episode_id][2]["turns"]})
    assert result["outcome"] == "truncated" and result["finish_reason"] == "max_turns" and result["turns"] == 3
    assert len(calls) == 3 and len(result["tool_calls"]) == 3 and result["success"] is False
    family, item, _ = cases[good.episode_id]
    assert result["final_text"] == "" and result["reward"] == reference(family, item, result).reward


def test_service_stage_through_the_engine(env, tmp_path):
    assert_service_stage(env, tmp_path, timeout_s=120)

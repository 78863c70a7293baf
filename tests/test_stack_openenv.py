"""The openenv stack (openenv==0.10.0) in its own environment: our task families as an OpenEnv Environment
behind create_app/uvicorn, episodes through EnvClient WebSocket sessions against a scripted policy.

Slow: the first run builds the environment (~1 min; cached under RUNNER_CACHE_DIR afterwards).
"""

from __future__ import annotations

import pytest
from stack_checks import (
    assert_crash_mid_batch_loses_nothing,
    assert_only_its_own_upstream,
    assert_service_stage,
)

from runner.api import LocalEngine, get_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env():
    return LocalEngine().prepare(get_stack("openenv"))


def test_environment_has_openenv_and_no_other_stack(env):
    assert_only_its_own_upstream(env)


def test_service_stage_through_the_engine(env, tmp_path):
    assert_service_stage(env, tmp_path, timeout_s=120)


def test_scripted_episodes_score_as_the_reference_through_a_crash(env, tmp_path):
    # 21 scripted episodes, 4 at a time; the server is SIGKILLed when the 6th starts.
    assert_crash_mid_batch_loses_nothing(env, tmp_path, channel="header")

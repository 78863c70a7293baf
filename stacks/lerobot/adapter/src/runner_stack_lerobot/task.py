"""The task: gymnasium's Reacher-v5 (MuJoCo; a two-link arm reaching a random target) in LeRobot's observation
layout (`agent_pos` -> observation.state, `environment_state` -> observation.environment_state), with the
success flag LeRobot's evaluation reads (`info["is_success"]` at the episode's end): the fingertip within
`success_distance` of the target. Reacher has no success flag of its own; that threshold is ours (a deviation
recorded in stack.toml). The scripted expert is analytic inverse kinematics and a PD controller, acting from
the observation alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import gymnasium as gym
import numpy as np

ENV_ID = "Reacher-v5"
TASK = "reach the target"
LINKS = (0.1, 0.11)  # reacher.xml: upper arm, and forearm to the fingertip
GAINS = (1.0, 0.1)  # PD on the joint-angle error: solves every seed tried (0..99) within 1e-4
STATE = [0, 1, 2, 3, 6, 7]  # Reacher-v5's observation: cos q, sin q, target xy, joint velocities, fingertip - target
ENVIRONMENT = [4, 5, 8, 9]
STATE_NAMES = ["cos_q1", "cos_q2", "sin_q1", "sin_q2", "qvel1", "qvel2"]
ENVIRONMENT_NAMES = ["target_x", "target_y", "to_target_x", "to_target_y"]

Policy = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (state, environment) batches -> action batch


class ReachTask(gym.Wrapper):
    """Reacher-v5 with dict observations and an `is_success` flag on every step."""

    def __init__(self, env: gym.Env, success_distance: float):
        super().__init__(env)
        self.success_distance = success_distance
        self.task = self.task_description = TASK  # what lerobot_eval passes a language-conditioned policy
        box = lambda n: gym.spaces.Box(-np.inf, np.inf, (n,), np.float64)  # noqa: E731
        self.observation_space = gym.spaces.Dict({"agent_pos": box(len(STATE)), "environment_state": box(len(ENVIRONMENT))})

    @staticmethod
    def split(observation: np.ndarray) -> dict[str, np.ndarray]:
        return {"agent_pos": observation[STATE], "environment_state": observation[ENVIRONMENT]}

    def reset(self, *, seed=None, options=None):
        observation, info = self.env.reset(seed=seed, options=options)
        return self.split(observation), {**info, "is_success": False}

    def step(self, action):
        observation, reward, terminated, truncated, info = self.env.step(action)
        reached = float(np.hypot(*observation[8:10])) < self.success_distance
        return self.split(observation), reward, terminated, truncated, {**info, "is_success": reached}


def make(success_distance: float) -> ReachTask:
    return ReachTask(gym.make(ENV_ID), success_distance)


def vector_env(n_envs: int, success_distance: float) -> gym.vector.SyncVectorEnv:
    """As lerobot.envs.factory.make_env builds one (synchronous, autoreset in the same step)."""
    return gym.vector.SyncVectorEnv([lambda: make(success_distance)] * n_envs,
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def expert(state: np.ndarray, environment: np.ndarray) -> np.ndarray:
    """Torques that drive the joints to the inverse-kinematics solution nearer the current angles."""
    state, environment = np.atleast_2d(state), np.atleast_2d(environment)
    q = np.arctan2(state[:, 2:4], state[:, 0:2])
    velocity, target = state[:, 4:6], environment[:, 0:2]
    upper, fore = LINKS
    cos_elbow = np.clip(((target ** 2).sum(1) - upper ** 2 - fore ** 2) / (2 * upper * fore), -1, 1)
    errors = []
    for sign in (1, -1):
        elbow = sign * np.arccos(cos_elbow)
        shoulder = np.arctan2(target[:, 1], target[:, 0]) - np.arctan2(fore * np.sin(elbow), upper + fore * np.cos(elbow))
        errors.append((np.stack([shoulder, elbow], 1) - q + np.pi) % (2 * np.pi) - np.pi)
    error = np.where((np.abs(errors[0]).sum(1) <= np.abs(errors[1]).sum(1))[:, None], errors[0], errors[1])
    kp, kd = GAINS
    return np.clip(kp * error - kd * velocity, -1.0, 1.0)


def idle(state: np.ndarray, environment: np.ndarray) -> np.ndarray:
    """No torque: the arm stays where the reset put it."""
    return np.zeros((np.atleast_2d(state).shape[0], 2))


def reference_rollouts(policy: Policy, seeds: Sequence[int], success_distance: float) -> list[dict[str, float]]:
    """Each seed's episode run directly, outside LeRobot's evaluation: the return and the success at its end.
    The service stage's expected values come from here."""
    env, rows = make(success_distance), []
    for seed in seeds:
        observation, _ = env.reset(seed=seed)
        total, done, info = 0.0, False, {}
        while not done:
            # float32, as LeRobot's preprocess_observation hands observations to a policy
            action = policy(observation["agent_pos"].astype(np.float32), observation["environment_state"].astype(np.float32))[0]
            observation, reward, terminated, truncated, info = env.step(action)
            total, done = total + float(reward), terminated or truncated
        rows.append({"sum_reward": total, "success": float(info["is_success"])})
    env.close()
    return rows

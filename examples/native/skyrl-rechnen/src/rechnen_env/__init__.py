"""Registers the `rechnen` env with SkyRL Gym on import, as SkyRL's tutorial registers its multiply env."""

from skyrl_gym.envs import register

register(id="rechnen", entry_point="rechnen_env.env:RechnenEnv")

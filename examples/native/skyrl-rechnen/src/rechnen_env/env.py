"""German word arithmetic as a SkyRL Gym text environment.

The policy answers with 'Antwort: <Zahl>'. A correct answer ends the episode: reward 1.0 on the first turn,
half as much for each retry before it. A wrong or missing answer gets feedback and another turn, until
max_turns (SkyRL's generator puts it in extras), which ends the episode with reward 0.0.
"""

import re
from typing import Any, Dict

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

ANSWER = re.compile(r"Antwort:\s*(-?\d+)")


class RechnenEnv(BaseTextEnv):
    def __init__(self, env_config: Dict[str, Any] = {}, extras: Dict[str, Any] = {}):
        super().__init__()
        assert "reward_spec" in extras, "reward_spec field is required"
        assert "ground_truth" in extras["reward_spec"], "ground_truth is required in reward_spec field"
        self.ground_truth = int(extras["reward_spec"]["ground_truth"])
        self.max_turns = extras["max_turns"] if "max_turns" in extras else 5

    def _parse_action(self, action: str):
        match = ANSWER.search(action)
        return int(match.group(1)) if match else None

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        answer = self._parse_action(action)
        if answer == self.ground_truth:
            reward = 0.5 ** (self.turns - 1)
            return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={"parsed": answer})
        if self.turns >= self.max_turns:
            return BaseTextEnvStepOutput(observations=[], reward=0.0, done=True,
                                         metadata={"parsed": -1 if answer is None else answer})
        feedback = ("Das ist falsch. Versuche es noch einmal." if answer is not None
                    else "Antworte mit 'Antwort: <Zahl>'.")
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": feedback}], reward=0.0, done=False,
                                     metadata={})

"""The task families as one SkyRL Gym text environment, registered as `runner-tasks`.

Made as SkyRLGymGenerator makes every env, `skyrl_gym.make(ENV_ID, env_config=..., extras=...)`, with the
episode's TaskItem JSON and turn limit in `extras`. `step(text)` takes the policy's turn as text, parses its
Hermes `<tool_call>` blocks, runs each through the family's tools (a skyrl-gym ToolGroup) on the episode's
state and answers one "tool" message per call. A turn without a tool call is the final answer, scored by
the family's reference scorer. As in SkyRL the environment owns the turn limit.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType
from skyrl_gym.tools.core import ToolGroup

from qualification.tasks import TaskItem, ToolCall, Transcript, get_family
from runner_kit.policy import openai_tools
from runner_kit.tool_formats import parse_tool_calls

ENV_ID = "runner-tasks"


class FamilyTools(ToolGroup):
    """The family's tools bound to one episode's item and state (ToolGroup finds @tool methods on its
    class; these differ per family, so they are registered here)."""

    def __init__(self, family, item: TaskItem, world: dict[str, Any]):
        self._bound = (family, item, world)
        super().__init__(name=f"{family.name}-tools")

    def _register_tools(self) -> None:
        family, item, world = self._bound
        for spec in family.tools:
            self._tool_registry[spec.name] = functools.partial(family.call_tool, item, world, spec.name)


class TaskTextEnv(BaseTextEnv):
    """One instance per episode: its item, its family's state and its tool calls."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()
        extras = extras or {}
        self.item = TaskItem.from_json(extras["item"])
        self.family = get_family(self.item.family)
        self.max_turns = int(extras.get("max_turns", 1))
        self.tool_format = extras.get("tool_format", "hermes")
        self.world = self.family.initial_state(self.item)
        self.init_tool_groups([FamilyTools(self.family, self.item, self.world)])
        self.calls: list[ToolCall] = []

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        return prompt, {"tools": openai_tools(self.family)}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        _, calls = parse_tool_calls(action, self.tool_format)  # a malformed call is no call: the turn is an answer
        if not calls:
            return self._finish(action, truncated=False)
        observations = []
        for call in calls:
            name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
            try:  # BaseTextEnv._execute_tool runs group.execute_tool(name, *inputs)
                group = self.tool_to_toolgroup.get(name)
                result = str(self._execute_tool(group, name, [arguments]) if group else
                             self.family.call_tool(self.item, self.world, name, arguments))
            except Exception as error:  # as TRL's tool loop does: a raising tool becomes an error result
                result = str({"error": str(error)})
            self.calls.append(ToolCall(name=name, arguments=arguments, result=result))
            observations.append({"role": "tool", "name": name, "content": result})
        if self.turns >= self.max_turns:  # the turn limit ended it without an answer: "" is scored
            return self._finish("", truncated=True)
        return BaseTextEnvStepOutput(observations=observations, reward=0.0, done=False, metadata={})

    def _finish(self, final_text: str, truncated: bool) -> BaseTextEnvStepOutput:
        score = self.family.score(self.item, Transcript(final_text=final_text, tool_calls=list(self.calls)))
        return BaseTextEnvStepOutput(observations=[], reward=float(score.reward), done=True, metadata={
            "success": bool(score.success), "components": dict(score.components), "outcome": score.outcome,
            "final_text": final_text, "truncated": truncated, "tool_calls": [vars(c) for c in self.calls]})


# A string entry point keeps the EnvSpec serialisable; registering an id twice raises RegistrationError.
if ENV_ID not in skyrl_gym.registry:
    skyrl_gym.register(id=ENV_ID, entry_point="runner_stack_skyrl_gym.environment:TaskTextEnv")

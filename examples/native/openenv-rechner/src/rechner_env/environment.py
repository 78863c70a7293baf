"""Word problems with a calculator, as an OpenEnv MCP environment.

reset(question=..., answer=...) states the problem in the observation's metadata (as finqa_env does);
the policy may call `rechner` on an expression and ends the episode with `submit_answer`, which scores
the answer: reward 1.0 when its last number equals the expected answer, else 0.0. After `max_steps`
steps without an answer the episode ends with reward 0.0.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Optional
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.env_server.types import Action, Observation, State

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([+*-])\s*(-?\d+)\s*$")


class RechnerState(State):
    question: str = ""
    expected: Optional[int] = None
    submitted: Optional[str] = None


class RechnerEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, max_steps: int = 5):
        mcp = FastMCP("rechner")

        @mcp.tool
        def rechner(ausdruck: str) -> str:
            """Berechnet einen Ausdruck der Form 'Zahl Operator Zahl' (+, -, *).

            Args:
                ausdruck: Der Ausdruck, z. B. '347 + 589'.
            """
            match = EXPRESSION.match(ausdruck)
            if not match:
                raise ValueError(f"kein Ausdruck der Form 'Zahl Operator Zahl': {ausdruck!r}")
            left, symbol, right = match.groups()
            return str(OPERATORS[symbol](int(left), int(right)))

        @mcp.tool
        def submit_answer(answer: str) -> str:
            """Reicht die endgültige Antwort ein und beendet die Aufgabe.

            Args:
                answer: Die Antwort, z. B. 'Antwort: 42'.
            """
            return "eingereicht"

        super().__init__(mcp)
        self.max_steps = max_steps
        self._state = RechnerState(episode_id=str(uuid4()))

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, question: str = "",
              answer: Optional[int] = None, **kwargs: Any) -> Observation:
        self._state = RechnerState(episode_id=episode_id or str(uuid4()), question=question, expected=answer)
        return Observation(done=False, reward=0.0, metadata={"question": question, "step_count": 0})

    def _step_impl(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": f"unknown action {type(action).__name__}"})

    def step(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        return self._finish(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        return self._finish(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def _finish(self, action: Action, observation: Observation) -> Observation:
        if isinstance(action, CallToolAction) and action.tool_name == "submit_answer":
            submitted = str(action.arguments.get("answer", ""))
            self._state.submitted = submitted
            numbers = re.findall(r"-?\d+", submitted)
            correct = bool(numbers) and int(numbers[-1]) == self._state.expected
            observation.reward, observation.done = (1.0 if correct else 0.0), True
        elif self._state.step_count >= self.max_steps:
            observation.reward, observation.done = 0.0, True
        return observation

    @property
    def state(self) -> RechnerState:
        return self._state

"""The OpenEnv wire types of the task environment: one action for tool calls and final answers."""

from __future__ import annotations

from typing import Any, Literal

from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class TaskAction(Action):
    """`kind="tool"` calls tool `name` with `arguments`; `kind="answer"` ends the episode with `text`.
    `truncated` marks an answer forced by the turn limit (the episode's outcome is then "truncated")."""

    kind: Literal["tool", "answer"]
    name: str = ""
    arguments: dict[str, Any] = Field(default_factory=dict)
    text: str = ""
    truncated: bool = False


class TaskObservation(Observation):
    """After reset: the question; after a tool step: its result; after the answer: the score
    (`reward`, `done=True`, `components`, `success`, `outcome`)."""

    text: str = ""
    tool_name: str = ""
    components: dict[str, float] = Field(default_factory=dict)
    success: bool = False
    outcome: str = ""


class TaskState(State):
    """The episode as the server sees it: the item, the tool calls so far, whether it has ended."""

    family: str = ""
    task_id: str = ""
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    done: bool = False

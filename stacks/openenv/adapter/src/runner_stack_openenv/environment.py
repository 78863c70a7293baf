"""The task families as one OpenEnv Environment: reset with a TaskItem, step with tool calls, end with an answer.

Tools run through the family's `call_tool` on the episode's own state; the final answer is scored by the
family's reference scorer (`family.score(item, Transcript)`), which is the stack's native reward path.
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.interfaces import Environment
from qualification.tasks import TaskItem, ToolCall, Transcript, get_family

from .models import TaskAction, TaskObservation, TaskState


class TaskEnvironment(Environment[TaskAction, TaskObservation, TaskState]):
    """One instance per WebSocket session (the server's factory builds a fresh one for each)."""

    # Every session owns its item, state and transcript; nothing is shared between instances.
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._item: TaskItem | None = None
        self._world: dict[str, Any] = {}
        self._calls: list[ToolCall] = []
        self._state = TaskState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, item: str | None = None,
              **kwargs: Any) -> TaskObservation:
        """Starts the episode for `item` (TaskItem JSON); `episode_id` names it in the state."""
        if not item:
            raise ValueError("reset needs item=<TaskItem JSON>")
        self._item = TaskItem.from_json(item)
        family = get_family(self._item.family)
        self._world = family.initial_state(self._item)
        self._calls = []
        self._state = TaskState(episode_id=episode_id, step_count=0, family=self._item.family,
                                task_id=self._item.task_id)
        return TaskObservation(text=self._item.question, done=False, reward=None,
                               metadata={"task_id": self._item.task_id, "family": self._item.family})

    def step(self, action: TaskAction, timeout_s: float | None = None, **kwargs: Any) -> TaskObservation:
        if self._item is None:
            raise ValueError("step before reset")
        if self._state.done:
            raise ValueError(f"episode {self._state.episode_id!r} has ended")
        family = get_family(self._item.family)
        self._state.step_count += 1
        if action.kind == "tool":
            try:
                result = str(family.call_tool(self._item, self._world, action.name, dict(action.arguments)))
            except Exception as error:  # as TRL's tool loop does: a raising tool becomes an error result
                result = str({"error": str(error)})
            self._calls.append(ToolCall(name=action.name, arguments=dict(action.arguments), result=result))
            self._state.tool_calls = [vars(call).copy() for call in self._calls]
            return TaskObservation(text=result, tool_name=action.name, done=False, reward=None)
        score = family.score(self._item, Transcript(final_text=action.text, tool_calls=list(self._calls)))
        self._state.done = True
        outcome = "truncated" if action.truncated and not score.success else score.outcome
        return TaskObservation(text=action.text, done=True, reward=float(score.reward),
                               components=dict(score.components), success=bool(score.success), outcome=outcome)

    @property
    def state(self) -> TaskState:
        return self._state

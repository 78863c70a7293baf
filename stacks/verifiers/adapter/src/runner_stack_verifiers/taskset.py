"""Our task families as a Verifiers 0.4.0 taskset: one vf.Task per task item, scored by a @vf.reward
that calls the family's reference scorer, with the family's tools served by FamilyToolset: one MCP server per env
(taskset-scoped), which reads the rollout's task and world off its vf.State."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import verifiers.v1 as vf

from qualification.tasks import Score, TaskItem, ToolCall, Transcript, get_family, opening_messages, sources

from .toolset import EpisodeState, FamilyToolset, FamilyToolsetConfig


class QualTaskData(vf.TaskData):
    """Wire data of one episode: the TaskItem JSON, its family, the turn cap and the runner's episode id."""

    family: str
    item: str
    max_turns: int = 3
    episode_id: str = ""


class QualTaskConfig(vf.TaskConfig):
    pass


class QualTask(vf.Task[QualTaskData, EpisodeState, QualTaskConfig]):
    """One task item. The reward is the reference scorer's on the transcript read off the trace."""

    @property
    def key(self) -> str:
        return self.data.episode_id or self.hash

    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        # The taskset's shared tool server has no task of its own: it reads the episode off the state.
        item = TaskItem.from_json(self.data.item)
        trace.state.family, trace.state.item = item.family, self.data.item
        trace.state.world = get_family(item.family).initial_state(item)

    async def finalize(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        # The state is not serialised with the trace; the executed calls travel back in `info`.
        trace.info["executed_tool_calls"] = list(trace.state.calls)

    @vf.stop
    def turn_limit(self, trace: vf.Trace) -> bool:
        """Refuses the model call after max_turns calls (the episode's turn budget)."""
        return trace.num_turns >= self.data.max_turns

    @vf.reward
    async def reference(self, task: QualTaskData, trace: vf.Trace) -> float:
        """The family's reference scorer on the transcript read off the trace (the episode's reward).
        Verifiers gathers scoring hooks with asyncio.gather, so they must be coroutines."""
        return reference_score(task, trace).reward

    @vf.metric
    async def reference_components(self, task: QualTaskData, trace: vf.Trace) -> dict[str, float]:
        """The scorer's components and success flag, recorded as metrics (metrics are not summed into the reward)."""
        score = reference_score(task, trace)
        return {"success": float(score.success), **{f"component/{k}": v for k, v in score.components.items()}}


def reference_score(task: QualTaskData, trace: vf.Trace) -> Score:
    return get_family(task.family).score(TaskItem.from_json(task.item), transcript_of(trace))


def transcript_of(trace: vf.Trace) -> Transcript:
    """Final text and tool calls (with the results the harness fed back) of the trace's conversation."""
    calls, final_text = tool_calls_of(trace, trace.state.calls)
    return Transcript(final_text=final_text,
                      tool_calls=[ToolCall(c["name"], c["arguments"], c["result"]) for c in calls])


def tool_calls_of(trace: vf.Trace, executed: list[dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]], str]:
    """(tool calls as {name, arguments, result}, final assistant text) from the trace's messages.

    A result is the tool message the harness sent back. The calls of the last turn of an episode cut off by
    its turn limit were executed but never sent back (verifiers refuses the request that carries them), so
    their results come from the tail of `executed`, the tool server's log."""
    calls: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # the latest assistant turn's calls; its tool messages follow it
    final_text = ""
    for message in trace.messages:
        if message.role == "tool":
            match = next((call for call in pending if call["id"] == message.tool_call_id), None)
            if match is not None:
                match["result"], match["answered"] = _text(message.content), True
                pending.remove(match)
            continue
        if message.role != "assistant":
            continue
        final_text = _text(message.content) if not message.tool_calls else ""
        pending = []
        for call in message.tool_calls or []:
            try:
                arguments = json.loads(call.arguments or "{}")
            except json.JSONDecodeError:
                arguments = {"_raw": call.arguments}
            if not isinstance(arguments, dict):
                arguments = {"_raw": arguments}
            record = {"id": call.id, "name": call.name, "arguments": arguments, "result": "", "answered": False}
            calls.append(record)
            pending.append(record)
    unanswered = [call for call in calls if not call["answered"]]
    tail = list(executed or [])[-len(unanswered):] if unanswered else []
    if len(tail) == len(unanswered):
        for call, done in zip(unanswered, tail, strict=True):
            if done.get("name") == call["name"]:
                call["result"] = done.get("result", "")
    return calls, final_text


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(getattr(part, "text", "") or "" for part in content)


class QualTasksetConfig(vf.TasksetConfig):
    """Which items `load()` yields when the taskset is iterated directly (evals); the rollout service
    builds its tasks from the runner's EpisodeSpecs instead."""

    families: list[str] = list(sources())
    split: str = "train"
    n: int = 4
    seed: int = 1
    max_turns: int = 3


class QualTaskset(vf.Taskset[QualTask, QualTasksetConfig]):
    @classmethod
    def toolsets(cls, config: QualTasksetConfig) -> list[vf.Toolset]:
        # Taskset-scoped: verifiers starts this MCP server once per env and routes each rollout's calls to
        # its own state (a per-rollout server costs a Python start and a verifiers import per episode).
        return [FamilyToolset(FamilyToolsetConfig())]

    def load(self) -> Iterable[QualTask]:
        for name in self.config.families:
            family = get_family(name)
            for item in family.generate(self.config.split, self.config.n, self.config.seed):
                yield task_for(item, self.config.max_turns, config=self.config.task)


def task_for(item: TaskItem, max_turns: int, episode_id: str = "", config: vf.TaskConfig | None = None) -> QualTask:
    family = get_family(item.family)
    data = QualTaskData(id=item.task_id, name=item.task_id, prompt=item.question, system_prompt=opening_messages(family, item)[0]["content"],
                        family=item.family, item=item.to_json(), max_turns=max_turns, episode_id=episode_id)
    return QualTask(data, config if isinstance(config, QualTaskConfig) else None)

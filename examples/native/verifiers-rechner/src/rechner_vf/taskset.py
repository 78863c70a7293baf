"""Word problems with a calculator.

Each task is a row of tasks.jsonl (shipped with the package): a question and its integer answer. The model may
call the taskset's `rechner` tool and answers with 'Antwort: <Zahl>'. The `correct` reward is 1.0 when the last
number of the final reply equals the answer, else 0.0; `used_calculator` is a metric, not a reward.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from importlib.resources import files

import verifiers.v1 as vf

from rechner_vf.tools import RechnerToolset, RechnerToolsetConfig

SYSTEM_PROMPT = "Nutze den Rechner. Antworte mit 'Antwort: <Zahl>'."
NUMBER = re.compile(r"-?\d+")


class RechnerConfig(vf.TasksetConfig):
    limit: int | None = None
    """Load only the first `limit` rows."""
    tools: RechnerToolsetConfig = RechnerToolsetConfig()


class RechnerData(vf.TaskData):
    answer: int


class RechnerTask(vf.Task[RechnerData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: RechnerData, trace: vf.Trace) -> float:
        numbers = NUMBER.findall(final_reply(trace))
        return 1.0 if numbers and int(numbers[-1]) == task.answer else 0.0

    @vf.metric
    async def used_calculator(self, task: RechnerData, trace: vf.Trace) -> float:
        return float(any(message.role == "tool" for message in trace.messages))


def final_reply(trace: vf.Trace) -> str:
    """The text of the last assistant message, if it called no tool."""
    for message in reversed(trace.messages):
        if message.role == "assistant":
            if message.tool_calls:
                return ""
            content = message.content
            return content if isinstance(content, str) else "".join(getattr(p, "text", "") or "" for p in content or [])
    return ""


class RechnerTaskset(vf.Taskset[RechnerTask, RechnerConfig]):
    @classmethod
    def toolsets(cls, config: RechnerConfig) -> list[vf.Toolset]:
        return [RechnerToolset(config.tools)]

    def load(self) -> Iterable[RechnerTask]:
        lines = (files("rechner_vf") / "tasks.jsonl").read_text(encoding="utf-8").splitlines()
        for line in lines[: self.config.limit]:
            row = json.loads(line)
            data = RechnerData(id=row["id"], prompt=row["question"], system_prompt=SYSTEM_PROMPT, answer=row["answer"])
            yield RechnerTask(data, self.config.task)

"""TRL environments built from the shared task interface (one class per task family).

GRPOTrainer's `environment_factory` turns every public method of the class into a tool, reading the
JSON schema from the method's type hints and Google-style docstring, so the methods are generated
from each family's ToolSpec.
"""

from __future__ import annotations

import inspect
from typing import Any

from qualification.tasks import TaskFamily, TaskItem, ToolCall, ToolSpec, Transcript, get_family

_PYTHON_TYPES = {"string": str, "integer": int, "number": float}


class TaskEnvironment:
    """State of one episode: the task item and every tool call made so far."""

    family: TaskFamily

    def __init__(self) -> None:
        self.item: TaskItem | None = None
        self.state: dict[str, Any] = {}
        self.tool_calls: list[ToolCall] = []

    def reset(self, **row: Any) -> None:
        self.item = TaskItem.from_json(row["item"])
        self.state = self.family.initial_state(self.item)
        self.tool_calls = []
        return None

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        assert self.item is not None, "reset() must run before a tool call"
        result = self.family.call_tool(self.item, self.state, name, arguments)
        self.tool_calls.append(ToolCall(name=name, arguments=dict(arguments), result=result))
        return result

    def _transcript(self, final_text: str) -> Transcript:
        return Transcript(final_text=final_text, tool_calls=list(self.tool_calls))


def _tool_method(spec: ToolSpec):
    def method(self: TaskEnvironment, **arguments: Any) -> str:
        return self._call(spec.name, arguments)

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {"return": str}
    for param in spec.params:
        annotations[param.name] = _PYTHON_TYPES[param.type]
        params.append(inspect.Parameter(param.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotations[param.name]))
    args_doc = "\n".join(f"    {param.name}: {param.description}" for param in spec.params)
    method.__name__ = method.__qualname__ = spec.name
    method.__doc__ = f"{spec.description}\n\nArgs:\n{args_doc}\n"
    method.__annotations__ = annotations
    method.__signature__ = inspect.Signature(params, return_annotation=str)
    return method


def environment_class(family_name: str) -> type[TaskEnvironment]:
    """A TaskEnvironment subclass whose public methods are the family's tools."""
    family = get_family(family_name)
    namespace: dict[str, Any] = {"family": family}
    for spec in family.tools:
        namespace[spec.name] = _tool_method(spec)
    return type(f"{family.name.title().replace('-', '')}Environment", (TaskEnvironment,), namespace)


def tool_methods(env: TaskEnvironment) -> list:
    """The bound tool methods in the order GRPOTrainer renders them (inspect.getmembers: by name), so
    prompts rendered here (SFT demonstrations, service cases) are the prompts the trainer samples from."""
    return [getattr(env, name) for name in sorted(spec.name for spec in env.family.tools)]

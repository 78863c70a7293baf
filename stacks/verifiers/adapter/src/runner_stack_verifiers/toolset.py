"""The family tools as one Verifiers MCP tool server (vf.Toolset), taskset-scoped: verifiers starts it once
per env (`python -m runner_stack_verifiers.toolset` in the subprocess runtime, when the env server starts
serving) and every rollout reaches it under its own signed state route (verifiers' shared-server channel).

A shared server gets no task, so the rollout's vf.State carries it: the task's setup puts the episode's
family and TaskItem JSON there beside the family's world (CRM, calendar, outbox) and the log of executed
calls; verifiers pulls that state before and pushes it after every tool call. Listing the tools pulls the
rollout's state too and answers only its family's tools, under their bare names and with exactly the
schemas of openai_tools(family), so a rollout sees what a per-rollout server of its family would show."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import verifiers.v1 as vf
from pydantic import Field
from qualification.tasks import TaskItem, get_family, sources
from runner_kit.policy import openai_tools

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer


class EpisodeState(vf.State):
    """The rollout's mutable state: its task (family, TaskItem JSON), the family's world and every executed
    tool call with its result."""

    family: str = ""
    item: str = ""
    world: dict[str, Any] = Field(default_factory=dict)
    calls: list[dict[str, Any]] = Field(default_factory=list)


class FamilyToolsetConfig(vf.SharedToolsetConfig):
    pass


class FamilyToolset(vf.Toolset[FamilyToolsetConfig, EpisodeState]):
    # Bare tool names: the policy must see `rechner`, not `family_toolset_rechner`.
    TOOL_PREFIX = None

    def register(self, mcp: MCPServer) -> None:
        from mcp_types import Tool

        # Each family's tools as the policy must see them; one registered function per bare name (families
        # may share a name), which runs the calling rollout's family's tool.
        listed: dict[str, list[Tool]] = {}
        params: dict[str, dict[str, None]] = {}
        descriptions: dict[str, str] = {}
        for name in sources():
            family = get_family(name)
            listed[name] = [Tool(name=tool["function"]["name"], description=tool["function"]["description"],
                                 input_schema=tool["function"]["parameters"]) for tool in openai_tools(family)]
            for spec in family.tools:
                params.setdefault(spec.name, {}).update(dict.fromkeys(p.name for p in spec.params))
                descriptions.setdefault(spec.name, spec.description)
        for tool_name, names in params.items():
            fn = vf.tool(self._tool_function(tool_name, list(names), descriptions[tool_name]), name=tool_name)
            mcp.add_tool(self._with_state(fn), name=tool_name, description=descriptions[tool_name])

        list_all = mcp.list_tools

        async def list_tools():
            state = await self._pull_state()
            if not state.family:  # no rollout route (a bare probe): everything registered
                return await list_all()
            return listed.get(state.family, [])

        mcp.list_tools = list_tools
        _drop_port_file_when_served(mcp)

    def _tool_function(self, tool_name: str, param_names: list[str], description: str):
        """A function with the tool's parameters, untyped so the family sees the model's raw arguments (an
        omitted or null argument is left out, as the family's call_tool expects)."""

        def call(**arguments: Any) -> str:
            supplied = {name: value for name, value in arguments.items() if value is not None}
            state = self.state
            if not state.item:
                raise RuntimeError("no episode in the rollout state: the task's setup puts it there")
            item = TaskItem.from_json(state.item)
            family = get_family(state.family)
            try:
                if tool_name not in {spec.name for spec in family.tools}:
                    raise KeyError(f"unknown tool {tool_name!r}")
                result = family.call_tool(item, state.world, tool_name, supplied)
            except Exception as error:  # a tool error is a result the policy sees, as in TRL's tool loop
                result = str({"error": str(error)})
            state.calls.append({"name": tool_name, "arguments": supplied, "result": result})
            return result

        call.__name__ = tool_name
        call.__doc__ = description
        call.__signature__ = inspect.Signature([
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Any)
            for name in param_names
        ])
        return call


def _drop_port_file_when_served(mcp: MCPServer) -> None:
    """Verifiers hands the tool server a /tmp/vf-port-<uuid> file to report its port and never removes it
    (the server dies by signal, so exit hooks do not run). Verifiers reads the port and then probes the
    server over HTTP, so the first HTTP request removes the file."""
    port_file = os.environ.get("MCP_PORT_FILE")
    if not port_file:
        return
    build = mcp.streamable_http_app

    def streamable_http_app(*args, **kwargs):
        inner = build(*args, **kwargs)
        pending = [port_file]

        async def app(scope, receive, send):
            if pending and scope["type"] == "http":
                Path(pending.pop()).unlink(missing_ok=True)
            await inner(scope, receive, send)

        return app

    mcp.streamable_http_app = streamable_http_app


if __name__ == "__main__":
    FamilyToolset.run()

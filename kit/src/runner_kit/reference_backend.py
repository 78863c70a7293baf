"""The rollout contract's reference implementation: a plain agent loop over HTTP, no upstream stack.

Its "environment server" is a JsonServer thread holding each episode's task state and tools; the agent
loop calls the policy with header X-Episode-ID and the environment server for tool calls. It is what the
scaffold, policy server and trainer bridge are tested against, and the smallest example of an adapter.
"""

from __future__ import annotations

import threading
from typing import Any

from qualification.tasks import TaskItem, ToolCall, Transcript, get_family, opening_messages
from runner_contracts import EpisodeResult, EpisodeSpec, ToolCallRecord

from .http import Call, HttpError, JsonServer, Reply
from .policy import openai_tools, tool_call_arguments
from .rollout import EnvironmentDown, PolicyEndpoint, RolloutBackend, post_to_environment


class _TaskServer:
    """Episode state and tools behind HTTP: POST /reset, /tool, /score (body carries episode_id)."""

    def __init__(self) -> None:
        self.episodes: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.server = JsonServer([("POST", "/reset", self.reset), ("POST", "/tool", self.tool),
                                  ("POST", "/score", self.score)])

    def reset(self, call: Call) -> Reply:
        item = TaskItem.from_json(call.body["item"])
        with self.lock:
            self.episodes[call.body["episode_id"]] = {
                "item": item, "state": get_family(item.family).initial_state(item), "calls": []}
        return Reply(body={"tools": openai_tools(get_family(item.family))})

    def _episode(self, call: Call) -> dict[str, Any]:
        episode = self.episodes.get(call.body["episode_id"])
        if episode is None:
            raise HttpError(404, f"unknown episode {call.body['episode_id']!r}")
        return episode

    def tool(self, call: Call) -> Reply:
        episode = self._episode(call)
        item, name, arguments = episode["item"], call.body["name"], call.body["arguments"]
        try:
            result = get_family(item.family).call_tool(item, episode["state"], name, arguments)
        except Exception as error:  # tool errors are results the policy sees, as in TRL's loop
            result = str({"error": str(error)})
        episode["calls"].append(ToolCall(name=name, arguments=arguments, result=result))
        return Reply(body={"result": result})

    def score(self, call: Call) -> Reply:
        episode = self._episode(call)
        item = episode["item"]
        score = get_family(item.family).score(item, Transcript(final_text=call.body["final_text"],
                                                                tool_calls=episode["calls"]))
        return Reply(body={"reward": score.reward, "success": score.success, "components": score.components,
                           "outcome": score.outcome,
                           "tool_calls": [{"name": c.name, "arguments": c.arguments, "result": c.result}
                                          for c in episode["calls"]]})


class ReferenceBackend(RolloutBackend):
    stack = "reference"
    upstream_name = "runner-kit"
    capabilities = ["multi-turn-tools", "fault-injection"]
    episode_id_channel = "header X-Episode-ID"

    def __init__(self) -> None:
        self.task_server: _TaskServer | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        self.task_server = _TaskServer()
        self.task_server.server.start()

    def stop(self) -> None:
        with self._lock:  # detach first: a restart racing with this stop must see the server gone
            server, self.task_server = self.task_server, None
        if server is not None:
            server.server.stop()

    def kill_environment(self) -> None:
        self.stop()

    def restart_environment(self) -> None:
        with self._lock:
            if self.task_server is None:
                self.task_server = _TaskServer()
                self.task_server.server.start()

    def _env(self, path: str, body: dict[str, Any]) -> Any:
        server = self.task_server
        if server is None:
            raise EnvironmentDown("the task server is not running")
        return post_to_environment(server.server.url + path, body)

    def run_episode(self, episode: EpisodeSpec, policy: PolicyEndpoint) -> EpisodeResult:
        item = TaskItem.from_json(episode.item)
        family = get_family(item.family)
        tools = self._env("/reset", {"episode_id": episode.episode_id, "item": episode.item})["tools"]
        messages = opening_messages(family, item)
        final_text, finish, turns = "", "stop", 0
        for turns in range(1, episode.max_turns + 1):
            message, finish = policy.chat(episode.episode_id, messages, tools)
            messages.append({k: v for k, v in message.items() if k in ("role", "content", "tool_calls")})
            if not message.get("tool_calls"):
                final_text = message.get("content") or ""
                break
            for tool_call in message["tool_calls"]:
                name, arguments = tool_call_arguments(tool_call)
                result = self._env("/tool", {"episode_id": episode.episode_id, "name": name,
                                             "arguments": arguments})["result"]
                messages.append({"role": "tool", "tool_call_id": tool_call["id"], "content": result})
        else:
            finish = "max_turns"
        score = self._env("/score", {"episode_id": episode.episode_id, "final_text": final_text})
        truncated = finish in ("length", "max_turns") and not score["success"]
        return EpisodeResult(
            episode_id=episode.episode_id, task_id=episode.task_id, status="completed", reward=score["reward"],
            reward_components=score["components"], success=score["success"],
            outcome="truncated" if truncated else score["outcome"], finish_reason=finish, turns=turns,
            final_text=final_text, tool_calls=[ToolCallRecord(**c) for c in score["tool_calls"]])


def run(request):
    """Adapter entry (`runner_kit.reference_backend:run`) for test stacks built on the reference backend."""
    from .rollout import adapter_main

    return adapter_main(ReferenceBackend(), request)

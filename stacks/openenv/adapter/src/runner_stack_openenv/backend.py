"""The openenv rollout backend: our agent loop over an OpenEnv EnvClient session, the policy over HTTP.

Per episode: one WebSocket session (`TaskEnvClient`, OpenEnv's EnvClient; HTTP /step is stateless, so a
multi-step episode needs the socket), `reset(episode_id=..., item=...)`, then model calls to the policy's
/v1/chat/completions with header X-Episode-ID, each tool call executed as an env step, and a final-answer
step whose observation carries the reference scorer's reward. The server is `create_app(TaskEnvironment)`
under uvicorn in a subprocess we start, on a 127.0.0.1 socket we bind.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

from qualification.tasks import NativeFamily, TaskItem, get_family, opening_messages
from runner_contracts import EpisodeResult, EpisodeSpec, NativeAsset, ToolCallRecord
from runner_kit.policy import openai_tools, tool_call_arguments
from runner_kit.processes import SocketServer
from runner_kit.rollout import EnvironmentDown, PolicyEndpoint, ServerBackend

# Imported lazily by _env_client(): importing openenv.core pulls in its server side, gradio included (~2.5 s of
# CPU), and probe needs none of it. The rollout service imports it in the background (warm_up).
_CLIENT: Any = None


def _env_client() -> Any:
    global _CLIENT
    if _CLIENT is None:
        from .client import TaskEnvClient

        _CLIENT = TaskEnvClient
    return _CLIENT


def _guarded(url: str):
    """on_env(what, call): the call, with what a dead or unreachable server raises through EnvClient turned
    into EnvironmentDown (the scaffold restarts the server and retries the episode)."""
    from websockets.exceptions import ConnectionClosed, InvalidHandshake

    errors = (ConnectionError, ConnectionClosed, InvalidHandshake, TimeoutError, OSError)

    def on_env(what: str, call):
        try:
            return call()
        except errors as error:
            raise EnvironmentDown(f"OpenEnv {what} on {url}: {type(error).__name__}: {error}") from error

    return on_env


class EnvServer(SocketServer):
    """The uvicorn subprocess serving the OpenEnv app, on a socket bound here to 127.0.0.1: our task
    environment, or a team's native MCP environment."""

    name = "OpenEnv server"

    def __init__(self, max_sessions: int = 256, ready_timeout_s: float = 60.0, native: NativeAsset | None = None):
        super().__init__(ready_timeout_s)
        self.max_sessions = max_sessions
        self.native = native
        if native is not None:
            self.name = f"OpenEnv server of {native.env}"
        self.env = {**os.environ, "ENABLE_WEB_INTERFACE": "false"}  # create_app would otherwise mount gradio at /web

    def command(self) -> list[str]:
        native = ["--native-env", self.native.env, "--native-kwargs", json.dumps(self.native.kwargs)] \
            if self.native is not None else []
        return [sys.executable, "-m", "runner_stack_openenv.server", "--max-sessions", str(self.max_sessions), *native]


class OpenEnvBackend(ServerBackend):
    stack = "openenv"
    upstream_name = "openenv"
    capabilities = ["multi-turn-tools", "stateful-tools", "concurrent-episodes", "environment-restart", "cpu",
                    "token-capture:policy-server", "episode-id:header", "native-assets"]
    # Our agent loop makes every model call; the same id goes to OpenEnv's reset(episode_id=...).
    episode_id_channel = "header X-Episode-ID"

    def __init__(self, max_sessions: int = 256, policy_timeout_s: float = 300.0, native: NativeAsset | None = None):
        super().__init__()
        self.native = native
        self.server = EnvServer(max_sessions=max_sessions)  # the task families (a native plan's retention probe)
        # A team's MCP environment gets a server of its own; the crash test kills both.
        self.native_server = EnvServer(max_sessions=max_sessions, native=native) if native is not None else None
        self.policy_timeout_s = policy_timeout_s

    def servers(self) -> list[EnvServer]:
        return [self.server, *([self.native_server] if self.native_server is not None else [])]

    def start(self) -> None:
        if self.native is not None:  # the cause in one line here, not a server that never becomes ready
            from .server import native_environment_class

            native_environment_class(self.native.env)
        super().start()

    def warm_up(self) -> None:
        _env_client()

    def bench_step_latency(self, steps: int) -> dict[str, list[float]]:
        """One calc-tool tool step, timed through upstream's GenericEnvClient and through our TaskEnvClient,
        each on its own warmed-up session against the same server."""
        from openenv.core.generic_client import GenericEnvClient

        from .client import TaskEnvClient
        from .models import TaskAction

        family = get_family("calc-tool")
        item = family.generate("train", 1, 1)[0]
        arguments = {"ausdruck": item.reference["expression"]}

        def timed(step) -> list[float]:
            for _ in range(20):
                step()
            samples = []
            for _ in range(steps):
                began = time.perf_counter()
                step()
                samples.append(time.perf_counter() - began)
            return samples

        with GenericEnvClient(base_url=self.server.url).sync() as upstream:
            upstream.reset(item=item.to_json(), episode_id="bench-upstream")
            action = {"kind": "tool", "name": "rechner", "arguments": arguments}
            upstream_samples = timed(lambda: upstream.step(action))
        with TaskEnvClient(base_url=self.server.url).sync() as ours:
            ours.reset(item=item.to_json(), episode_id="bench-adapter")
            adapter_samples = timed(lambda: ours.step(TaskAction(kind="tool", name="rechner", arguments=arguments)))
        return {"upstream_client": upstream_samples, "adapter": adapter_samples}

    # --- one episode -------------------------------------------------------------------------------------

    def run_episode(self, episode: EpisodeSpec, policy: PolicyEndpoint) -> EpisodeResult:
        from .models import TaskAction

        started = time.monotonic()
        item = TaskItem.from_json(episode.item)
        family = get_family(episode.family)
        if isinstance(family, NativeFamily):
            return self._native_episode(episode, item, family, policy, started)
        tools = openai_tools(family)
        messages = opening_messages(family, item)
        url = self.running_url()
        env = _env_client()(base_url=url, connect_timeout_s=10.0, message_timeout_s=60.0).sync()
        on_env = _guarded(url)
        try:
            on_env("connect", env.connect)
            on_env("reset", lambda: env.reset(episode_id=episode.episode_id, item=episode.item, seed=episode.seed))
            turns, finish, final = 0, "", None
            while turns < episode.max_turns:
                message, finish = policy.chat(episode.episode_id, messages, tools, timeout_s=self.policy_timeout_s)
                turns += 1
                last_text = message.get("content") or ""
                calls = message.get("tool_calls") or []
                if not calls:
                    final = on_env("step", lambda: env.step(TaskAction(
                        kind="answer", text=last_text, truncated=finish == "length")))
                    break
                messages.append({"role": "assistant", "content": last_text, "tool_calls": calls})
                for call in calls:
                    name, arguments = tool_call_arguments(call)
                    result = on_env("step", lambda: env.step(TaskAction(kind="tool", name=name, arguments=arguments)))
                    messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "name": name,
                                     "content": result.observation.text})
            if final is None:  # the turn limit ended it without an answer: the env scores "" as truncated
                finish = "max_turns"
                final = on_env("step", lambda: env.step(TaskAction(kind="answer", text="", truncated=True)))
            state = on_env("state", env.state)
        finally:
            with contextlib.suppress(Exception):
                env.close()
        observation = final.observation
        return EpisodeResult(
            episode_id=episode.episode_id, task_id=episode.task_id, status="completed",
            reward=float(final.reward or 0.0), reward_components=dict(observation.components),
            success=observation.success, outcome=observation.outcome, finish_reason=finish, turns=turns,
            final_text=observation.text,
            tool_calls=[ToolCallRecord(name=c["name"], arguments=c["arguments"], result=c["result"])
                        for c in state.tool_calls],
            seconds=round(time.monotonic() - started, 3),
        )

    # --- a team's own MCP environment ---------------------------------------------------------------------

    def _native_episode(self, episode: EpisodeSpec, item: TaskItem, family: NativeFamily, policy: PolicyEndpoint,
                        started: float) -> EpisodeResult:
        """A team's MCPEnvironment, driven as OpenEnv's MCP tutorial drives one for training: over one WebSocket
        session, reset(episode_id, seed, **the row's other fields), list_tools, then per policy turn each tool
        call as step(CallToolAction); a reply without a tool call goes to the asset's answer tool, if it names
        one. The episode ends when a step says done (its reward is the sum of the steps'), or at max_turns."""
        from .client import NativeEnvClient

        native = family.native
        url = self.running_url(self.native_server)
        row = dict(item.reference.get("row") or {})
        prompt = row.pop("prompt", None)
        for field in ("id", "split"):
            row.pop(field, None)
        env = NativeEnvClient(base_url=url, connect_timeout_s=10.0, message_timeout_s=60.0).sync()
        on_env = _guarded(url)
        reward, done, turns, finish, final_text, calls = 0.0, False, 0, "", "", []

        def step(action: dict[str, Any]) -> Any:
            nonlocal reward, done
            result = on_env("step", lambda: env.step(action))
            reward += float(result.reward or 0.0)
            done = result.done
            return result

        try:
            on_env("connect", env.connect)
            first = on_env("reset", lambda: env.reset(episode_id=episode.episode_id,
                                                      seed=int(item.reference.get("seed", episode.seed)), **row))
            listed = on_env("list_tools", lambda: env.step({"type": "list_tools"})).observation.get("tools") or []
            answer = _answer_argument(listed, native.answer_tool)
            tools = [_openai_tool(tool) for tool in listed if tool["name"] != native.answer_tool] or None
            messages = opening_messages_of(prompt, task_text(first.observation))
            while turns < episode.max_turns and not done:
                message, finish = policy.chat(episode.episode_id, messages, tools, timeout_s=self.policy_timeout_s)
                turns += 1
                text, tool_calls = message.get("content") or "", message.get("tool_calls") or []
                if not tool_calls:
                    final_text = text
                    if answer is not None:
                        step({"type": "call_tool", "tool_name": native.answer_tool, "arguments": {answer: text}})
                    break
                messages.append({"role": "assistant", "content": text, "tool_calls": tool_calls})
                for call in tool_calls:
                    name, arguments = tool_call_arguments(call)
                    result = step({"type": "call_tool", "tool_name": name, "arguments": arguments})
                    output = tool_output(result.observation)
                    calls.append(ToolCallRecord(name=name, arguments=arguments, result=output))
                    messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "name": name, "content": output})
                    if done:
                        break
            if not done and turns >= episode.max_turns and finish != "length":
                finish = "max_turns"
        finally:
            with contextlib.suppress(Exception):
                env.close()
        success = family.solved(reward)
        truncated = not done and finish in ("length", "max_turns") and not success
        return EpisodeResult(
            episode_id=episode.episode_id, task_id=episode.task_id, status="completed", reward=reward,
            success=success, outcome="truncated" if truncated else ("success" if success else "failure"),
            finish_reason=finish, turns=turns, final_text=final_text, tool_calls=calls,
            seconds=round(time.monotonic() - started, 3))


def task_text(observation: dict[str, Any]) -> str:
    """The task an MCP environment states on reset. OpenEnv has no standard field: its own environments put
    it in metadata["question"] (finqa_env) or a `question` field (reasoning_gym_env); `prompt` is also read."""
    metadata = observation.get("metadata") or {}
    for value in (observation.get("question"), observation.get("prompt"), metadata.get("question"), metadata.get("prompt")):
        if isinstance(value, str) and value.strip():
            return value
    return ""


def opening_messages_of(prompt: Any, text: str) -> list[dict[str, Any]]:
    """The row's prompt (messages or a string) with reset's task text appended to its last user message, as
    TRL's environment_factory does with what reset returns; a new user message when the last is not one."""
    messages = [dict(m) for m in prompt] if isinstance(prompt, list) else (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [])
    if text:
        if messages and messages[-1].get("role") == "user":
            messages[-1]["content"] = (messages[-1].get("content") or "") + text
        else:
            messages.append({"role": "user", "content": text})
    if not messages:
        raise ValueError("native asset: neither the dataset row (prompt) nor reset's observation (question or "
                         "prompt, or the same in its metadata) states the task")
    return messages


def _openai_tool(tool: dict[str, Any]) -> dict[str, Any]:
    schema = {key: value for key, value in (tool.get("input_schema") or {}).items() if key != "additionalProperties"}
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                             "parameters": schema or {"type": "object", "properties": {}}}}


def _answer_argument(tools: list[dict[str, Any]], answer_tool: str | None) -> str | None:
    """The one argument the answer tool takes (its text is submitted as it), or None without an answer tool."""
    if answer_tool is None:
        return None
    tool = next((t for t in tools if t["name"] == answer_tool), None)
    if tool is None:
        raise ValueError(f"native asset: answer_tool {answer_tool!r} is not one of its tools "
                         f"({', '.join(t['name'] for t in tools) or 'none'})")
    schema = tool.get("input_schema") or {}
    names = list(schema.get("required") or schema.get("properties") or [])
    if len(names) != 1:
        raise ValueError(f"native asset: answer_tool {answer_tool!r} must take one argument, the answer; it takes "
                         f"{names}")
    return names[0]


def tool_output(observation: dict[str, Any]) -> str:
    """A CallToolObservation as the text the policy reads: the error's message, else the result's data (or
    its text content)."""
    error = observation.get("error")
    if error:
        return f"Error: {error.get('message', error)}" if isinstance(error, dict) else f"Error: {error}"
    result = observation.get("result")
    if isinstance(result, dict):
        if result.get("data") is not None:
            data = result["data"]
            return data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        return "".join(part.get("text", "") for part in result.get("content") or [] if isinstance(part, dict))
    return "" if result is None else str(result)

"""The openenv rollout backend: our agent loop over an OpenEnv EnvClient session, the policy over HTTP.

Per episode: one WebSocket session (`TaskEnvClient`, OpenEnv's EnvClient; HTTP /step is stateless, so a
multi-step episode needs the socket), `reset(episode_id=..., item=...)`, then model calls to the policy's
/v1/chat/completions with header X-Episode-ID, each tool call executed as an env step, and a final-answer
step whose observation carries the reference scorer's reward. The server is `create_app(TaskEnvironment)`
under uvicorn in a subprocess we start, on a 127.0.0.1 socket we bind.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

from qualification.tasks import TaskItem, get_family, opening_messages
from runner_contracts import EpisodeResult, EpisodeSpec, ToolCallRecord
from runner_kit.policy import openai_tools, tool_call_arguments
from runner_kit.processes import SocketServer
from runner_kit.rollout import EnvironmentDown, PolicyEndpoint, ServerBackend

# Imported lazily by _env_client(): importing openenv.core pulls in gradio (~1.4 s), and probe needs none of it.
_CLIENT: Any = None


def _env_client() -> Any:
    global _CLIENT
    if _CLIENT is None:
        from .client import TaskEnvClient

        _CLIENT = TaskEnvClient
    return _CLIENT


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What a dead or unreachable environment server raises through EnvClient."""
    from websockets.exceptions import ConnectionClosed, InvalidHandshake

    return (ConnectionError, ConnectionClosed, InvalidHandshake, TimeoutError, OSError)


class EnvServer(SocketServer):
    """The uvicorn subprocess serving the OpenEnv app, on a socket bound here to 127.0.0.1."""

    name = "OpenEnv server"

    def __init__(self, max_sessions: int = 256, ready_timeout_s: float = 60.0):
        super().__init__(ready_timeout_s)
        self.max_sessions = max_sessions
        self.env = {**os.environ, "ENABLE_WEB_INTERFACE": "false"}  # create_app would otherwise mount gradio at /web

    def command(self) -> list[str]:
        return [sys.executable, "-m", "runner_stack_openenv.server", "--max-sessions", str(self.max_sessions)]


class OpenEnvBackend(ServerBackend):
    stack = "openenv"
    upstream_name = "openenv"
    capabilities = ["multi-turn-tools", "stateful-tools", "concurrent-episodes", "environment-restart", "cpu",
                    "token-capture:policy-server", "episode-id:header"]
    # Our agent loop makes every model call; the same id goes to OpenEnv's reset(episode_id=...).
    episode_id_channel = "header X-Episode-ID"

    def __init__(self, max_sessions: int = 256, policy_timeout_s: float = 300.0):
        super().__init__()
        self.server = EnvServer(max_sessions=max_sessions)
        self.policy_timeout_s = policy_timeout_s

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
        tools = openai_tools(family)
        messages = opening_messages(family, item)
        url = self.running_url()
        env = _env_client()(base_url=url, connect_timeout_s=10.0, message_timeout_s=60.0).sync()
        errors = _connection_errors()

        def on_env(what: str, call):
            try:
                return call()
            except errors as error:
                raise EnvironmentDown(f"OpenEnv {what} on {url}: {type(error).__name__}: {error}") from error

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
